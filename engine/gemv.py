"""One-row products (a decode step's projections) in Triton, streaming nearer the copy bandwidth than cuBLAS, and
the other products a model's `Linear` may run, each chosen by name (engine.kernels: `linear`, `verify_linear`,
`norm_prologue`, `swiglu_prologue`).

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

Choices that land off by default (each its own top-level definitions, reached only through its name):
- `few_rows` (verify_linear): a few rows (a verify's 2 to FEW_ROWS_MAX tokens) in one kernel that reads BLOCK_N
  weight rows once for all of the tokens, as tensor-core products (`tl.dot`) of the weight block against the tokens'
  block padded to 16 rows, accumulating along K in float32 in a fixed order. A token's output depends only on its
  own row (the padding rows and the other tokens never enter its sums), so a forward of W rows gives each row the
  same bits whatever the others hold, which deterministic mode (engine/deterministic.py) relies on.
- `fused_add_norm` (norm_prologue), `fused_swiglu` (swiglu_prologue): the one-row kernel with a prologue - a
  layer's residual add and RMSNorm before its q/k/v and gate/up products, SwiGLU before its down projection - so
  the norm or the activation is no kernel of its own at a decode step (engine.model.ProductBlock calls them).

`Linear` is the model's projection: an nn.Linear (same parameters, same state dict) whose forward takes its chosen
one-row product for one row of half-precision CUDA input without autograd, its chosen few-row product for more rows
of such input, and F.linear otherwise (training, CPU). On CPU tensors the kernels run in Triton's interpreter
(TRITON_INTERPRET=1), which is how tests/test_gemv.py checks them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import Kernels, implements

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


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Half-precision CUDA input, no autograd, a weight contiguous along K: what a Triton product takes."""
    return (triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.numel() <= MAX_WEIGHT and weight.stride(-1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def n_rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


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


@implements("linear")
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


@implements("linear", "verify_linear")
def cublas(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *_blocks: int) -> torch.Tensor:
    """F.linear (cuBLAS on a GPU), whatever the rows."""
    return F.linear(x, weight, bias)


# ---- few_rows (verify_linear): 2 to FEW_ROWS_MAX rows in one tensor-core kernel ----------------------------------
FEW_ROWS_MAX = 64  # the largest verify (a tree's draft-token budget); prefill chunks stay on cuBLAS
FEW_ROWS_SMS = 132  # an H100's or H200's SMs: the programs a product should give at least one each


def few_row_blocks(m: int, k: int, n: int) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, num_warps, num_stages) for `gemm_few_rows` at m tokens, k inputs and n outputs:
    the tokens padded to a power of two of at least 16 (tl.dot's smallest side) and a pipelined K loop. Every
    program re-reads the tokens' rows (from L2) beside its weight block, m/block_n of the weight's bytes, so the
    weight block widens with m, but only as far as the product still gives every SM a program (a narrow one, such
    as the output projection, would otherwise stream from a third of the GPU). Unmeasured defaults:
    scripts/bench-gemv.py --rows sweeps them on a GPU."""
    block_m = max(16, 1 << (m - 1).bit_length())
    block_n = 32 if block_m <= 16 else 64
    while block_n > 16 and n < block_n * FEW_ROWS_SMS:
        block_n //= 2
    return (block_m, block_n, 256, 4, 4) if block_m <= 16 else (block_m, block_n, 128, 4, 3)


if triton is not None:

    @triton.jit
    def _gemm_rows(X, W, Bias, Y, M, N, sx_m, sw_n, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
        # the weight block is the product's left side (BLOCK_N rows, at least 16) and the tokens its right side, so
        # a few tokens fill tl.dot's narrow side: acc[n, m] = sum_k W[n, k] X[m, k]
        outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        toks = tl.arange(0, BLOCK_M)
        in_outs, in_toks = outs < N, toks < M
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):  # software-pipelined: num_stages copies in flight
            cols = k0 + tl.arange(0, BLOCK_K)
            in_cols = cols < K
            w = tl.load(W + outs[:, None] * sw_n + cols[None, :], mask=in_outs[:, None] & in_cols[None, :],
                        other=0.0, eviction_policy="evict_first")
            xt = tl.load(X + toks[None, :] * sx_m + cols[:, None], mask=in_toks[None, :] & in_cols[:, None],
                         other=0.0)
            acc = tl.dot(w, xt, acc)
        if HAS_BIAS:
            acc += tl.load(Bias + outs, mask=in_outs, other=0.0).to(tl.float32)[:, None]
        tl.store(Y + toks[None, :] * N + outs[:, None], acc.to(Y.dtype.element_ty),
                 mask=in_outs[:, None] & in_toks[None, :])


def gemm_few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  blocks: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] holding 1 to FEW_ROWS_MAX rows; weight [N, K] contiguous along K; bias [N] or None -> [..., N] in
    x's dtype: F.linear(x, weight, bias). `blocks` (block_m, block_n, block_k, num_warps, num_stages) defaults to
    `few_row_blocks(M, K, N)`; the benchmark sweeps it."""
    N, K = weight.shape
    m = n_rows(x)
    if x.shape[-1] != K or not 0 < m <= FEW_ROWS_MAX or weight.stride(-1) != 1:
        raise ValueError(f"gemm_few_rows: 1 to {FEW_ROWS_MAX} rows of {K} inputs and a weight contiguous along K, "
                         f"got x {tuple(x.shape)}")
    block_m, block_n, block_k, num_warps, num_stages = blocks or few_row_blocks(m, K, N)
    if block_m < m:
        raise ValueError(f"gemm_few_rows: block_m {block_m} holds fewer than the {m} rows")
    x2 = x.reshape(m, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    _gemm_rows[(triton.cdiv(N, block_n),)](
        x2, weight, bias if bias is not None else weight, y, m, N, x2.stride(0), weight.stride(0), K=K,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, num_warps=num_warps,
        num_stages=num_stages)
    return y


@implements("verify_linear")
def few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`gemm_few_rows` up to FEW_ROWS_MAX rows, F.linear beyond (a prefill chunk)."""
    if n_rows(x) <= FEW_ROWS_MAX:
        return gemm_few_rows(x, weight, bias)
    return F.linear(x, weight, bias)


# ---- the plain prologues (norm_prologue, swiglu_prologue defaults): the ops as they are, then the product -------
@implements("norm_prologue")
def add_then_norm(linear: Linear, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, linear(norm(x))) with x = h + residual."""
    x = h + residual
    return x, linear(norm(x))


@implements("swiglu_prologue")
def swiglu_then_product(linear: Linear, gate_up: torch.Tensor) -> torch.Tensor:
    """linear(silu(gate) * up) for gate_up = cat(gate, up) along the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return linear(F.silu(gate) * up)


# ---- fused_add_norm, fused_swiglu: the one-row kernel with a prologue --------------------------------------------
PROLOGUE_ADD_NORM, PROLOGUE_SWIGLU = 1, 2  # what a prologue kernel computes its row of inputs from


def prologue_blocks(k: int, prologue: int, wide: bool) -> tuple[int, int, int]:
    """(block_n, block_k, num_warps) of a product with a prologue, k its inputs: `wide`, more rows a program than
    `blocks` gives, so that fewer programs recompute the prologue over the whole row (each reads the row, and for
    the norm the residual and the norm's weight, from L2). The widest that compile for sm_90 without spilling
    (scripts/kernel-report.py's way, 2026-12-04): the norm 16 rows up to 2048 inputs and 8 above, SwiGLU 8 rows."""
    if not wide:
        return blocks(k)
    if prologue == PROLOGUE_ADD_NORM:
        return (16, 2048, 8) if k <= 2048 else (8, 2048, 8)
    return (8, 2048, 8) if k <= 8192 else (8, 1024, 8)


if triton is not None:
    _PROLOGUE_ADD_NORM, _PROLOGUE_SWIGLU = tl.constexpr(PROLOGUE_ADD_NORM), tl.constexpr(PROLOGUE_SWIGLU)

    @triton.jit
    def _gemv_prologue_rows(X, X2, G, W, Bias, Xout, Y, N, sw_n, eps, K: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PROLOGUE: tl.constexpr):
        """Y[rows] = W[rows] @ x for BLOCK_N rows a program, x by PROLOGUE: ADD_NORM x = rmsnorm(X + X2) with weight
        G (the sum, rounded to X's dtype as a residual add rounds it, stored to Xout by program 0); SWIGLU
        x = silu(X[:K]) * X[K:2K]. Every program computes its x itself: x is a few KiB, read from L2."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            in_cols = cols < K
            x = tl.load(X + cols, mask=in_cols, other=0.0).to(tl.float32)
            if PROLOGUE == _PROLOGUE_ADD_NORM:
                x = (x + tl.load(X2 + cols, mask=in_cols, other=0.0).to(tl.float32)).to(Xout.dtype.element_ty)
                tl.store(Xout + cols, x, mask=in_cols & (pid == 0))
                x = x.to(tl.float32)
                squares += x * x
                x = x * tl.load(G + cols, mask=in_cols, other=0.0).to(tl.float32)
            if PROLOGUE == _PROLOGUE_SWIGLU:
                x = x * tl.sigmoid(x) * tl.load(X + K + cols, mask=in_cols, other=0.0).to(tl.float32)
            w = tl.load(W + rows[:, None] * sw_n + cols[None, :], mask=in_rows[:, None] & in_cols[None, :],
                        other=0.0, eviction_policy="evict_first")  # read once: keep x in cache, not w
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if PROLOGUE == _PROLOGUE_ADD_NORM:  # the norm's scale is one number for the row: it factors out of the sum
            y = y * tl.rsqrt(tl.sum(squares) / K + eps)
        if HAS_BIAS:
            y += tl.load(Bias + rows, mask=in_rows, other=0.0).to(tl.float32)
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=in_rows)


def _prologue_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: int,
                     x2: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                     xout: torch.Tensor | None = None, block_n: int | None = None, block_k: int | None = None,
                     num_warps: int | None = None) -> torch.Tensor:
    N, K = weight.shape
    dn, dk, dw = blocks(K)
    block_n, block_k, num_warps = block_n or dn, block_k or dk, num_warps or dw
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    _gemv_prologue_rows[(triton.cdiv(N, block_n),)](
        x.contiguous(), weight if x2 is None else x2.contiguous(), weight if norm_weight is None else norm_weight,
        weight, bias if bias is not None else weight, weight if xout is None else xout, y, N, weight.stride(0), eps,
        K=K, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, PROLOGUE=prologue, num_warps=num_warps)
    return y


def _check_prologue_row(x: torch.Tensor, weight: torch.Tensor, width: int) -> None:
    if x.numel() != width or x.shape[-1] != width or weight.stride(-1) != 1:
        raise ValueError(f"gemv: one row of {width} inputs and a weight contiguous along K, got x {tuple(x.shape)}")


def add_norm_gemv(h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None, wide: bool = True, **block_sizes: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, F.linear(rms_norm(x) * norm_weight, weight, bias)) with x = h + residual, one row: a layer's residual
    add, its norm and the product after them in one kernel. x has the bits of `h + residual`; the product is the
    unfused one's within roundings (the normalized row is never rounded to x's dtype here). `block_sizes`:
    block_n, block_k, num_warps as `gemv` takes them (default `prologue_blocks`)."""
    _check_prologue_row(h, weight, weight.shape[1])
    x = torch.empty_like(h)
    block_sizes = block_sizes or dict(zip(("block_n", "block_k", "num_warps"),
                                          prologue_blocks(weight.shape[1], PROLOGUE_ADD_NORM, wide)))
    return x, _prologue_launch(h, weight, bias, PROLOGUE_ADD_NORM, x2=residual, norm_weight=norm_weight, eps=eps,
                               xout=x, **block_sizes)


def swiglu_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, wide: bool = True,
                **block_sizes: int) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight, bias) for gate_up [..., 2K] = (gate, up), one row: the MLP's activation
    and its down projection in one kernel, within roundings of the unfused pair."""
    _check_prologue_row(gate_up, weight, 2 * weight.shape[1])
    block_sizes = block_sizes or dict(zip(("block_n", "block_k", "num_warps"),
                                          prologue_blocks(weight.shape[1], PROLOGUE_SWIGLU, wide)))
    return _prologue_launch(gate_up, weight, bias, PROLOGUE_SWIGLU, **block_sizes)


@implements("norm_prologue")
def fused_add_norm(linear: Linear, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """add_then_norm in one kernel (`add_norm_gemv`) where the one-row kernel runs; `norm` is an RMSNorm."""
    if h.numel() == h.shape[-1] and available(h, linear.weight):
        return add_norm_gemv(h, residual, norm.weight, norm.eps, linear.weight, linear.bias,
                             linear.kernels.wide_prologue)
    return add_then_norm(linear, h, residual, norm)


@implements("swiglu_prologue")
def fused_swiglu(linear: Linear, gate_up: torch.Tensor) -> torch.Tensor:
    """swiglu_then_product in one kernel (`swiglu_gemv`) where the one-row kernel runs."""
    if gate_up.numel() == gate_up.shape[-1] and available(gate_up, linear.weight):
        return swiglu_gemv(gate_up, linear.weight, linear.bias, linear.kernels.wide_prologue)
    return swiglu_then_product(linear, gate_up)


class Linear(nn.Linear):
    """nn.Linear whose half-precision CUDA forwards take the products its Kernels value chooses: `linear` at one
    row, `verify_linear` at more; with `add_norm` and `swiglu`, the layer's prologues before the product (see the
    module's docstring). The choices are resolved here, once: a forward calls the stored implementation."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 kernels: Kernels | None = None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.kernels = kernels = kernels or Kernels()
        self.one_row, self.rows = kernels.pick("linear"), kernels.pick("verify_linear")
        self.norm_prologue, self.swiglu_prologue = kernels.pick("norm_prologue"), kernels.pick("swiglu_prologue")
        dn, dk, dw = blocks(in_features)
        self.blocks = (kernels.gemv_block_n or dn, kernels.gemv_block_k or dk, kernels.gemv_warps or dw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if available(x, self.weight):
            if x.numel() == x.shape[-1]:
                return self.one_row(x, self.weight, self.bias, *self.blocks)
            return self.rows(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def add_norm(self, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, self(norm(x))) with x = h + residual, by the chosen norm_prologue."""
        return self.norm_prologue(self, h, residual, norm)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for gate_up = cat(gate, up), by the chosen swiglu_prologue."""
        return self.swiglu_prologue(self, gate_up)
