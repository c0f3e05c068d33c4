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

`Linear` is the model's projection: an nn.Linear (same parameters, same state dict) whose forward takes this kernel
for one row of half-precision CUDA input without autograd, cuBLAS otherwise.
Every other forward (verify, prefill, training, CPU) is nn.Linear's. On CPU tensors the kernel runs in Triton's
interpreter (TRITON_INTERPRET=1), which is how tests/test_gemv.py checks it.
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


def prologue_blocks(k: int, prologue: int) -> tuple[int, int, int]:
    """(block_n, block_k, num_warps) of a product with a prologue, k its inputs: with `wide_prologue` more rows a
    program than `blocks` gives, so that fewer programs recompute the prologue over the whole row (each reads the
    row, and for the norm the residual and the norm's weight, from L2). The widest that compile for sm_90 without
    spilling (scripts/kernel-report.py's way, 2026-12-04): the norm 16 rows up to 2048 inputs and 8 above, SwiGLU
    8 rows."""
    if not wide_prologue:
        return blocks(k)
    if prologue == ADD_NORM:
        return (16, 2048, 8) if k <= 2048 else (8, 2048, 8)
    return (8, 2048, 8) if k <= 8192 else (8, 1024, 8)


enabled = True  # benchmarks switch it off to time cuBLAS at every one-row product
wide_prologue = True  # and this one to time the prologue kernels at `blocks`' rows a program


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row of half-precision CUDA input, no autograd, a weight contiguous along K."""
    return (enabled and triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.numel() == x.shape[-1] and weight.numel() <= MAX_WEIGHT
            and weight.stride(-1) == 1 and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


# What a product's kernel computes its row of inputs from, before the product (a compile-time switch of one kernel)
PLAIN, ADD_NORM, SWIGLU = 0, 1, 2
# Each prologue on its own switch, so that an A/B (scripts/ab-decode.py --switch engine.gemv.fuse_norm) times one at a
# time: off, the norm or the activation runs as its own kernel, as inductor compiles it
fuse_norm = True
fuse_swiglu = True

if triton is not None:
    _ADD_NORM, _SWIGLU = tl.constexpr(ADD_NORM), tl.constexpr(SWIGLU)  # what a kernel may read of the module

    @triton.jit
    def _gemv_rows(X, X2, G, W, Bias, Xout, Y, N, sw_n, eps, K: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PROLOGUE: tl.constexpr):
        """Y[rows] = W[rows] @ x for BLOCK_N rows a program, x by PROLOGUE: PLAIN x = X; ADD_NORM x = rmsnorm(X + X2)
        with weight G (the sum, rounded to X's dtype as a residual add rounds it, stored to Xout by program 0);
        SWIGLU x = silu(X[:K]) * X[K:2K]. Every program computes its x itself: x is a few KiB, read from L2."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            in_cols = cols < K
            x = tl.load(X + cols, mask=in_cols, other=0.0).to(tl.float32)
            if PROLOGUE == _ADD_NORM:
                x = (x + tl.load(X2 + cols, mask=in_cols, other=0.0).to(tl.float32)).to(Xout.dtype.element_ty)
                tl.store(Xout + cols, x, mask=in_cols & (pid == 0))
                x = x.to(tl.float32)
                squares += x * x
                x = x * tl.load(G + cols, mask=in_cols, other=0.0).to(tl.float32)
            if PROLOGUE == _SWIGLU:
                x = x * tl.sigmoid(x) * tl.load(X + K + cols, mask=in_cols, other=0.0).to(tl.float32)
            w = tl.load(W + rows[:, None] * sw_n + cols[None, :], mask=in_rows[:, None] & in_cols[None, :],
                        other=0.0, eviction_policy="evict_first")  # read once: keep x in cache, not w
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if PROLOGUE == _ADD_NORM:  # the norm's scale is one number for the row: it factors out of the sum
            y = y * tl.rsqrt(tl.sum(squares) / K + eps)
        if HAS_BIAS:
            y += tl.load(Bias + rows, mask=in_rows, other=0.0).to(tl.float32)
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=in_rows)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: int,
            x2: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            xout: torch.Tensor | None = None, block_n: int | None = None, block_k: int | None = None,
            num_warps: int | None = None) -> torch.Tensor:
    N, K = weight.shape
    dn, dk, dw = blocks(K)
    block_n, block_k, num_warps = block_n or dn, block_k or dk, num_warps or dw
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    _gemv_rows[(triton.cdiv(N, block_n),)](
        x.contiguous(), weight if x2 is None else x2.contiguous(), weight if norm_weight is None else norm_weight,
        weight, bias if bias is not None else weight, weight if xout is None else xout, y, N, weight.stride(0), eps,
        K=K, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, PROLOGUE=prologue, num_warps=num_warps)
    return y


