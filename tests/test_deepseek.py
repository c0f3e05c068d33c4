"""DeepSeek-V3 / Kimi-K2 family against transformers' own DeepseekV3ForCausalLM (fp32, CPU), plus bad input."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import deepseek
from engine.config import ModelConfig
from engine.errors import EngineError
from engine.loading import load_model, random_model, save_model, transformers_twin
from engine.model import Transformer
from engine.shapes import shape_config
from engine.target_decoder import TargetDecoder

import transformers  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-4


def tiny(**over) -> ModelConfig:
    """3 layers (the first dense), 16 experts in 4 groups, 3 routed + 1 shared; rms_norm_eps differs from the
    latent norms' fixed 1e-6 so that mixing them up shows. Decode (N=1) takes the gather path, prefill the
    all-experts path."""
    d = dict(model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=12, n_routed_experts=16, num_experts_per_tok=3, n_shared_experts=1,
             moe_intermediate_size=24, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=4, topk_group=2,
             rms_norm_eps=1e-5, max_position_embeddings=512, rope_theta=10000.0)
    return ModelConfig(**{**d, **over})


YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
            mscale=0.707, mscale_all_dim=0.707)


def engine_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Random weights with a spread-out score-correction bias (it must change routing) and a sharpened lm_head
    (greedy argmax must not hinge on rounding)."""
    m = random_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in m.layers:
            if isinstance(layer.mlp, deepseek.MoE):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=g) * 0.1)
        m.lm_head.weight.mul_(10)
    return m


def hf_pair(cfg: ModelConfig, tmp_path, seed: int = 0):
    m = engine_model(cfg, seed)
    save_model(m, tmp_path / "ckpt")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    return m, hf


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


CASES = {
    "q_lora": {},
    "no_q_lora": dict(q_lora_rank=None),
    "yarn": dict(rope_scaling=YARN),
    "no_q_lora_yarn_no_interleave": dict(q_lora_rank=None, rope_scaling=YARN, rope_interleave=False),
}


def test_transformers_twin_is_the_checkpoint_transformers_loads(tmp_path):
    """bench's peer on the MLA + MoE family: built in memory, the same logits as the saved and reloaded checkpoint."""
    m, hf = hf_pair(shape_config("deepseek-v3-tiny"), tmp_path)
    twin = transformers_twin(m)
    ids = list(range(3, 30))
    assert type(twin) is transformers.DeepseekV3ForCausalLM
    assert torch.equal(hf_logits(twin, ids), hf_logits(hf, ids))


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_logits_match_transformers_prefill_decode_and_tree_chunk(case, tmp_path):
    cfg = tiny(**CASES[case])
    m, hf = hf_pair(cfg, tmp_path)
    S = 64
    m.setup_caches(S)
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, cfg.vocab_size, (20,), generator=g).tolist()
    P = 12
    out, _ = m(torch.tensor([seq[:P]]), torch.arange(P))
    ref = hf_logits(hf, seq)
    torch.testing.assert_close(out[0], ref[:P], atol=TOL, rtol=0)
    for p in range(P, P + 3):  # single-token decodes
        out, _ = m(torch.tensor([[seq[p]]]), torch.tensor([p]))
        torch.testing.assert_close(out[0, 0], ref[p], atol=TOL, rtol=0)
    # A tree chunk after prefix n: node 0 at depth 0, nodes 1 and 2 its children, node 3 the child of node 2.
    # Slots are consecutive, positions are n + depth, the mask says who sees whom.
    n = P + 3
    a, b, c, d, e = seq[n:n + 5]
    parent = [-1, 0, 0, 2]
    depth = torch.tensor([0, 1, 1, 2])
    mask = torch.zeros(4, S, dtype=torch.bool)
    mask[:, :n] = True
    for i in range(4):
        j = i
        while j >= 0:
            mask[i, n + j] = True
            j = parent[j]
    slots = torch.arange(n, n + 4)
    out, _ = m(torch.tensor([[a, b, c, d]]), n + depth, cache_slots=slots, attn_mask=mask)
    path_b = hf_logits(hf, seq[:n] + [a, b])
    path_cd = hf_logits(hf, seq[:n] + [a, c, d, e])
    torch.testing.assert_close(out[0, 0], path_cd[n], atol=TOL, rtol=0)
    torch.testing.assert_close(out[0, 1], path_b[n + 1], atol=TOL, rtol=0)
    torch.testing.assert_close(out[0, 2], path_cd[n + 1], atol=TOL, rtol=0)
    torch.testing.assert_close(out[0, 3], path_cd[n + 2], atol=TOL, rtol=0)
    # accept a -> c -> d: compact their cache entries into place, then decode e after them
    m.move_cache(torch.tensor([n, n + 2, n + 3]), torch.tensor([n, n + 1, n + 2]))
    out, _ = m(torch.tensor([[e]]), torch.tensor([n + 3]))
    torch.testing.assert_close(out[0, 0], path_cd[n + 3], atol=TOL, rtol=0)


