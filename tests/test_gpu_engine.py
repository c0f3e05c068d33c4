"""CUDA-only checks of the engine core: graph replay equals eager execution, graphs for every verify size, bf16,
no host synchronisation inside the decode loop. Skipped without a GPU; the lead runs them on an H200."""
import pytest
import torch

from engine.bench import BenchConfig, run_bench
from engine.graphs import GraphSet
from engine.loading import random_model
from engine.runtime import Engine
from engine.sampling import SamplingParams
from engine.target_decoder import TargetDecoder
from engine.train import loop  # on import: the cuBLAS workspace setting strict determinism needs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROMPT = list(range(3, 40))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request):
    return random_model("small", device="cuda", dtype=request.param, seed=2)


def test_graph_decode_equals_eager_decode(model):
    eager = TargetDecoder(model, 256, cuda_graphs=False).generate(PROMPT, 64)
    gen = TargetDecoder(model, 256, cuda_graphs=True)
    graph = gen.generate(PROMPT, 64)
    assert gen._calls[SamplingParams()].captured
    assert graph.token_ids == eager.token_ids and len(graph.token_ids) == 64


def test_graph_sampling_is_seeded(model):
    gen = TargetDecoder(model, 256)
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.9)
    a = gen.generate(PROMPT, 48, p, seed=11).token_ids
    assert gen.generate(PROMPT, 48, p, seed=11).token_ids == a
    assert [t[0] for t in gen.stream(PROMPT, 48, p, seed=11)] == a
    assert gen.generate(PROMPT, 48, p, seed=12).token_ids != a


def test_decode_loop_has_no_host_sync(model):
    for graphs in (True, False):
        gen = TargetDecoder(model, 256, cuda_graphs=graphs)
        step, _, _ = gen.begin(PROMPT, 32, SamplingParams(temperature=1.0, top_k=20, top_p=0.9), seed=0)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(31):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert int(gen.state.idx) == 32


@torch.no_grad()
def test_graphs_for_every_token_count_match_eager(model):
    sizes = (1, 2, 4, 8, 16, 32, 64)
    model.setup_caches(256)
    start = 100

    def make(t):
        return {"input_ids": torch.randint(0, model.cfg.vocab_size, (1, t), device="cuda"),
                "input_pos": torch.arange(start, start + t, device="cuda")}

    graphs = GraphSet(lambda input_ids, input_pos: model(input_ids, input_pos)[0], make, sizes)
    tol = 1e-4 if model.dtype == torch.float32 else 2e-2
    for t in sizes:
        assert graphs.calls[t].captured
        ids = torch.randint(0, model.cfg.vocab_size, (1, t), device="cuda")
        pos = torch.arange(start, start + t, device="cuda")
        got = graphs(t, input_ids=ids, input_pos=pos).clone()
        torch.testing.assert_close(got, model(ids, pos)[0], atol=tol, rtol=tol)


def test_compiled_step_inside_the_graph_matches_eager():
    model = random_model("small", device="cuda", dtype="float32", seed=4)
    eager = TargetDecoder(model, 128, cuda_graphs=False).generate(PROMPT, 32).token_ids
    assert TargetDecoder(model, 128, compile=True).generate(PROMPT, 32).token_ids == eager


def test_engine_bf16_and_bench_on_cuda():
    eng = Engine.load(shape="small", device="cuda", dtype="bf16", max_seq_len=256)
    r = eng.generate(PROMPT, 32)
    assert len(r.token_ids) == 32 and all(0 <= t < eng.vocab_size for t in r.token_ids) and r.tok_s > 0
    b = run_bench(eng, BenchConfig(prompt_len=32, new_tokens=32, repeats=1, sizes=(1, 8), torch_profile=True))
    assert b.graphs and set(b.forward_ms) == {"graph", "eager"} and b.copy_gb_s > 100
    assert 0 < b.decode["graph"].bw_util < 1.2 and b.peer_tok_s > 0
    assert b.decode["graph"].tok_s > b.decode["eager"].tok_s  # graph replay beats per-kernel launches
    assert 0 < b.gemv_ms < b.decode["graph"].ms_per_token  # the matrix work alone is a floor
    assert b.step_ms["matrix"] > 0 and b.step_ms["attention"] > 0 and b.step_ms["kernels"] > 20