def _check_row(x: torch.Tensor, weight: torch.Tensor, width: int) -> None:
    if x.numel() != width or x.shape[-1] != width or weight.stride(-1) != 1:
        raise ValueError(f"gemv: one row of {width} inputs and a weight contiguous along K, got x {tuple(x.shape)}")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
         block_k: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """x [..., K] holding one row; weight [N, K] contiguous along K; bias [N] or None -> [..., N] in x's dtype:
    F.linear(x, weight, bias). The block sizes (powers of two) default to `blocks(K)`; the benchmark sweeps them."""
    _check_row(x, weight, weight.shape[1])
    return _launch(x, weight, bias, PLAIN, block_n=block_n, block_k=block_k, num_warps=num_warps)


def add_norm_gemv(h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None, **blocks: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, F.linear(rms_norm(x) * norm_weight, weight, bias)) with x = h + residual, one row: a layer's residual
    add, its norm and the product after them in one kernel. x has the bits of `h + residual`; the product is the
    unfused one's within roundings (the normalized row is never rounded to x's dtype here). `blocks`: block_n,
    block_k, num_warps as `gemv` takes them."""
    _check_row(h, weight, weight.shape[1])
    x = torch.empty_like(h)
    blocks = blocks or dict(zip(("block_n", "block_k", "num_warps"), prologue_blocks(weight.shape[1], ADD_NORM)))
    return x, _launch(h, weight, bias, ADD_NORM, x2=residual, norm_weight=norm_weight, eps=eps, xout=x, **blocks)


def swiglu_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                **blocks: int) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight, bias) for gate_up [..., 2K] = (gate, up), one row: the MLP's activation
    and its down projection in one kernel, within roundings of the unfused pair."""
    _check_row(gate_up, weight, 2 * weight.shape[1])
    blocks = blocks or dict(zip(("block_n", "block_k", "num_warps"), prologue_blocks(weight.shape[1], SWIGLU)))
    return _launch(gate_up, weight, bias, SWIGLU, **blocks)


class Linear(nn.Linear):
    """nn.Linear whose one-row half-precision CUDA forwards take `gemv` (see the module's docstring), with the two
    fused entries a decoder layer uses (`add_norm`, `swiglu`): the kernel's prologue where it is taken, the unfused
    ops where not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if available(x, self.weight):
            return gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def add_norm(self, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, self(norm(x))) with x = h + residual; `norm` is an RMSNorm (its `weight` and `eps`)."""
        if fuse_norm and available(h, self.weight):
            return add_norm_gemv(h, residual, norm.weight, norm.eps, self.weight, self.bias)
        x = h + residual
        return x, self(norm(x))

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for gate_up = cat(gate, up) along the last dim."""
        if fuse_swiglu and available(gate_up[..., :self.in_features], self.weight):
            return swiglu_gemv(gate_up, self.weight, self.bias)
        gate, up = gate_up.chunk(2, dim=-1)
        return self(F.silu(gate) * up)