@torch.no_grad()
def test_uncached_forward_and_hidden_layers_match_transformers(tmp_path):
    cfg = tiny(num_hidden_layers=5, first_k_dense_replace=2, n_shared_experts=2)
    m, hf = hf_pair(cfg, tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    layers = cfg.default_aux_layers()
    out, aux = m(ids, torch.arange(9), hidden_layers=layers)
    ref = hf(ids, output_hidden_states=True)
    torch.testing.assert_close(out, ref.logits, atol=TOL, rtol=0)
    # hidden_states[i] is the residual stream entering layer i (0: the embeddings)
    want = torch.cat([ref.hidden_states[i] for i in layers], dim=-1)
    assert aux.shape == (1, 9, 3 * cfg.hidden_size)
    torch.testing.assert_close(aux, want, atol=TOL, rtol=0)


@torch.no_grad()
def test_greedy_generation_identical_to_transformers_for_64_tokens(tmp_path):
    cfg = tiny(rope_scaling=YARN)
    m, hf = hf_pair(cfg, tmp_path, seed=7)
    prompt = torch.randint(0, cfg.vocab_size, (10,), generator=torch.Generator().manual_seed(11)).tolist()
    ours = TargetDecoder(m, max_seq_len=128, cuda_graphs=False, prefill_chunk=4).generate(prompt, 64).token_ids
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
    assert ours == theirs[0, len(prompt):].tolist()
    assert len(set(ours)) > 4  # a real continuation, not one token repeated


@pytest.mark.parametrize("shape", ["deepseek-v3", "kimi-k2"])
@pytest.mark.parametrize("variant", [{}, {"truncate": False}, {"original_max_position_embeddings": None}])
def test_yarn_tables_match_transformers(shape, variant):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.rope import inv_freq_and_scale

    cfg = shape_config(shape)
    cfg.rope_scaling = {k: v for k, v in {**cfg.rope_scaling, **variant}.items() if v is not None}
    hf = transformers.DeepseekV3Config(**{k: v for k, v in cfg.to_hf().items() if k not in ("rope_scaling",
                                                                                           "rope_theta")},
                                       rope_parameters=dict(cfg.rope_scaling, rope_theta=cfg.rope_theta))
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
    got, scale = inv_freq_and_scale(cfg, cfg.qk_rope_head_dim)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-6)
    assert scale == pytest.approx(want_scale)


@pytest.mark.parametrize("n", [1, 3, 40])
def test_expert_paths_agree(n):
    """Grouped GEMM (inference) and all-experts (training) paths; 40 tokens leave no expert unused."""
    experts = engine_model(tiny()).layers[1].mlp.experts
    x = torch.randn(n, 64)
    weights, idx = torch.rand(n, 3), torch.stack([torch.randperm(16)[:3] for _ in range(n)])
    with torch.no_grad():
        grouped = experts(x, weights, idx)
    dense = experts(x, weights, idx)
    assert dense.requires_grad and not grouped.requires_grad
    torch.testing.assert_close(grouped, dense.detach(), atol=1e-6, rtol=0)
    assert grouped.abs().max() > 0


