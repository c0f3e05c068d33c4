"""One-row products (a decode step's projections) in Triton, streaming nearer the copy bandwidth than cuBLAS.

At one row cuBLAS runs a GEMV kernel per projection. The large ones (the 8B shape's gate/up, every lm_head) stream
at about the copy bandwidth; the small ones (q/k/v, the output projection, the down projection) stream well below it,
and those it splits along K end in a second kernel that sums the splits (`splitKreduce`, two a layer at the 8B
shape): baseline-decode's profile (docs/findings.md, section 6). Here one kernel does the whole product: each
program reads BLOCK_N whole weight rows against the row of x and writes BLOCK_N outputs, so nothing is split along
K and no second kernel sums anything. K is a compile-time constant: the loop over it unrolls and a program's loads
are all in flight at once, as in engine/moe_decode.py.

Sums: each program accumulates x * w elementwise in float32 across the K chunks in order, then sums the chunk-wide
accumulator; the bias (if any) is added in float32 before the one rounding, as cuBLAS's epilogue adds it. The order
is fixed by the block sizes, never by the GPU's timing: the same inputs give the same bits every call.

A few rows (a verify's 2 to MAX_ROWS tokens) take a second kernel, `rows`, for the same reason: each program reads
BLOCK_N weight rows once for all of the tokens, as tensor-core products (`tl.dot`) of the weight block against the
tokens' block padded to 16 rows, and accumulates along K in float32 in a fixed order. A token's output depends only
on its own row (the padding rows and the other tokens never enter its sums), so a forward of W rows gives each row
the same bits whatever the others hold, which deterministic mode (engine/deterministic.py) relies on.

`Linear` is the model's projection: an nn.Linear (same parameters, same state dict) whose forward takes these kernels
for up to MAX_ROWS rows of half-precision CUDA input without autograd, cuBLAS otherwise.
Every other forward (prefill, training, CPU) is nn.Linear's. On CPU tensors the kernels run in Triton's
interpreter (TRITON_INTERPRET=1), which is how tests/test_gemv.py checks them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch wheels come without Triton
    triton = None

MAX_WEIGHT = 2 ** 31 - 1  # weight elements beyond which offsets would overflow int32: cuBLAS then
BLOCK_N = 4  # output rows per program
# (block_n, block_k, num_warps) by the reduction's width K, from scripts/bench-gemv.py on a lent H200
# (docs/findings.md, section 24): wide loads and eight warps in general; past WIDE_K a program's unrolled loads no
# longer fit its registers at that width (a down projection of 14336 inputs ran slower than cuBLAS's), and at
# K <= 1024 a 2048-wide load is mostly masked.
NARROW_K, WIDE_K = 1024, 12288
NARROW_BLOCKS = (BLOCK_N, 1024, 4)
WIDE_BLOCKS = (BLOCK_N, 2048, 8)


def blocks(k: int) -> tuple[int, int, int]:
    """(block_n, block_k, num_warps) for a reduction of k inputs."""
    return WIDE_BLOCKS if NARROW_K < k <= WIDE_K else NARROW_BLOCKS


MAX_ROWS = 64  # the largest verify (a tree's draft-token budget); prefill chunks stay on cuBLAS


SMS = 132  # an H100's or H200's SMs: the programs a product should give at least one each


def row_blocks(m: int, k: int, n: int) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, num_warps, num_stages) for `rows` at m tokens, k inputs and n outputs: the
    tokens padded to a power of two of at least 16 (tl.dot's smallest side) and a pipelined K loop. Every program
    re-reads the tokens' rows (from L2) beside its weight block, m/block_n of the weight's bytes, so the weight
    block widens with m, but only as far as the product still gives every SM a program (a narrow one, such as the
    output projection, would otherwise stream from a third of the GPU). Unmeasured defaults:
    scripts/bench-gemv.py --rows sweeps them on a GPU."""
    block_m = max(16, 1 << (m - 1).bit_length())
    block_n = 32 if block_m <= 16 else 64
    while block_n > 16 and n < block_n * SMS:
        block_n //= 2
    return (block_m, block_n, 256, 4, 4) if block_m <= 16 else (block_m, block_n, 128, 4, 3)


enabled = True  # benchmarks switch it off to time cuBLAS at every one-row product
few_rows = True  # and this one to time cuBLAS at every product of 2 to MAX_ROWS rows