@pytest.mark.parametrize("heads,kv,T,S,valid", [(32, 8, 1, 384, 200), (32, 8, 8, 384, 300), (16, 4, 16, 4096, 4000),
                                                (8, 8, 4, 130, 100)])
def test_split_kv_attention_matches_sdpa(heads, kv, T, S, valid):
    """The split-KV kernel against SDPA (the `attention` choices); its in-kernel merge and its grouped merge give
    the separate merge's bits (same sums in the same order)."""
    from engine import decode_attention
    from engine.decode_attention import grouped_merge
    from engine.model import sdpa, split_kv

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, T, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, kv, S, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    causal = torch.arange(S, device="cuda")[None, :] <= torch.arange(valid - T, valid, device="cuda")[:, None]
    tree = causal & (torch.rand(T, S, device="cuda", generator=g) < 0.7)  # arbitrary visibility, as a tree mask
    tree[:, 0] = True
    for mask in (causal, tree):
        assert decode_attention.available(q, k, heads // kv * T)
        got = split_kv(q, k, v, mask)
        want = sdpa(q, k, v, mask)
        assert (got.float() - want.float()).abs().max().item() < 2e-2
        counts = torch.zeros(kv, dtype=torch.int32, device="cuda")
        merged_in_kernel = split_kv(q, k, v, mask, counts)
        assert torch.equal(merged_in_kernel, got) and not counts.any()  # same sums in the same order; counts reset
        assert torch.equal(split_kv(q, k, v, mask, counts, merge=grouped_merge), got) and not counts.any()
        assert torch.equal(split_kv(q, k, v, mask, merge=grouped_merge), got)
        assert torch.equal(split_kv(q, k, v, mask, counts, fuse_merge=False), got) and not counts.any()


def test_split_kv_merge_in_kernel_replays_in_a_cuda_graph():
    """The last block of each KV head merges and sets its count back to zero, so a captured call gives the
    separate merge's bits on every replay, with new inputs each time."""
    from engine.decode_attention import split_kv_attention

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 8, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    mask = torch.ones(1, 4096, dtype=torch.bool, device="cuda")
    counts = torch.zeros(16, dtype=torch.int32, device="cuda")
    split_kv_attention(q, k, v, mask, 1, counts)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = split_kv_attention(q, k, v, mask, 1, counts)
    for i in range(5):
        q.normal_(generator=g)
        mask[0, 4096 - 500 * i:] = False
        graph.replay()
        assert torch.equal(out, split_kv_attention(q, k, v, mask, 1)), i
    assert not counts.any()
    counts.fill_(1000)  # counts past every split's: no block finds itself last, nothing merges - the counts are read
    q.normal_(generator=g)  # (and memory the allocator hands back holds no result for this q)
    assert not torch.equal(split_kv_attention(q, k, v, mask, 1, counts), split_kv_attention(q, k, v, mask, 1))


def test_training_attention_on_cuda_equals_the_stacked_masked_form():
    """Without a mask (training) CUDA takes flash attention with GQA and causality built in; it must compute what
    the stacked-heads form with an explicit causal mask computes, forward and backward."""
    from engine.model import split_kv

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, 64, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for h in (8, 2, 2))
    causal = torch.ones(64, 64, dtype=torch.bool, device="cuda").tril()
    (fast := split_kv(q, k, v, None)).float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (ref := split_kv(q, k, v, causal)).float().square().sum().backward()
    torch.testing.assert_close(fast, ref, atol=2e-2, rtol=2e-2)
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("heads,kv", [(8, 2), (4, 4)])
def test_ttt_attention_backward_is_bit_for_bit_deterministic_in_bf16(heads, kv):
    """Training-time test's attention (engine.train.drafter.ttt_attention, plain matmuls and elementwise ops) under
    strict deterministic algorithms, as training runs: two backward passes give bit-identical gradients in bf16, and
    output and gradients are close to the float32 masked form over the concatenated keys."""
    from engine.model import split_kv
    from engine.train.drafter import ttt_attention, ttt_mask

    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, Dh, j = 2, 256, 64, 6
    inputs = [torch.randn(B, h, T, Dh, device="cuda", generator=g) for h in [heads] + [kv] * (2 * j + 2)]
    w = torch.randn(B, heads, T, Dh, device="cuda", generator=g)  # weights every output element differently

    def run(attend, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in inputs]
        out = attend(leaves[0], leaves[1:j + 2], leaves[j + 2:])
        (out.float() * w).sum().backward()
        return [out.detach()] + [t.grad for t in leaves]  # output, then grads of q, k_0..k_j, v_0..v_j

    def masked(q, k, v):
        return split_kv(q, torch.cat(k, dim=2), torch.cat(v, dim=2), ttt_mask(T, j, "cuda"))

    with loop.reproducible():
        first, second = run(ttt_attention, torch.bfloat16), run(ttt_attention, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    for got, want in zip(first, run(masked, torch.float32), strict=True):
        assert ((got.float() - want).norm() / want.norm()).item() < 2e-2


def test_moe_decode_kernels_on_cuda():
    """engine/moe_decode.py on the deepseek-v3-mini experts' shapes in bf16: as close to float32 math as the grouped
    GEMM it would replace (the same roundings, another summation order), in a CUDA graph replayed with other experts,
    and under torch.compile."""
    from engine.deepseek import Experts
    from engine.moe_decode import routed_experts

    g = torch.Generator(device="cuda").manual_seed(0)
    E, H, I, k = 64, 2048, 1408, 6
    ex = Experts(E, H, I).cuda()
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5)
        ex.down_proj.copy_(torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5)
    eb = Experts(E, H, I).cuda().bfloat16()
    eb.load_state_dict({n: t.bfloat16() for n, t in ex.state_dict().items()})
    truth = Experts(E, H, I).cuda()
    truth.load_state_dict({n: t.float() for n, t in eb.state_dict().items()})

    def route(n):
        idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(n)])
        return torch.rand(n, k, device="cuda", generator=g), idx

    with torch.no_grad():
        for n in (1, 8):
            x = torch.randn(n, H, device="cuda", generator=g).bfloat16()
            w, idx = route(n)
            want = truth._all_experts(x.float(), w, idx)
            err_grouped = (eb._grouped(x, w, idx).float() - want).abs().max().item()
            err_kernel = (routed_experts(x, w, idx, eb.gate_up_proj, eb.down_proj).float() - want).abs().max().item()
            assert err_kernel <= 1.5 * err_grouped + 1e-3 * want.abs().max().item(), (n, err_kernel, err_grouped)

        x = torch.randn(1, H, device="cuda", generator=g).bfloat16()
        w, idx = route(1)
        call = lambda: routed_experts(x, w, idx, eb.gate_up_proj, eb.down_proj)  # noqa: E731
        call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for _ in range(3):  # new experts in the same buffers: the graph reads them, no host sync baked in
            w2, idx2 = route(1)
            w.copy_(w2), idx.copy_(idx2)
            graph.replay()
            assert torch.equal(out, call())
        compiled = torch.compile(routed_experts, fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x, w, idx, eb.gate_up_proj, eb.down_proj), call())