def test_routing_uses_bias_for_choice_and_groups():
    cfg = tiny(n_routed_experts=8, n_group=4, topk_group=1, num_experts_per_tok=2, norm_topk_prob=False,
               routed_scaling_factor=1.0)
    router = deepseek.Router(cfg)
    with torch.no_grad():
        router.weight.zero_()  # all sigmoid scores 0.5: only the bias decides
        router.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.2, 0.0]))
    w, idx = router(torch.randn(1, cfg.hidden_size))
    assert sorted(idx[0].tolist()) == [4, 5]  # group 2 ({4, 5}) scores 0.3 > group 3 ({6, 7}) 0.2
    torch.testing.assert_close(w, torch.full((1, 2), 0.5))  # weights are the unbiased scores


def test_router_stays_float32_under_bf16():
    m = engine_model(tiny()).to(torch.bfloat16)
    gate = m.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert m.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16


def test_cache_holds_latent_only_and_bytes_per_token():
    cfg = tiny()
    m = random_model(cfg)
    m.setup_caches(32)
    cache = m.layers[0].self_attn.cache
    assert cache.latent.shape == (1, 32, cfg.kv_lora_rank) and cache.k_rope.shape == (1, 32, cfg.qk_rope_head_dim)
    want = deepseek.cache_bytes_per_token(cfg, torch.float32)
    assert m.cache_bytes_per_token() == want.latent
    k2 = deepseek.cache_bytes_per_token(shape_config("kimi-k2"))
    # per layer: 512 + 64 latent values against 64 heads x (128 + 64 key + 128 value)
    assert k2.latent == 61 * (512 + 64) * 2 and k2.expanded == 61 * 64 * 320 * 2
    assert k2.ratio > 35


@torch.no_grad()
def test_expert_reads_are_the_experts_a_forward_depends_on():
    """The experts expert_reads lists are exactly those the logits depend on: zeroing all others changes nothing,
    zeroing any one listed changes the logits. One token reads top_k a layer; 8 tokens read more."""
    cfg = tiny()
    m = engine_model(cfg)
    m.setup_caches(32)
    ids, pos = torch.arange(3, 11)[None], torch.arange(8)
    one = deepseek.expert_reads(m, ids[:, :1], pos[:1])
    assert [len(e) for e in one.experts] == [cfg.num_experts_per_tok] * (cfg.num_hidden_layers - 1)
    assert one.weight_bytes == m.weight_bytes()
    reads = deepseek.expert_reads(m, ids, pos)
    assert reads.mean > cfg.num_experts_per_tok
    per_expert = m.layers[1].mlp.experts.expert_bytes()
    assert reads.weight_bytes == m.weight_bytes() + per_expert * sum(len(e) - cfg.num_experts_per_tok
                                                                      for e in reads.experts)
    ref = m(ids, pos)[0]
    moe = [layer.mlp.experts for layer in m.layers if isinstance(layer.mlp, deepseek.MoE)]
    for x, used in zip(moe, reads.experts):
        unused = [e for e in range(cfg.n_routed_experts) if e not in used]
        x.gate_up_proj[unused] = 0
        x.down_proj[unused] = 0
    assert torch.equal(m(ids, pos)[0], ref)
    moe[0].down_proj[reads.experts[0][0]] = 0
    assert not torch.allclose(m(ids, pos)[0], ref)


def test_kimi_k2_config_and_active_bytes():
    d = {**shape_config("kimi-k2").to_hf(), "model_type": "kimi_k2"}
    d["rope_scaling"] = {**d["rope_scaling"], "type": "yarn"}
    del d["rope_scaling"]["rope_type"]
    cfg = ModelConfig.from_hf(d)
    assert cfg.is_mla and cfg.rope_scaling["rope_type"] == "yarn" and cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)
    with torch.device("meta"):
        m = Transformer(cfg).to(torch.bfloat16)
    total = sum(p.numel() for p in m.parameters())
    active = m.weight_bytes() / 2
    assert 1.0e12 < total < 1.05e12  # "1T total"
    assert 31e9 < active < 33e9  # "32B activated" (the embedding row aside, the fp32 router counted twice)


