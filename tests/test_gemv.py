"""The product kernels of engine/gemv.py - the one-row kernel, its add+norm and SwiGLU prologues (Kernels
norm_prologue=fused_add_norm, swiglu_prologue=fused_swiglu) and the few-row kernel (verify_linear=few_rows) - against
F.linear without a GPU: Triton's interpreter (TRITON_INTERPRET=1) runs them on CPU tensors. The GPU (bf16 rounding,
which forwards take them, compile and graph capture) is covered by tests/test_gpu_engine.py.

The few-row kernel's half-precision case runs in float16 here: the interpreter multiplies bfloat16 operands of
tl.dot as their bit patterns (triton-lang/triton#11584), so its bf16 rounding is checked on the GPU only."""
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from engine import gemv

if sys.platform != "linux" or platform.machine() != "x86_64":  # the test extra installs triton only there
    pytest.skip("triton's interpreter is installed on Linux x86-64 only", allow_module_level=True)
import triton  # noqa: E402,F401 - required there: a missing one is a failure

# In a subprocess: the interpreter is chosen when the kernels are decorated, i.e. at import.
SCRIPT = """
import json
import torch
import torch.nn.functional as F
from engine.gemv import add_norm_gemv, gemv, swiglu_gemv

g = torch.Generator().manual_seed(0)
out = {}
# (outputs, inputs, bias, blocks): sizes that are and are not multiples of the blocks, K below one block and over
# several, with and without a bias
for N, K, bias, blocks in [(40, 96, False, (4, 32)), (37, 200, True, (8, 64)), (16, 64, False, (16, 128)),
                           (5, 1100, True, (4, 256))]:
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g) if bias else None
    x = torch.randn(1, 1, K, generator=g)
    name = f"{N},{K},{bias}"
    want = F.linear(x, w, b)
    got = gemv(x, w, b, *blocks)
    out["shape " + name] = list(got.shape) == list(want.shape)
    out["fp32 " + name] = (got - want).abs().max().item() / want.abs().max().item()
    # the same call twice: the same bits (the sum's order is fixed by the blocks)
    out["again " + name] = bool(torch.equal(got, gemv(x, w, b, *blocks)))
    # bf16: against float32 math on the same rounded inputs, within a few roundings of the output's scale
    xb, wb, bb = x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()
    truth = F.linear(xb.float(), wb.float(), None if bb is None else bb.float())
    out["bf16 " + name] = (gemv(xb, wb, bb, *blocks).float() - truth).abs().max().item() / truth.abs().max().item()
    # a weight with one row changed must not agree: the checks above can fail
    w2 = w.clone()
    w2[N - 1] = torch.randn(K, generator=g)
    out["changed " + name] = (gemv(x, w2, b, *blocks) - want).abs().max().item() / want.abs().max().item()

# the two prologues a decoder layer uses, against the unfused ops; more than one program (program 0 stores x)
for N, K, bias, (bn, bk) in [(40, 96, False, (4, 32)), (37, 200, True, (8, 64)), (5, 1100, True, (4, 256))]:
    name = f"{N},{K},{bias}"
    kw = dict(block_n=bn, block_k=bk)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g) if bias else None
    h, r = torch.randn(1, 1, K, generator=g), torch.randn(1, 1, K, generator=g)
    nw = 1 + 0.1 * torch.randn(K, generator=g)
    x, y = add_norm_gemv(h, r, nw, 1e-5, w, b, **kw)
    want = F.linear(F.rms_norm(h + r, (K,), eps=1e-5) * nw, w, b)
    out["norm x " + name] = bool(torch.equal(x, h + r))
    out["norm fp32 " + name] = (y - want).abs().max().item() / want.abs().max().item()
    hb, rb, nb, wb = h.bfloat16(), r.bfloat16(), nw.bfloat16(), w.bfloat16()
    bb = None if b is None else b.bfloat16()
    xb, yb = add_norm_gemv(hb, rb, nb, 1e-5, wb, bb, **kw)
    truth = F.linear(F.rms_norm((hb + rb).float(), (K,), eps=1e-5) * nb.float(), wb.float(),
                     None if bb is None else bb.float())
    # within one rounding: the interpreter casts float32 to bf16 by truncation, the GPU to nearest (the GPU test
    # checks the bits)
    out["norm xbits " + name] = ((xb.float() - (hb + rb).float()).abs() <= (hb + rb).float().abs() / 128).all().item()
    out["norm bf16 " + name] = (yb.float() - truth).abs().max().item() / truth.abs().max().item()
    nw2 = nw.clone()
    nw2[K // 2] += 20.0  # one norm weight changed: the prologue reads it
    out["norm changed " + name] = (add_norm_gemv(h, r, nw2, 1e-5, w, b, **kw)[1] - want).abs().max().item() \
        / want.abs().max().item()
    gu = torch.randn(1, 1, 2 * K, generator=g)
    want = F.linear(F.silu(gu[..., :K]) * gu[..., K:], w, b)
    out["swiglu fp32 " + name] = (swiglu_gemv(gu, w, b, **kw) - want).abs().max().item() / want.abs().max().item()
    gub = gu.bfloat16()
    truth = F.linear(F.silu(gub[..., :K].float()) * gub[..., K:].float(), wb.float(), None if bb is None else bb.float())
    out["swiglu bf16 " + name] = (swiglu_gemv(gub, wb, bb, **kw).float() - truth).abs().max().item() \
        / truth.abs().max().item()
    gu2 = gu.clone()
    gu2[..., K // 3], gu2[..., K + K // 3] = 5.0, 20.0  # one gate and its up input changed: both halves are read
    out["swiglu changed " + name] = (swiglu_gemv(gu2, w, b, **kw) - want).abs().max().item() / want.abs().max().item()
print(json.dumps(out))
"""