def n_rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row (or, with `few_rows`, up to MAX_ROWS) of half-precision CUDA input, no autograd, a weight
    contiguous along K."""
    m = n_rows(x)
    return (enabled and triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and (m == 1 or (few_rows and 1 < m <= MAX_ROWS))
            and weight.numel() <= MAX_WEIGHT and weight.stride(-1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


if triton is not None:

    @triton.jit
    def _gemv_rows(X, W, Bias, Y, N, sw_n, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            in_cols = cols < K
            x = tl.load(X + cols, mask=in_cols, other=0.0).to(tl.float32)
            w = tl.load(W + rows[:, None] * sw_n + cols[None, :], mask=in_rows[:, None] & in_cols[None, :],
                        other=0.0, eviction_policy="evict_first")  # read once: keep x in cache, not w
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(Bias + rows, mask=in_rows, other=0.0).to(tl.float32)
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=in_rows)

    @triton.jit
    def _gemm_rows(X, W, Bias, Y, M, N, sx_m, sw_n, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
        # the weight block is the product's left side (BLOCK_N rows, at least 16) and the tokens its right side, so
        # a few tokens fill tl.dot's narrow side: acc[n, m] = sum_k W[n, k] X[m, k]
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        toks = tl.arange(0, BLOCK_M)
        in_rows, in_toks = rows < N, toks < M
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):  # software-pipelined: num_stages copies in flight
            cols = k0 + tl.arange(0, BLOCK_K)
            in_cols = cols < K
            w = tl.load(W + rows[:, None] * sw_n + cols[None, :], mask=in_rows[:, None] & in_cols[None, :],
                        other=0.0, eviction_policy="evict_first")
            xt = tl.load(X + toks[None, :] * sx_m + cols[:, None], mask=in_toks[None, :] & in_cols[:, None],
                         other=0.0)
            acc = tl.dot(w, xt, acc)
        if HAS_BIAS:
            acc += tl.load(Bias + rows, mask=in_rows, other=0.0).to(tl.float32)[:, None]
        tl.store(Y + toks[None, :] * N + rows[:, None], acc.to(Y.dtype.element_ty),
                 mask=in_rows[:, None] & in_toks[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
         block_k: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """x [..., K] holding one row; weight [N, K] contiguous along K; bias [N] or None -> [..., N] in x's dtype:
    F.linear(x, weight, bias). The block sizes (powers of two) default to `blocks(K)`; the benchmark sweeps them."""
    N, K = weight.shape
    dn, dk, dw = blocks(K)
    block_n, block_k, num_warps = block_n or dn, block_k or dk, num_warps or dw
    if x.numel() != K or weight.stride(-1) != 1:
        raise ValueError(f"gemv: one row of {K} inputs and a weight contiguous along K, got x {tuple(x.shape)}")
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    _gemv_rows[(triton.cdiv(N, block_n),)](
        x.contiguous(), weight, bias if bias is not None else weight, y, N, weight.stride(0), K=K, BLOCK_N=block_n,
        BLOCK_K=block_k, HAS_BIAS=bias is not None, num_warps=num_warps)
    return y


def rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         blocks: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] holding 2 to MAX_ROWS rows; weight [N, K] contiguous along K; bias [N] or None -> [..., N] in x's
    dtype: F.linear(x, weight, bias). `blocks` (block_m, block_n, block_k, num_warps, num_stages) defaults to
    `row_blocks(M, K, N)`; the benchmark sweeps it."""
    N, K = weight.shape
    m = n_rows(x)
    if x.shape[-1] != K or not 0 < m <= MAX_ROWS or weight.stride(-1) != 1:
        raise ValueError(f"rows: 1 to {MAX_ROWS} rows of {K} inputs and a weight contiguous along K, "
                         f"got x {tuple(x.shape)}")
    block_m, block_n, block_k, num_warps, num_stages = blocks or row_blocks(m, K, N)
    if block_m < m:
        raise ValueError(f"rows: block_m {block_m} holds fewer than the {m} rows")
    x2 = x.reshape(m, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    _gemm_rows[(triton.cdiv(N, block_n),)](
        x2, weight, bias if bias is not None else weight, y, m, N, x2.stride(0), weight.stride(0), K=K,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, num_warps=num_warps,
        num_stages=num_stages)
    return y


class Linear(nn.Linear):
    """nn.Linear whose one-row half-precision CUDA forwards take `gemv`, and those of 2 to MAX_ROWS rows `rows`
    (see the module's docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if available(x, self.weight):
            if n_rows(x) == 1:
                return gemv(x, self.weight, self.bias)
            return rows(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