def test_saved_checkpoint_round_trip(tmp_path):
    m = engine_model(tiny(q_lora_rank=None))
    save_model(m, tmp_path)
    keys = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in keys
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys
    m2 = load_model(tmp_path)
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k


@torch.no_grad()
def test_checkpoint_written_by_transformers_loads(tmp_path):
    """transformers 5 spells the rope as rope_parameters and writes per-expert tensors; q_lora_rank unset."""
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        max_position_embeddings=256, rope_parameters=dict(rope_theta=10000.0, **YARN))
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    for layer in hf.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    m = load_model(tmp_path)
    assert m.cfg.rope_scaling["rope_type"] == "yarn" and m.cfg.q_lora_rank is None
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    m.setup_caches(16)
    torch.testing.assert_close(m(ids, torch.arange(10))[0], hf(ids).logits, atol=TOL, rtol=0)


# --- bad input -----------------------------------------------------------------------------------------------

def _edit(path, drop=(), config=None):
    f = path / "model.safetensors"
    sd = {k: v for k, v in load_file(str(f)).items() if k not in drop}
    save_file(sd, str(f))
    if config:
        c = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**c, **config}))


@pytest.fixture
def ckpt(tmp_path):
    save_model(engine_model(tiny()), tmp_path)
    return tmp_path


def test_missing_expert_tensor_is_named(ckpt):
    _edit(ckpt, drop=["model.layers.2.mlp.experts.7.up_proj.weight"])
    with pytest.raises(EngineError, match=r"missing tensor layers\.2\.mlp\.experts\.7\.up_proj\.weight"):
        load_model(ckpt)


@pytest.mark.parametrize("n,pattern", [(12, r"unexpected tensor .*experts\.12\..*n_routed_experts"),
                                       (20, r"missing tensor .*experts\.16\..*n_routed_experts")])
def test_expert_count_mismatch(ckpt, n, pattern):
    _edit(ckpt, config={"n_routed_experts": n})
    with pytest.raises(EngineError, match=pattern):
        load_model(ckpt)


@pytest.mark.parametrize("field,value", [("kv_lora_rank", 16), ("q_lora_rank", 48), ("moe_intermediate_size", 20),
                                         ("v_head_dim", 8)])
def test_rank_mismatch_names_field(ckpt, field, value):
    _edit(ckpt, config={field: value})
    with pytest.raises(EngineError, match=rf"has shape .*config fields: .*{field}"):
        load_model(ckpt)


def test_q_lora_in_config_but_not_in_weights(tmp_path):
    save_model(engine_model(tiny(q_lora_rank=None)), tmp_path)
    _edit(tmp_path, config={"q_lora_rank": 32})
    with pytest.raises(EngineError, match=r"missing tensor .*q_lora_rank"):
        load_model(tmp_path)


