"""TargetDecoder, sampling and the runtime facade on CPU (the same code the CUDA graph replays)."""
import pytest
import torch

from engine import moe_decode
from engine.bench import BenchConfig, format_bench, kernel_kind, run_bench
from engine.config import ModelConfig
from engine.decoding import cut_at_stop
from engine.errors import EngineError
from engine.loading import random_model
from engine.runtime import Engine
from engine.sampling import SamplingParams, logits_to_probs, row_max, sample
from engine.target_decoder import TargetDecoder

PROMPT = [5, 9, 200, 31, 7]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gen():
    return TargetDecoder(random_model("tiny", seed=1), 96, prefill_chunk=3)


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Full recomputation without a cache: what the cached decode loop must reproduce."""
    cache_len = model.max_seq_len
    model.drop_caches()
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([ids]), torch.arange(len(ids)))[0][0, -1].argmax())
            ids.append(t)
            out.append(t)
    model.setup_caches(cache_len)
    return out


def test_greedy_decode_equals_uncached_recomputation(gen):
    r = gen.generate(PROMPT, 20)
    assert r.token_ids == reference_greedy(gen.model, PROMPT, 20)
    assert r.prompt_len == len(PROMPT) and r.verify_cycles == 19 and r.accept_hist == [0, 19]
    assert r.accept_length == 1.0 and r.accepted_tokens == 0 and r.finish_reason == "length"
    assert r.decode_s > 0 and r.tok_s == pytest.approx(19 / r.decode_s)


def test_stream_yields_the_same_tokens_one_per_cycle(gen):
    parts = list(gen.stream(PROMPT, 12))
    assert all(len(p) == 1 for p in parts)
    assert [p[0] for p in parts] == gen.generate(PROMPT, 12).token_ids


def test_stop_ids_cut_after_the_first_stop(gen):
    full = gen.generate(PROMPT, 16).token_ids
    stop = full[5]
    first = full.index(stop)
    r = gen.generate(PROMPT, 16, stop_ids=(stop,))
    assert r.token_ids == full[: first + 1] and r.finish_reason == "stop" and r.verify_cycles == first
    assert [p[0] for p in gen.stream(PROMPT, 16, stop_ids=(stop,))] == full[: first + 1]
    assert cut_at_stop([1, 2, 3], (9,)) == ([1, 2, 3], "length")


def test_sampling_is_deterministic_per_seed_and_differs_across_seeds(gen):
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.95)
    a = gen.generate(PROMPT, 32, p, seed=7).token_ids
    assert gen.generate(PROMPT, 32, p, seed=7).token_ids == a
    assert [t[0] for t in gen.stream(PROMPT, 32, p, seed=7)] == a
    assert gen.generate(PROMPT, 32, p, seed=8).token_ids != a
    assert gen.generate(PROMPT, 32).token_ids != a  # greedy is a different path


@pytest.mark.parametrize("prompt,n,msg", [
    ([], 4, "empty"),
    (PROMPT, 0, "must be positive"),
    (PROMPT, -3, "must be positive"),
    (list(range(96)), 1, "cache holds 96"),
    (list(range(90)), 7, "exceeds the cache"),
    ([1, 512], 4, "outside the vocabulary"),
    ([-1], 4, "outside the vocabulary"),
])
def test_bad_lengths_and_ids_raise_one_line_engine_errors(gen, prompt, n, msg):
    with pytest.raises(EngineError, match=msg) as e:
        gen.generate(prompt, n)
    assert "\n" not in str(e.value)


def test_prompt_plus_tokens_may_fill_the_cache_exactly(gen):
    assert len(gen.generate(list(range(90)), 6).token_ids) == 6


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.5, 0.0, 2.9]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert set(torch.nonzero(probs[0]).flatten().tolist()) == {1, 3, 5}
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    out = logits_to_probs(probs.log(), SamplingParams(temperature=1.0, top_p=0.7))
    assert out[0].tolist() == pytest.approx([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8])


@pytest.mark.parametrize("vocab", [128256, 129280, 32000, 151936, 50257, 1000])
def test_row_max_gives_max_and_its_first_index_as_torch(vocab):
    """Chunked (vocabularies with a power-of-two factor) or not: every row's value and first index of the maximum,
    the maximum planted in the last chunk, twice across a chunk boundary, in a constant row, and as a NaN."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1, -1] = 9.0  # in the last chunk, last position
    x[2, 7], x[2, vocab // 2 + 3] = 9.0, 9.0  # a tie: the first wins
    x[3] = 0.5  # all ties: index 0
    x[4, vocab // 3] = float("nan")  # NaN counts as the maximum
    x[5, 0] = float("-inf")
    for rows in (x, x[:1], x[0], x[:, None]):  # [N, V], [1, V], [V], [N, 1, V]
        value, index = row_max(rows)
        want = rows.max(-1)
        assert index.shape == want.indices.shape and torch.equal(index, want.indices)
        torch.testing.assert_close(value, want.values, rtol=0, atol=0, equal_nan=True)
    assert row_max(x)[1][:5].tolist() == [x[0].argmax().item(), vocab - 1, 7, 0, vocab // 3]


def test_sampling_frequencies_follow_the_masked_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, -5.0, 1.5]).log_softmax(-1).repeat(20000, 1)
    p = SamplingParams(temperature=1.0, top_k=3)
    torch.manual_seed(0)
    counts = torch.bincount(sample(logits, p), minlength=5).float() / 20000
    expect = logits_to_probs(logits[:1], p)[0]
    assert counts[0] == 0 and counts[3] == 0
    assert (counts - expect).abs().max().item() < 0.02


def test_engine_facade_streams_chunks_and_generates():
    eng = Engine.load(shape="tiny", max_seq_len=64, seed=3)
    assert eng.tokenizer is None and eng.vocab_size == 512 and eng.max_seq_len == 64 and not eng.speculative
    ids = eng.encode("héllo")
    assert ids == list("héllo".encode()) and eng.decode(ids) == "héllo"
    r = eng.generate(ids, 10)
    chunks = list(eng.stream(ids, 10))
    assert [c.token_ids[0] for c in chunks] == r.token_ids
    assert [c.verify_cycles for c in chunks] == [0] + [1] * 9
    assert [c.finish_reason for c in chunks] == [None] * 9 + ["length"]
    stopped = list(eng.stream(ids, 10, stop_ids=[r.token_ids[2]]))
    assert stopped[-1].finish_reason == "stop" and len(stopped) <= 3
    with pytest.raises(EngineError, match="top_p"):
        eng.generate(ids, 4, temperature=1.0, top_p=0.0)
    with pytest.raises(EngineError, match="exactly one"):
        Engine.load(max_seq_len=64)


def test_profile_counts_the_engines_own_matrix_kernels_as_matrix_work():
    """The step's split by kind: the routed experts' Triton kernels are matrix-vector products; cuBLAS, the
    split-KV attention and inductor's fused elementwise kernels as before."""
    experts = [moe_decode._gemv_gate_up, moe_decode._gemv_down]
    assert [kernel_kind(k.__name__) for k in experts] == ["matrix"] * 2
    assert kernel_kind("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT") == "matrix"
    assert kernel_kind("_splitkv_partial") == "attention" and kernel_kind("_splitkv_merge") == "attention"
    assert kernel_kind("_pair_rows") == "other"  # a name that is no _gemv_ kernel
    assert kernel_kind("triton_poi_fused__unsafe_view_mul_silu_split_5") == "other"


def test_bench_reports_a_failed_compile_and_keeps_the_other_numbers(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("inductor unavailable\ndetails")

    monkeypatch.setattr(torch, "compile", no_compiler)
    eng = Engine.load(shape="tiny", max_seq_len=64)
    r = run_bench(eng, BenchConfig(prompt_len=8, new_tokens=8, repeats=1, sizes=(1,), eager=False, peer=False,
                                   compile=True))
    assert r.errors == {"compiled": "RuntimeError: inductor unavailable"} and set(r.decode) == {"graph"}
    with pytest.raises(EngineError, match="inductor unavailable"):  # nothing left to report: say why
        run_bench(eng, BenchConfig(prompt_len=8, new_tokens=8, repeats=1, sizes=(1,), eager=False, peer=False,
                                   compile=True, plain=False))


def test_bench_times_the_compiled_decode_alone_when_asked(monkeypatch):
    """plain=False (the long-context run): only the compiled decode is timed, and it is what gets profiled."""
    calls = []

    def counting_compile(fn, **kwargs):
        calls.append(fn)
        return fn  # the layer runs as written: what is tested is which decoders run_bench builds

    monkeypatch.setattr(torch, "compile", counting_compile)
    eng = Engine.load(shape="tiny", max_seq_len=64)
    r = run_bench(eng, BenchConfig(prompt_len=8, new_tokens=8, repeats=1, sizes=(1,), eager=False, peer=False,
                                   compile=True, plain=False, torch_profile=True))
    assert set(r.decode) == {"compiled"} and calls and r.profiled == "eager"  # on CPU the step runs eagerly
    text = format_bench(r)
    assert "\ncompiled " in text and "\ngraph " not in text and "the compiled step spends" in text


def test_bench_times_the_eager_decode_on_its_own_token_count(monkeypatch):
    """eager_tokens: the eager generations are that long, the graph ones new_tokens long; out of range is refused."""
    from engine.target_decoder import TargetDecoder

    lengths: dict[bool, set[int]] = {True: set(), False: set()}
    generate = TargetDecoder.generate

    def spy(self, prompt, n, *args, **kwargs):
        lengths[self.cuda_graphs].add(n)
        return generate(self, prompt, n, *args, **kwargs)

    monkeypatch.setattr(TargetDecoder, "generate", spy)
    eng = Engine.load(shape="tiny", max_seq_len=64)
    r = run_bench(eng, BenchConfig(prompt_len=8, new_tokens=12, repeats=2, sizes=(1,), eager_tokens=4, peer=False))
    assert lengths == {True: {8, 12}, False: {4}}  # 8 (capped at 4 for eager): the untimed warm-up generation
    assert len(r.decode["eager"].samples) == 2 and r.decode["eager"].tok_s > 0
    for bad in (1, 13):
        with pytest.raises(EngineError, match="eager tokens"):
            run_bench(eng, BenchConfig(prompt_len=8, new_tokens=12, repeats=1, sizes=(1,), eager_tokens=bad,
                                       peer=False))


def test_compiled_decode_compiles_one_layer_for_the_whole_stack():
    """Regional compilation: the decode step's layers share one compiled graph (dynamo guards on the layer's
    structure, not its identity), so a deeper model costs no more compiles; the tokens are the eager decode's."""
    from torch._dynamo.utils import counters

    model = random_model(ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    prompt = list(range(3, 19))
    eager = TargetDecoder(model, 64, cuda_graphs=False).generate(prompt, 12).token_ids
    torch._dynamo.reset()
    counters.clear()
    compiled = TargetDecoder(model, 64, cuda_graphs=False, compile=True).generate(prompt, 12).token_ids
    assert counters["stats"]["unique_graphs"] == 1  # not one per layer: 6 would mean no sharing
    assert compiled == eager
    assert "_compiled_layers" not in model.state_dict() and len(model.state_dict()) == len(
        random_model(model.cfg).state_dict())  # the wrappers stay outside the module tree


@pytest.mark.parametrize("shape", ["tiny", "deepseek-v3-tiny"])
def test_layers_handing_on_h_and_residual_give_the_textbook_pre_norm_bits(shape):
    """Each layer returns (h, residual) and the next one adds them first (so that a compiled layer fuses that add
    with its norm). Eagerly that must be the textbook pre-norm stack to the bit, in bf16 where any other order of
    the adds would round differently - the logits and the EAGLE-3 features (each taken layer's input)."""
    model = random_model(shape, seed=3).to(torch.bfloat16)
    cfg, n = model.cfg, model.cfg.num_hidden_layers
    ids, pos = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0)), torch.arange(9)
    taken_at = (0, n // 2, n)
    with torch.no_grad():
        logits, aux = model(ids, pos, hidden_layers=taken_at)
        cos, sin = model.rope_cos[pos], model.rope_sin[pos]
        x, inputs = model.embed_tokens(ids), []
        for layer in model.layers:
            inputs.append(x)
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, None, None)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        inputs.append(x)
        want = model.lm_head(model.norm(x)).float()
    assert torch.equal(logits, want)
    assert torch.equal(aux, torch.cat([inputs[i] for i in taken_at], dim=-1))


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45, 1e-6])
def test_a_tiny_temperature_decodes_greedily(gen, temperature):
    """logits / 1e-300 overflow to inf and softmax to NaN: below the floor the choice is the greedy one, as in
    vLLM, not token 0 forever."""
    tiny = SamplingParams(temperature=temperature, top_k=5, top_p=0.9)
    assert tiny.greedy
    assert gen.generate(PROMPT, 12, tiny).token_ids == gen.generate(PROMPT, 12).token_ids
    probs = logits_to_probs(torch.tensor([[0.5, 3.0, -1.0]]), tiny)
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_a_small_temperature_above_the_floor_still_samples_a_finite_distribution():
    p = SamplingParams(temperature=1e-4)
    probs = logits_to_probs(torch.tensor([[30.0, 30.0 + 1e-4, -30.0]]), p)
    assert not p.greedy and bool(torch.isfinite(probs).all())
    assert probs[0, 2] == 0 and 0.2 < probs[0, 0] < 0.5  # two near-ties share the mass
