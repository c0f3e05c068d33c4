"""Routed experts for a few tokens (a decode step, a verify), in Triton: two matrix-vector kernels that read each
chosen expert's weights straight from the stacked [E, ...] tensors.

`deepseek.Experts._grouped` sorts the (token, expert) pairs by expert, builds offsets and runs torch's grouped
GEMM, whose tiles are shaped for many rows per expert; at one to eight tokens each active expert has one or two rows,
and the sort, histogram and scatter back are kernels of their own. Here nothing is sorted:
- `_gemv_gate_up`: one program per (pair, block of intermediate rows) reads that block of the pair's expert's gate
  and up rows against the pair's token and writes silu(gate) * up;
- `_gemv_down`: one program per (token, block of hidden rows) runs the down projection of each of the token's top-k
  pairs and sums them, weighted, in a fixed order (deterministic, no atomics).
The roundings follow `_grouped`'s: gate, up and each expert's output rounded to the weights' dtype, the weighted sum
in float32. A pair's weights are re-read for each pair that routes to the same expert (through L2 at these sizes).

`deepseek.Experts.forward` calls it for a decode step or a verify on a GPU (`available`); `scripts/bench-moe-decode.py`
times it against `_grouped` per block size. On CPU tensors it runs in Triton's interpreter (TRITON_INTERPRET=1),
which is how tests/test_moe_decode.py checks it.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch wheels come without Triton
    triton = None

MAX_PAIRS = 64  # (token, expert) pairs beyond which the grouped GEMM's sorted tiles read the weights fewer times
# The blocks scripts/bench-moe-decode.py found fastest at one token on an H200 and close to the fastest at eight
# (docs/findings.md, section 19). One set for every token count keeps each token's sums in the same order in a decode
# step and in a verify.
BLOCK_I = 8  # intermediate rows per _gemv_gate_up program (each reads gate and up rows: 2 x BLOCK_I rows)
BLOCK_H = 8  # hidden rows per _gemv_down program
BLOCK_K = 512  # reduction width per load


def available(x: torch.Tensor, top_k: int) -> bool:
    """x [N, H]: CUDA, half precision, few enough pairs."""
    return (triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[0] * top_k <= MAX_PAIRS)


if triton is not None:

    @triton.jit
    def _gemv_gate_up(X, W, Idx, Out, hidden, inter, sw_e, sw_r,
                 TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr):
        pair, blk = tl.program_id(0), tl.program_id(1)
        e = tl.load(Idx + pair).to(tl.int64)
        x_row = X + (pair // TOP_K) * hidden
        rows = blk * BLOCK_I + tl.arange(0, BLOCK_I)
        in_rows = rows < inter
        gate_w = W + e * sw_e + rows[:, None] * sw_r  # gate rows, then up rows `inter` further on
        up_w = gate_w + inter * sw_r
        gate = tl.zeros([BLOCK_I], tl.float32)
        up = tl.zeros([BLOCK_I], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            in_cols = cols < hidden
            x = tl.load(x_row + cols, mask=in_cols, other=0.0).to(tl.float32)
            m = in_rows[:, None] & in_cols[None, :]
            gate += tl.sum(tl.load(gate_w + cols[None, :], mask=m, other=0.0).to(tl.float32) * x[None, :], axis=1)
            up += tl.sum(tl.load(up_w + cols[None, :], mask=m, other=0.0).to(tl.float32) * x[None, :], axis=1)
        dt = Out.dtype.element_ty
        gate = gate.to(dt).to(tl.float32)  # the grouped GEMM's outputs are rounded to the weights' dtype
        act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)  # F.silu, rounded
        tl.store(Out + pair * inter + rows, act * up.to(dt).to(tl.float32), mask=in_rows)

    @triton.jit
    def _pair_rows(A, W, pair, e, rows, in_rows, inter, sw_e, sw_r, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
        """One pair's down projection over a block of hidden rows, in float32: rows of expert e against the pair's
        activation."""
        w_rows = W + e * sw_e + rows[:, None] * sw_r
        acc = tl.zeros([BLOCK_H], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            in_cols = cols < inter
            a = tl.load(A + pair * inter + cols, mask=in_cols, other=0.0).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=in_rows[:, None] & in_cols[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        return acc

    @triton.jit
    def _gemv_down(A, W, Idx, Wts, Y, hidden, inter, sw_e, sw_r,
                   TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
        tok, blk = tl.program_id(0), tl.program_id(1)
        rows = blk * BLOCK_H + tl.arange(0, BLOCK_H)
        in_rows = rows < hidden
        out = tl.zeros([BLOCK_H], tl.float32)
        for s in tl.static_range(TOP_K):  # the token's pairs in slot order: a fixed summation order
            pair = tok * TOP_K + s
            e = tl.load(Idx + pair).to(tl.int64)
            acc = _pair_rows(A, W, pair, e, rows, in_rows, inter, sw_e, sw_r, BLOCK_H, BLOCK_K)
            out += acc.to(Y.dtype.element_ty).to(tl.float32) * tl.load(Wts + pair)
        tl.store(Y + tok * hidden + rows, out.to(Y.dtype.element_ty), mask=in_rows)

    @triton.jit
    def _gemv_down_pair(A, W, Idx, Ys, hidden, inter, sw_e, sw_r, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
        """`_gemv_down` split by pair: TOP_K times the programs at one token; each pair's output rounded as there."""
        pair, blk = tl.program_id(0), tl.program_id(1)
        rows = blk * BLOCK_H + tl.arange(0, BLOCK_H)
        in_rows = rows < hidden
        e = tl.load(Idx + pair).to(tl.int64)
        acc = _pair_rows(A, W, pair, e, rows, in_rows, inter, sw_e, sw_r, BLOCK_H, BLOCK_K)
        tl.store(Ys + pair * hidden + rows, acc.to(Ys.dtype.element_ty), mask=in_rows)

    @triton.jit
    def _combine(Ys, Wts, Y, hidden, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
        """The weighted sum of `_gemv_down_pair`'s outputs in slot order, as `_gemv_down` sums."""
        tok, blk = tl.program_id(0), tl.program_id(1)
        rows = blk * BLOCK_H + tl.arange(0, BLOCK_H)
        in_rows = rows < hidden
        out = tl.zeros([BLOCK_H], tl.float32)
        for s in tl.static_range(TOP_K):
            pair = tok * TOP_K + s
            out += tl.load(Ys + pair * hidden + rows, mask=in_rows, other=0.0).to(tl.float32) * tl.load(Wts + pair)
        tl.store(Y + tok * hidden + rows, out.to(Y.dtype.element_ty), mask=in_rows)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                   down_proj: torch.Tensor, block_i: int = BLOCK_I, block_h: int = BLOCK_H, block_k: int = BLOCK_K,
                   split_down: bool = False) -> torch.Tensor:
    """x [N, H]; weights [N, k] float32; idx [N, k]; gate_up_proj [E, 2I, H] (gate rows, then up);
    down_proj [E, H, I] -> [N, H] in x's dtype: sum over slots of weight * expert(x). The block sizes and
    split_down (the down projection one program per pair and block, then a weighted sum: more programs for one
    token) are the benchmark's to sweep; block sizes are powers of two."""
    N, k = idx.shape
    E, two_i, H = gate_up_proj.shape
    inter = two_i // 2
    if gate_up_proj.stride(-1) != 1 or down_proj.stride(-1) != 1:
        raise ValueError("expert weights must be contiguous along their rows")
    x, idx, weights = x.contiguous(), idx.contiguous(), weights.float().contiguous()
    act = torch.empty(N * k, inter, dtype=x.dtype, device=x.device)
    _gemv_gate_up[(N * k, triton.cdiv(inter, block_i))](
        x, gate_up_proj, idx, act, H, inter, gate_up_proj.stride(0), gate_up_proj.stride(1),
        TOP_K=k, BLOCK_I=block_i, BLOCK_K=block_k, num_warps=4)
    y = torch.empty(N, H, dtype=x.dtype, device=x.device)
    if split_down:
        ys = torch.empty(N * k, H, dtype=x.dtype, device=x.device)
        _gemv_down_pair[(N * k, triton.cdiv(H, block_h))](
            act, down_proj, idx, ys, H, inter, down_proj.stride(0), down_proj.stride(1),
            BLOCK_H=block_h, BLOCK_K=block_k, num_warps=4)
        _combine[(N, triton.cdiv(H, block_h))](ys, weights, y, H, TOP_K=k, BLOCK_H=block_h, num_warps=4)
        return y
    _gemv_down[(N, triton.cdiv(H, block_h))](
        act, down_proj, idx, weights, y, H, inter, down_proj.stride(0), down_proj.stride(1),
        TOP_K=k, BLOCK_H=block_h, BLOCK_K=block_k, num_warps=4)
    return y
