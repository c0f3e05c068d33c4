"""The staged MoE decode kernels (engine/moe_decode.py) against deepseek.Experts without a GPU: Triton's interpreter
(TRITON_INTERPRET=1) runs them on CPU tensors. The GPU (bf16 rounding, graph capture, compile) is covered by
tests/test_gpu_engine.py::test_moe_decode_kernels_on_cuda."""
import os
import platform
import subprocess
import sys

import pytest

if sys.platform != "linux" or platform.machine() != "x86_64":  # the test extra installs triton only there
    pytest.skip("triton's interpreter is installed on Linux x86-64 only", allow_module_level=True)
import triton  # noqa: E402,F401 - required there: a missing one is a failure

# In a subprocess: the interpreter is chosen when the kernels are decorated, i.e. at import.
SCRIPT = """
import json
import torch
from engine.deepseek import Experts
from engine.model import MLP
from engine.moe_decode import routed_experts

g = torch.Generator().manual_seed(0)
out = {}
# (experts, hidden, intermediate, top-k, tokens, blocks): sizes that are and are not multiples of the blocks, one
# token (decode) and several (verify), an expert chosen by two tokens
for E, H, I, k, N, blocks in [(8, 96, 40, 3, 1, (16, 16, 32)), (8, 96, 40, 3, 5, (16, 16, 32)),
                               (6, 64, 48, 2, 8, (32, 16, 64)), (5, 40, 24, 4, 2, (16, 32, 16))]:
    ex = Experts(E, H, I)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5)
        ex.down_proj.copy_(torch.randn(E, H, I, generator=g) / I ** 0.5)
        x = torch.randn(N, H, generator=g)
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
        w = torch.rand(N, k, generator=g)
        got = got_fp32 = routed_experts(x, w, idx, ex.gate_up_proj, ex.down_proj, *blocks)
        dense = ex._all_experts(x, w, idx)
        out[f"fp32 {E},{H},{I},{k},{N}"] = (got - dense).abs().max().item() / dense.abs().max().item()
        # bf16: the interpreter does not round to nearest even as a GPU does; the error against float32 math on
        # the same rounded weights is bounded in units of the output's scale, and a wrong expert or slot is not
        xb, eb = x.bfloat16(), Experts(E, H, I).bfloat16()
        eb.load_state_dict({n: t.bfloat16() for n, t in ex.state_dict().items()})
        truth = Experts(E, H, I)
        truth.load_state_dict({n: t.float() for n, t in eb.state_dict().items()})
        want = truth._all_experts(xb.float(), w, idx)
        got = routed_experts(xb, w, idx, eb.gate_up_proj, eb.down_proj, *blocks).float()
        out[f"bf16 {E},{H},{I},{k},{N}"] = (got - want).abs().max().item() / want.abs().max().item()
        # with the shared experts (one MLP) read in the same launches: what MoE.forward adds apart, rounded alike
        mlp = MLP(H, 2 * I)
        mlp.w13.weight.copy_(torch.randn(4 * I, H, generator=g) / H ** 0.5)
        mlp.down_proj.weight.copy_(torch.randn(H, 2 * I, generator=g) / (2 * I) ** 0.5)
        both = routed_experts(x, w, idx, ex.gate_up_proj, ex.down_proj, *blocks,
                              shared=(mlp.w13.weight, mlp.down_proj.weight))
        apart = routed_experts(x, w, idx, ex.gate_up_proj, ex.down_proj, *blocks) + mlp(x)
        out[f"shared {E},{H},{I},{k},{N}"] = (both - apart).abs().max().item() / apart.abs().max().item()
        # and without the MLP's output, the check above fails
        out[f"noshared {E},{H},{I},{k},{N}"] = (both - got_fp32).abs().max().item() / apart.abs().max().item()
        # the same call with one slot's expert swapped must not agree: the check above can fail
        wrong, w1 = idx.clone(), w.clone()
        wrong[0, 0] = next(e for e in range(E) if e not in idx[0].tolist())
        w1[0, 0] = 1.0  # a slot that weighs
        bad = routed_experts(x, w1, wrong, ex.gate_up_proj, ex.down_proj, *blocks)
        right = ex._all_experts(x, w1, idx)
        out[f"swapped {E},{H},{I},{k},{N}"] = (bad - right).abs().max().item() / right.abs().max().item()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    r = subprocess.run([sys.executable, "-c", SCRIPT], env={**os.environ, "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    return json.loads(r.stdout.splitlines()[-1])


def test_moe_decode_matches_every_expert_dense_in_float32(errors):
    fp32 = {k: v for k, v in errors.items() if k.startswith("fp32")}
    assert len(fp32) == 4 and max(fp32.values()) < 1e-5, fp32


def test_moe_decode_in_bf16_stays_within_a_few_roundings(errors):
    bf16 = {k: v for k, v in errors.items() if k.startswith("bf16")}
    assert len(bf16) == 4 and max(bf16.values()) < 0.05, bf16  # bf16 keeps 8 bits: 2^-8 is 0.4% of the scale


def test_a_wrong_expert_is_caught(errors):
    swapped = {k: v for k, v in errors.items() if k.startswith("swapped")}
    assert len(swapped) == 4 and min(swapped.values()) > 0.05, swapped


def test_the_shared_experts_read_in_the_same_launches_add_their_mlp(errors):
    shared = {k: v for k, v in errors.items() if k.startswith("shared")}
    missing = {k: v for k, v in errors.items() if k.startswith("noshared")}
    assert len(shared) == 4 and max(shared.values()) < 1e-5, shared
    assert len(missing) == 4 and min(missing.values()) > 0.05, missing