ROWS_SCRIPT = """
import json
import torch
import torch.nn.functional as F
from engine.gemv import gemm_few_rows as rows

g = torch.Generator().manual_seed(1)
out = {}
# (tokens, outputs, inputs, bias, blocks): 2 tokens in a block of 16, a chain's 8, a block's 16, 33 of 64 and all 64;
# outputs and inputs that are and are not multiples of the blocks; the engine's blocks (None) and others
for M, N, K, bias, blocks in [(2, 40, 96, False, (16, 16, 32, 4, 2)), (8, 37, 300, True, None),
                              (16, 64, 512, False, (16, 32, 128, 4, 3)), (33, 50, 200, True, None),
                              (64, 16, 64, False, None)]:
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g) if bias else None
    x = torch.randn(1, M, K, generator=g)
    name = f"{M},{N},{K},{bias}"
    want = F.linear(x, w, b)
    got = rows(x, w, b, blocks)
    out["shape " + name] = list(got.shape) == list(want.shape)
    out["fp32 " + name] = (got - want).abs().max().item() / want.abs().max().item()
    out["again " + name] = bool(torch.equal(got, rows(x, w, b, blocks)))
    xh, wh, bh = x.half(), w.half(), None if b is None else b.half()
    truth = F.linear(xh.float(), wh.float(), None if bh is None else bh.float())
    half = rows(xh, wh, bh, blocks)
    out["fp16 " + name] = (half.float() - truth).abs().max().item() / truth.abs().max().item()
    # a token's outputs depend on its own row only: the other rows changed, or the token alone, give its bits
    x2 = xh.clone()
    x2[0, 1:] = torch.randn(M - 1, K, generator=g).half()
    out["others " + name] = bool(torch.equal(rows(x2, wh, bh, blocks)[0, 0], half[0, 0]))
    out["alone " + name] = bool(torch.equal(rows(xh[:, M - 1:], wh, bh, blocks)[0, 0], half[0, M - 1]))
    w2 = w.clone()
    w2[N - 1] = torch.randn(K, generator=g)
    out["changed " + name] = (rows(x, w2, b, blocks) - want).abs().max().item() / want.abs().max().item()
print(json.dumps(out))
"""


def interpret(script: str) -> dict:
    r = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def results() -> dict:
    return interpret(SCRIPT)


@pytest.fixture(scope="module")
def rows_results() -> dict:
    return interpret(ROWS_SCRIPT)


def of(results: dict, kind: str, cases: int = 4) -> dict:
    picked = {k: v for k, v in results.items() if k.startswith(kind + " ")}
    assert len(picked) == cases, picked
    return picked


def test_gemv_matches_f_linear_in_float32(results):
    assert all(of(results, "shape").values())
    assert max(of(results, "fp32").values()) < 1e-5


def test_gemv_in_bf16_stays_within_a_few_roundings(results):
    assert max(of(results, "bf16").values()) < 0.02  # bf16 keeps 8 bits: 2^-8 is 0.4% of the scale


def test_gemv_gives_the_same_bits_twice(results):
    assert all(of(results, "again").values())


def test_a_changed_weight_row_is_caught(results):
    assert min(of(results, "changed").values()) > 0.05