def test_experts_route_few_tokens_through_moe_decode():
    """deepseek.Experts.forward on a GPU in bf16: a decode step and a verify of 8 run engine/moe_decode.py (its
    output, to the bit, and each token's output the same whatever the batch), a prefill the grouped GEMM, and
    training every expert."""
    from engine.deepseek import Experts
    from engine.moe_decode import MAX_PAIRS, routed_experts

    g = torch.Generator(device="cuda").manual_seed(1)
    E, H, I, k = 64, 2048, 1408, 6
    eb = Experts(E, H, I).cuda().bfloat16()
    with torch.no_grad():
        eb.gate_up_proj.normal_(0, H ** -0.5, generator=g)
        eb.down_proj.normal_(0, I ** -0.5, generator=g)

    def inputs(n):
        idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(n)])
        x = torch.randn(n, H, device="cuda", generator=g).bfloat16()
        return x, torch.rand(n, k, device="cuda", generator=g), idx

    with torch.no_grad():
        x, w, idx = inputs(8)
        out8 = eb(x, w, idx)
        assert torch.equal(out8, routed_experts(x, w, idx, eb.gate_up_proj, eb.down_proj))
        for i in range(8):  # batch-invariant: a token alone gives the same bits as in a verify of 8
            assert torch.equal(eb(x[i:i + 1], w[i:i + 1], idx[i:i + 1]), out8[i:i + 1])
        n = MAX_PAIRS // k + 1  # past the kernels' limit: the grouped GEMM
        x, w, idx = inputs(n)
        assert torch.equal(eb(x, w, idx), eb._grouped(x, w, idx))
    x, w, idx = inputs(2)
    with torch.enable_grad():
        assert torch.equal(eb(x, w, idx), eb._all_experts(x, w, idx))


