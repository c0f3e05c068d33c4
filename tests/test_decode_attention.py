"""The split-KV decode-attention kernel (engine/decode_attention.py) against SDPA without a GPU: Triton's
interpreter (TRITON_INTERPRET=1) runs the same kernels on CPU tensors. The GPU itself is covered by
tests/test_gpu_engine.py::test_split_kv_attention_matches_sdpa."""
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
import torch
from engine.decode_attention import grouped_merge, split_kv_attention
from engine.model import sdpa

g = torch.Generator().manual_seed(0)
worst = merged_apart = grouped = 0.0
counts = torch.zeros(8, dtype=torch.int32)
left = []
# (batch, query heads, KV heads, tokens, cache length, head dim, valid cache length): several splits, padded rows
# (fewer than 16 per KV head), a cache longer than what is valid, GQA and plain multi-head
for B, H, kv, T, S, D, valid in [(1, 8, 2, 1, 200, 64, 150), (1, 4, 4, 8, 130, 64, 100), (2, 8, 2, 4, 64, 128, 64),
                                 (1, 16, 2, 4, 300, 64, 290)]:  # at most 8 batch rows x KV heads, as counts
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, kv, S, D, generator=g), torch.randn(B, kv, S, D, generator=g)
    causal = torch.arange(S)[None, :] <= torch.arange(valid - T, valid)[:, None]
    tree = causal & (torch.rand(T, S, generator=g) < 0.6)
    tree[:, 0] = True
    for mask in (causal, tree):
        want = sdpa(q, k, v, mask)
        qg = q.reshape(B, kv, H // kv * T, D)
        got = split_kv_attention(qg, k, v, mask, T, counts).reshape(B, H, T, D)  # merged by the last block
        apart = split_kv_attention(qg, k, v, mask, T).reshape(B, H, T, D)  # merged by a kernel of its own
        # the grouped merge (Kernels merge=grouped_merge), in the kernel and apart: the same sums in the same order
        for c in (counts, None):
            again = split_kv_attention(qg, k, v, mask, T, c, grouped_merge).reshape(B, H, T, D)
            grouped = max(grouped, (again - got).abs().max().item())
        worst = max(worst, (got - want).abs().max().item())
        merged_apart = max(merged_apart, (got - apart).abs().max().item())
        left.append(int(counts.abs().sum()))
print(worst, merged_apart, grouped, sum(left), len(left))
"""


def test_split_kv_kernel_matches_sdpa_in_the_interpreter():
    r = subprocess.run([sys.executable, "-c", SCRIPT], env={**os.environ, "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    worst, merged_apart, grouped, counts_left, calls = r.stdout.split()[-5:]
    assert float(worst) < 1e-5
    assert float(merged_apart) == 0.0  # both merges sum the splits in split order
    assert float(grouped) == 0.0  # so does the grouped merge, for a decode step's rows and a verify's wider ones
    assert int(calls) == 8 and int(counts_left) == 0  # the last block leaves the counts as it found them