def test_cli_reports_a_missing_expert_in_one_line(ckpt):
    from click.testing import CliRunner

    from engine.__main__ import cli

    _edit(ckpt, drop=["model.layers.1.mlp.experts.0.down_proj.weight"])
    r = CliRunner().invoke(cli, ["generate", "--target", str(ckpt), "--prompt-ids", "1,2", "--device", "cpu"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.stderr.strip().count("\n") == 0 and "experts.0.down_proj.weight" in r.stderr


@pytest.mark.parametrize("field,value", [("topk_method", "greedy"), ("scoring_func", "softmax"), ("n_group", 3),
                                         ("topk_group", 5), ("num_experts_per_tok", 9)])
def test_unimplemented_routing_is_refused(field, value):
    with pytest.raises(EngineError, match=field):
        Transformer(dataclasses.replace(tiny(), **{field: value}))


# --- GPU -----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_graph_decode_and_verify_equal_eager_on_cuda():
    from engine.graphs import CapturedCall

    cfg = tiny(rope_scaling=YARN, num_hidden_layers=4)
    m = engine_model(cfg).to("cuda", torch.bfloat16)
    prompt = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    eager = TargetDecoder(m, 128, cuda_graphs=False).generate(prompt, 48).token_ids
    graphed = TargetDecoder(m, 128, cuda_graphs=True).generate(prompt, 48).token_ids
    assert graphed == eager
    # an 8-token verify forward, captured vs eager, over the same cache contents
    m.setup_caches(128)
    ids = torch.tensor([prompt], device="cuda")
    m(ids, torch.arange(12, device="cuda"))
    inputs = {"input_ids": ids[:, :8].clone(), "input_pos": torch.arange(12, 20, device="cuda")}
    want = m(**inputs)[0].clone()
    call = CapturedCall(lambda input_ids, input_pos: m(input_ids, input_pos)[0], inputs)
    assert call.captured
    torch.testing.assert_close(call(**inputs), want, atol=2e-2, rtol=2e-2)  # bf16; cuBLAS may pick other kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_experts_on_cuda_match_all_experts():
    experts = engine_model(tiny()).layers[1].mlp.experts.to("cuda", torch.bfloat16)
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    weights = torch.rand(8, 3, device="cuda")
    idx = torch.stack([torch.randperm(16)[:3] for _ in range(8)]).cuda()
    with torch.no_grad():
        grouped = experts(x, weights, idx)
    assert deepseek.grouped_mm_ok(x) == (torch.cuda.get_device_capability()[0] in (9, 10))
    torch.testing.assert_close(grouped, experts(x, weights, idx).detach(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_decode_traces_as_one_graph(dtype):
    """TargetDecoder(compile=True) compiles the forward with fullgraph=True: no graph breaks in MLA or MoE."""
    torch._dynamo.reset()
    m = engine_model(tiny(num_hidden_layers=2)).to(dtype)
    m.setup_caches(16)
    m(torch.tensor([[1, 2, 3]]), torch.arange(3))
    compiled = torch.compile(m, fullgraph=True, dynamic=False, backend="eager")
    got = compiled(torch.tensor([[4]]), torch.tensor([3]))[0]
    torch.testing.assert_close(got, m(torch.tensor([[4]]), torch.tensor([3]))[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("experts,groups,topk_group,k", [(64, 8, 4, 6), (16, 4, 2, 3), (256, 8, 4, 8)])
def test_router_selects_the_same_experts_by_ranks_as_by_topk(experts, groups, topk_group, k):
    """The ranks' selection (what torch.compile runs) against torch.topk's (eager): the same ids in the same order,
    largest first, on random scores and on scores with a planted near-tie; ties go to the lower index."""
    cfg = tiny(n_routed_experts=experts, n_group=groups, topk_group=topk_group, num_experts_per_tok=k)
    router = deepseek.Router(cfg)
    g = torch.Generator().manual_seed(experts)
    choice = torch.rand(32, experts, generator=g)
    choice[0, 1] = torch.nextafter(choice[0, 0], torch.tensor(2.0))  # one ulp apart
    by_topk, by_ranks = router.select_by_topk(choice), router.select_by_ranks(choice)
    assert by_ranks.dtype == by_topk.dtype and torch.equal(by_ranks, by_topk)
    assert (choice.gather(1, by_ranks).diff(dim=1) <= 0).all()  # largest first
    tied = router.select_by_ranks(torch.full((1, experts), 0.5))
    assert tied[0].tolist() == list(range(k))  # all groups tie: the first groups, their first experts


def test_ranks_place_every_element_as_a_descending_sort_would():
    x = torch.randn(5, 3, 40, generator=torch.Generator().manual_seed(0))
    x[0, 0, 7] = x[0, 0, 3]  # a tie: the lower index first
    want = torch.empty_like(x, dtype=torch.long).scatter_(-1, x.argsort(dim=-1, descending=True, stable=True),
                                                          torch.arange(40).expand_as(x))
    assert torch.equal(deepseek.ranks(x), want)


def test_compiled_router_gives_the_eager_routers_ids_and_weights():
    cfg = tiny(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3)
    router = deepseek.Router(cfg)
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        eager = router(x)
        compiled = torch.compile(router, fullgraph=True, dynamic=False)(x)
    assert torch.equal(compiled[1], eager[1])
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)