def test_shared_experts_read_in_the_routed_experts_launches():
    """A decode step (one token) reads the shared experts in moe_decode's two launches; a verify of 8 runs them as
    cuBLAS's product, apart. Within bf16's roundings of each other (another summation order for the shared MLP),
    and the routed part the same bits either way."""
    from engine import moe_decode
    from engine.deepseek import Experts
    from engine.kernels import Kernels
    from engine.model import MLP

    g = torch.Generator(device="cuda").manual_seed(2)
    E, H, I, k = 64, 2048, 1408, 6
    eb = Experts(E, H, I).cuda().bfloat16()
    apart = Experts(E, H, I, Kernels(fuse_shared=False)).cuda().bfloat16()
    apart.load_state_dict(eb.state_dict())
    mlp = MLP(H, 2 * I).cuda().bfloat16()
    with torch.no_grad():
        for t, fan_in in ((eb.gate_up_proj, H), (eb.down_proj, I), (mlp.w13.weight, H), (mlp.down_proj.weight, 2 * I)):
            t.normal_(0, fan_in ** -0.5, generator=g)
        idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(8)])
        x = torch.randn(8, H, device="cuda", generator=g).bfloat16()
        w = torch.rand(8, k, device="cuda", generator=g)
        verify = eb(x, w, idx, mlp)
        assert torch.equal(verify, eb(x, w, idx) + mlp(x))  # 8 tokens: the shared MLP apart
        routed = eb(x, w, idx)
        for i in range(8):
            one = eb(x[i:i + 1], w[i:i + 1], idx[i:i + 1], mlp)
            assert torch.equal(one, moe_decode.routed_experts(x[i:i + 1], w[i:i + 1], idx[i:i + 1], eb.gate_up_proj,
                                                              eb.down_proj, shared=(mlp.w13.weight,
                                                                                    mlp.down_proj.weight)))
            scale = verify[i].float().abs().max().item()
            assert (one.float() - verify[i:i + 1].float()).abs().max().item() < 2e-2 * scale
            assert (one.float() - routed[i:i + 1].float()).abs().max().item() > 0.1 * scale  # the MLP is in it
        assert torch.equal(apart(x[:1], w[:1], idx[:1], mlp), routed[:1] + mlp(x[:1]))