def prologue(results: dict, kind: str) -> dict:
    picked = {k: v for k, v in results.items() if k.startswith(kind + " ")}
    assert len(picked) == 3, picked
    return picked


def test_add_norm_prologue_matches_the_unfused_ops(results):
    """x is h + residual (to the bit in float32; in bf16 within the interpreter's rounding); the product is
    rms_norm(x) * g @ W.T."""
    assert all(prologue(results, "norm x").values()) and all(prologue(results, "norm xbits").values())
    assert max(prologue(results, "norm fp32").values()) < 1e-5
    assert max(prologue(results, "norm bf16").values()) < 0.02
    assert min(prologue(results, "norm changed").values()) > 0.05


def test_swiglu_prologue_matches_the_unfused_ops(results):
    assert max(prologue(results, "swiglu fp32").values()) < 1e-5
    assert max(prologue(results, "swiglu bf16").values()) < 0.02
    assert min(prologue(results, "swiglu changed").values()) > 0.05


def test_few_rows_matches_f_linear_in_float32(rows_results):
    assert all(of(rows_results, "shape", 5).values())
    assert max(of(rows_results, "fp32", 5).values()) < 1e-5


def test_few_rows_in_half_precision_stays_within_a_few_roundings(rows_results):
    assert max(of(rows_results, "fp16", 5).values()) < 0.005  # fp16 keeps 11 bits: 2^-11 is 0.05% of the scale


def test_few_rows_gives_each_token_the_bits_of_its_own_row(rows_results):
    """What deterministic mode needs of a forward of W rows: the same bits twice, whatever the other rows hold."""
    assert all(of(rows_results, "again", 5).values())
    assert all(of(rows_results, "others", 5).values())
    assert all(of(rows_results, "alone", 5).values())


def test_few_rows_catches_a_changed_weight_row(rows_results):
    assert min(of(rows_results, "changed", 5).values()) > 0.05


@pytest.mark.parametrize("m", [0, gemv.FEW_ROWS_MAX + 1])
def test_few_rows_refuses_no_rows_and_more_than_max_rows(m):
    with pytest.raises(ValueError, match=f"1 to {gemv.FEW_ROWS_MAX} rows"):
        gemv.gemm_few_rows(torch.zeros(m, 8), torch.zeros(4, 8))


def test_few_rows_refuses_a_block_smaller_than_the_rows():
    with pytest.raises(ValueError, match="block_m 16 holds fewer than the 17 rows"):
        gemv.gemm_few_rows(torch.zeros(17, 8), torch.zeros(4, 8), blocks=(16, 16, 32, 4, 2))


def test_gemv_refuses_more_than_one_row():
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv(torch.zeros(2, 8), torch.zeros(4, 8))


def test_linear_keeps_cublas_off_the_gpu_and_for_autograd():
    """On CPU (and wherever `available` says no) Linear is nn.Linear: same parameters, same outputs, gradients."""
    torch.manual_seed(0)
    lin = gemv.Linear(8, 4)
    ref = torch.nn.Linear(8, 4)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(1, 8, requires_grad=True)
    assert not gemv.available(x, lin.weight) and not gemv.available(torch.randn(3, 8), lin.weight)
    assert torch.equal(lin(x), ref(x))
    lin(x).sum().backward()
    assert lin.weight.grad is not None and x.grad is not None
    assert set(lin.state_dict()) == {"weight", "bias"}


def test_linear_resolves_its_kernel_choices_by_name_when_built():
    """A Linear stores the implementations its Kernels value names (engine/kernels.py): the defaults are the
    one-row kernel and cuBLAS, and the choices that land off are reached only through their names."""
    from engine.kernels import Kernels

    plain = gemv.Linear(8, 4)
    assert (plain.one_row, plain.rows) == (gemv.gemv, gemv.cublas)
    assert (plain.norm_prologue, plain.swiglu_prologue) == (gemv.add_then_norm, gemv.swiglu_then_product)
    assert plain.blocks == gemv.blocks(8)
    chosen = gemv.Linear(8, 4, kernels=Kernels(verify_linear="few_rows", gemv_block_n=8,
                                               norm_prologue="fused_add_norm"))
    assert (chosen.one_row, chosen.rows, chosen.norm_prologue) == (gemv.gemv, gemv.few_rows, gemv.fused_add_norm)
    assert chosen.blocks[0] == 8 and gemv.Linear(8, 4, kernels=Kernels(linear="cublas")).one_row is gemv.cublas