def spy(fn, calls: list):
    """fn, recording the row count of each call's input."""
    return lambda x, *a, **kw: calls.append(x.numel() // x.shape[-1]) or fn(x, *a, **kw)


@torch.no_grad()
@pytest.mark.parametrize("n,k,bias", [(6144, 4096, False), (4096, 14336, False), (3072, 2048, True), (1344, 2048, False)])
def test_gemv_linear_on_cuda(n, k, bias):
    """engine.gemv.Linear at one bf16 row takes the kernel (within bf16's roundings of cuBLAS, the same bits in a
    CUDA graph and under torch.compile); at two rows (verify_linear cublas, the default), or with linear=cublas, it is
    cuBLAS's F.linear exactly."""
    from engine import gemv
    from engine.kernels import Kernels

    g = torch.Generator(device="cuda").manual_seed(3)
    lin = gemv.Linear(k, n, bias=bias).cuda().bfloat16()
    lin.weight.normal_(0, k ** -0.5, generator=g)
    x = torch.randn(1, 1, k, device="cuda", generator=g).bfloat16()
    assert gemv.available(x, lin.weight) and lin.one_row is gemv.gemv and lin.rows is gemv.cublas
    calls = []
    lin.one_row = spy(gemv.gemv, calls)
    one = lin(x)
    x2 = torch.randn(1, 2, k, device="cuda", generator=g).bfloat16()
    assert torch.equal(lin(x2), torch.nn.functional.linear(x2, lin.weight, lin.bias))
    assert calls == [1]  # the one-row forward took the kernel, the two-row one did not
    lin.one_row = gemv.gemv
    assert torch.equal(one, gemv.gemv(x, lin.weight, lin.bias))
    cublas = torch.nn.functional.linear(x, lin.weight, lin.bias)
    scale = cublas.float().abs().max().item()
    assert (one.float() - cublas.float()).abs().max().item() < 2e-2 * scale  # another order, the same product
    off = gemv.Linear(k, n, bias=bias, kernels=Kernels(linear="cublas")).cuda().bfloat16()
    off.load_state_dict(lin.state_dict())
    assert torch.equal(off(x), cublas)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = lin(x)
    x.normal_(generator=g)
    graph.replay()
    assert torch.equal(captured, gemv.gemv(x, lin.weight, lin.bias))
    assert torch.equal(torch.compile(lin, fullgraph=True)(x), captured)


@torch.no_grad()
@pytest.mark.parametrize("n,k,bias,m", [(6144, 4096, False, 8), (4096, 14336, False, 33), (3072, 2048, True, 2),
                                        (1344, 2048, False, 64), (4096, 4096, False, 16)])
def test_few_rows_linear_on_cuda(n, k, bias, m):
    """engine.gemv.Linear with verify_linear=few_rows at 2 to FEW_ROWS_MAX bf16 rows takes the few-row kernel:
    within bf16's roundings of cuBLAS, each token's bits independent of the other rows, the same bits in a CUDA graph
    and under torch.compile; past FEW_ROWS_MAX, or with the default verify_linear, it is cuBLAS's F.linear exactly."""
    from engine import gemv
    from engine.kernels import Kernels

    g = torch.Generator(device="cuda").manual_seed(5)
    lin = gemv.Linear(k, n, bias=bias, kernels=Kernels(verify_linear="few_rows")).cuda().bfloat16()
    lin.weight.normal_(0, k ** -0.5, generator=g)
    x = torch.randn(1, m, k, device="cuda", generator=g).bfloat16()
    calls = []
    lin.rows = spy(gemv.few_rows, calls)
    out = lin(x)
    assert calls == [m]
    lin.rows = gemv.few_rows
    assert torch.equal(out, gemv.gemm_few_rows(x, lin.weight, lin.bias))
    cublas = torch.nn.functional.linear(x, lin.weight, lin.bias)
    scale = cublas.float().abs().max().item()
    assert (out.float() - cublas.float()).abs().max().item() < 2e-2 * scale
    other = x.clone()
    other[0, 1:].normal_(generator=g)
    assert torch.equal(lin(other)[0, 0], out[0, 0])  # a token's bits are its own row's
    assert torch.equal(lin(x[:, -1:].contiguous().expand(1, m, k).contiguous())[0, 0], out[0, -1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = lin(x)
    x.normal_(generator=g)
    graph.replay()
    assert torch.equal(captured, gemv.gemm_few_rows(x, lin.weight, lin.bias))
    assert torch.equal(torch.compile(lin, fullgraph=True)(x), captured)
    many = torch.randn(1, gemv.FEW_ROWS_MAX + 1, k, device="cuda", generator=g).bfloat16()
    assert torch.equal(lin(many), torch.nn.functional.linear(many, lin.weight, lin.bias))
    plain = gemv.Linear(k, n, bias=bias).cuda().bfloat16()
    plain.load_state_dict(lin.state_dict())
    assert torch.equal(plain(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


@torch.no_grad()
def test_fused_layer_prologues_on_cuda():
    """A Llama layer at one bf16 row takes the add+norm and SwiGLU prologues (Kernels norm_prologue=fused_add_norm,
    swiglu_prologue=fused_swiglu, each on its own): the residual add keeps its bits, the layer's output is the
    unfused layer's within bf16's roundings, and a CUDA graph and torch.compile give the eager bits; at two rows, or
    with the plain prologues, the layer never takes them."""
    from engine import gemv
    from engine.kernels import Kernels
    from engine.model import Block, ProductBlock

    both = Kernels(norm_prologue="fused_add_norm", swiglu_prologue="fused_swiglu")
    model = random_model("small", device="cuda", dtype="bfloat16", seed=5, kernels=both)
    norm_only = random_model("small", device="cuda", dtype="bfloat16", seed=5,
                             kernels=Kernels(norm_prologue="fused_add_norm"))
    plain_model = random_model("small", device="cuda", dtype="bfloat16", seed=5)
    layer, norm_layer, plain_layer = model.layers[1], norm_only.layers[1], plain_model.layers[1]
    assert type(layer) is ProductBlock and type(plain_layer) is Block
    g = torch.Generator(device="cuda").manual_seed(6)
    h, r = (torch.randn(1, 1, model.cfg.hidden_size, device="cuda", generator=g).bfloat16() for _ in range(2))
    pos = torch.tensor([3], device="cuda")
    args = (model.rope_cos[pos], model.rope_sin[pos], None, None)
    calls = []
    for lay in (layer, norm_layer):
        for lin in (lay.self_attn.wqkv, lay.mlp.w13):
            lin.norm_prologue = (lambda f: lambda *a: calls.append("add_norm") or f(*a))(lin.norm_prologue)
        down = lay.mlp.down_proj
        down.swiglu_prologue = (lambda f: lambda *a: calls.append("swiglu") or f(*a))(down.swiglu_prologue)
    fused = layer(h, r, *args)
    assert calls == ["add_norm", "add_norm", "swiglu"]
    norm_layer(h, r, *args)
    assert calls[3:] == ["add_norm", "add_norm", "swiglu"]
    assert norm_layer.mlp.down_proj.swiglu_prologue is gemv.swiglu_then_product  # one choice, one prologue
    assert norm_layer.self_attn.wqkv.norm_prologue is not gemv.add_then_norm
    # at two rows the fused prologues fall back to the plain ops: the plain layer's bits
    two = (torch.cat([h, h], 1), torch.cat([r, r], 1), model.rope_cos[:2], model.rope_sin[:2], None, None)
    assert all(torch.equal(a, b) for a, b in zip(layer(*two), plain_layer(*two)))
    plain = plain_layer(h, r, *args)
    assert torch.equal(layer.self_attn.wqkv.add_norm(h, r, layer.input_layernorm)[0], h + r)

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:  # within bf16's roundings of the output's scale
        return (a.float() - b.float()).abs().max().item() < 3e-2 * b.float().abs().max().item()

    assert all(close(a, b) for a, b in zip(fused, plain))
    for lin in (layer.self_attn.wqkv, layer.mlp.w13):
        lin.norm_prologue = gemv.fused_add_norm
    layer.mlp.down_proj.swiglu_prologue = gemv.fused_swiglu
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer(h, r, *args)
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(captured, fused))
    compiled = torch.compile(layer, fullgraph=True)(h, r, *args)  # inductor rounds RoPE and the rest its own way
    assert all(close(a, b) for a, b in zip(compiled, fused))
