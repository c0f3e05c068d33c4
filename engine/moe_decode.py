"""Routed experts for a few tokens (a decode step, a verify), in Triton: two matrix-vector kernels that read each
chosen expert's weights straight from the stacked [E, ...] tensors, and the shared experts' weights beside them.

`deepseek.Experts._grouped` sorts the (token, expert) pairs by expert, builds offsets and runs torch's grouped
GEMM, whose tiles are shaped for many rows per expert; at one to eight tokens each active expert has one or two rows,
and the sort, histogram and scatter back are kernels of their own. Here nothing is sorted:
- `_gemv_gate_up`: one program per (pair, block of intermediate rows) reads that block of the pair's expert's gate
  and up rows against the pair's token and writes silu(gate) * up; programs after the pairs' do the same for each
  token's shared experts (one MLP), so both run in one launch;
- `_gemv_down`: one program per (token, block of hidden rows) runs the down projection of each of the token's top-k
  pairs and sums them, weighted, in a fixed order (deterministic, no atomics), then adds the shared experts' down
  projection.
The roundings follow `_grouped`'s and `deepseek.MoE`'s: gate, up and each expert's output rounded to the weights'
dtype, the weighted sum in float32 rounded, the shared MLP's output rounded and added to it as a bf16 add would.
The reduction widths (hidden, intermediate) are compile-time constants, so the loops over them unroll and a
program's loads are all in flight at once rather than one block at a time. A pair's weights are re-read for each
pair that routes to the same expert (through L2 at these sizes).

`deepseek.MoE.forward` calls it for a decode step or a verify on a GPU (`available`); `scripts/bench-moe-decode.py`
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
# The blocks scripts/bench-moe-decode.py found fastest at one token on an H200 with the shared experts in, and close
# to the fastest at eight (docs/findings.md, section 23). One set for every token count keeps each token's routed
# sums in the same order in a decode step and in a verify.
BLOCK_I = 4  # intermediate rows per _gemv_gate_up program (each reads gate and up rows: 2 x BLOCK_I rows)
BLOCK_H = 2  # hidden rows per _gemv_down program
BLOCK_K = 1024  # reduction width per load
NUM_WARPS = 4
# A decode step's shared experts run in the routed experts' launches: each program reads its rows for one token, so
# at more tokens cuBLAS's product, which reads them once for all, is quicker (the benchmark's rows at 8 tokens).
SHARED_MAX_TOKENS = 1  # (Kernels.fuse_shared off: at no token count)


def available(x: torch.Tensor, top_k: int) -> bool:
    """x [N, H]: CUDA, half precision, few enough pairs."""
    return (triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[0] * top_k <= MAX_PAIRS)


if triton is not None:

    @triton.jit
    def _gate_up_rows(x_row, w, out, blk, inter, sw_r, HIDDEN: tl.constexpr, BLOCK_I: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        """Rows blk*BLOCK_I.. of one MLP's gate and up projections (gate rows, then up rows `inter` further on)
        against one token: silu(gate) * up, rounded as the grouped GEMM and F.silu round."""
        rows = blk * BLOCK_I + tl.arange(0, BLOCK_I)
        in_rows = rows < inter
        gate_w = w + rows[:, None] * sw_r
        up_w = gate_w + inter * sw_r
        gate = tl.zeros([BLOCK_I], tl.float32)
        up = tl.zeros([BLOCK_I], tl.float32)
        for k0 in tl.static_range(0, HIDDEN, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            in_cols = cols < HIDDEN
            x = tl.load(x_row + cols, mask=in_cols, other=0.0).to(tl.float32)
            m = in_rows[:, None] & in_cols[None, :]
            gate += tl.sum(tl.load(gate_w + cols[None, :], mask=m, other=0.0).to(tl.float32) * x[None, :], axis=1)
            up += tl.sum(tl.load(up_w + cols[None, :], mask=m, other=0.0).to(tl.float32) * x[None, :], axis=1)
        dt = out.dtype.element_ty
        gate = gate.to(dt).to(tl.float32)  # the grouped GEMM's outputs are rounded to the weights' dtype
        act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)  # F.silu, rounded
        tl.store(out + rows, act * up.to(dt).to(tl.float32), mask=in_rows)

    @triton.jit
    def _gemv_gate_up(X, W, Idx, Out, WS, OutS, n_pairs, inter, inter_s, sw_e, sw_r, sws_r,
                      HIDDEN: tl.constexpr, TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        per_pair = tl.cdiv(inter, BLOCK_I)
        if pid < n_pairs * per_pair:  # a routed pair's block
            pair = pid // per_pair
            e = tl.load(Idx + pair).to(tl.int64)
            _gate_up_rows(X + (pair // TOP_K) * HIDDEN, W + e * sw_e, Out + pair * inter, pid % per_pair, inter,
                          sw_r, HIDDEN, BLOCK_I, BLOCK_K)
        else:  # a token's shared experts' block (the grid has these programs only when there are shared experts)
            q = pid - n_pairs * per_pair
            per_tok = tl.cdiv(inter_s, BLOCK_I)
            tok = q // per_tok
            _gate_up_rows(X + tok * HIDDEN, WS, OutS + tok * inter_s, q % per_tok, inter_s, sws_r,
                          HIDDEN, BLOCK_I, BLOCK_K)

    @triton.jit
    def _row_dots(a, w_rows, in_rows, WIDTH: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
        """A block of weight rows (pointers w_rows [BLOCK_H, 1]) against one activation row a, in float32."""
        acc = tl.zeros([BLOCK_H], tl.float32)
        for k0 in tl.static_range(0, WIDTH, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            in_cols = cols < WIDTH
            x = tl.load(a + cols, mask=in_cols, other=0.0).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=in_rows[:, None] & in_cols[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        return acc

    @triton.jit
    def _gemv_down(A, W, Idx, Wts, Y, AS, WS, hidden, sw_e, sw_r, sws_r, TOP_K: tl.constexpr, INTER: tl.constexpr,
                   INTER_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
        tok, blk = tl.program_id(0), tl.program_id(1)
        rows = blk * BLOCK_H + tl.arange(0, BLOCK_H)
        in_rows = rows < hidden
        dt = Y.dtype.element_ty
        out = tl.zeros([BLOCK_H], tl.float32)
        for s in tl.static_range(TOP_K):  # the token's pairs in slot order: a fixed summation order
            pair = tok * TOP_K + s
            e = tl.load(Idx + pair).to(tl.int64)
            acc = _row_dots(A + pair * INTER, W + e * sw_e + rows[:, None] * sw_r, in_rows, INTER, BLOCK_H, BLOCK_K)
            out += acc.to(dt).to(tl.float32) * tl.load(Wts + pair)
        y = out.to(dt)
        if INTER_S > 0:  # + the shared experts' output, each rounded first: MoE.forward's bf16 add
            shared = _row_dots(AS + tok * INTER_S, WS + rows[:, None] * sws_r, in_rows, INTER_S, BLOCK_H, BLOCK_K)
            y = (y.to(tl.float32) + shared.to(dt).to(tl.float32)).to(dt)
        tl.store(Y + tok * hidden + rows, y, mask=in_rows)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                   down_proj: torch.Tensor, block_i: int = BLOCK_I, block_h: int = BLOCK_H, block_k: int = BLOCK_K,
                   *, shared: tuple[torch.Tensor, torch.Tensor] | None = None, num_warps: int = NUM_WARPS
                   ) -> torch.Tensor:
    """x [N, H]; weights [N, k] float32; idx [N, k]; gate_up_proj [E, 2I, H] (gate rows, then up);
    down_proj [E, H, I] -> [N, H] in x's dtype: sum over slots of weight * expert(x), plus the shared experts'
    MLP of x when `shared` holds its weights (w13 [2Is, H], gate rows then up; down [H, Is]). The block sizes and
    num_warps are the benchmark's to sweep; block sizes are powers of two."""
    N, k = idx.shape
    E, two_i, H = gate_up_proj.shape
    inter = two_i // 2
    w13, w_down = shared if shared is not None else (gate_up_proj, down_proj)  # unread stand-ins without
    inter_s = w13.shape[0] // 2 if shared is not None else 0
    if any(t.stride(-1) != 1 for t in (gate_up_proj, down_proj, w13, w_down)):
        raise ValueError("expert weights must be contiguous along their rows")
    x, idx, weights = x.contiguous(), idx.contiguous(), weights.float().contiguous()
    act = torch.empty(N * k, inter, dtype=x.dtype, device=x.device)
    act_s = torch.empty(N, max(inter_s, 1), dtype=x.dtype, device=x.device)
    progs = N * k * triton.cdiv(inter, block_i) + (N * triton.cdiv(inter_s, block_i) if inter_s else 0)
    _gemv_gate_up[(progs,)](
        x, gate_up_proj, idx, act, w13, act_s, N * k, inter, inter_s, gate_up_proj.stride(0),
        gate_up_proj.stride(1), w13.stride(0), HIDDEN=H, TOP_K=k, BLOCK_I=block_i, BLOCK_K=block_k,
        num_warps=num_warps)
    y = torch.empty(N, H, dtype=x.dtype, device=x.device)
    _gemv_down[(N, triton.cdiv(H, block_h))](
        act, down_proj, idx, weights, y, act_s, w_down, H, down_proj.stride(0), down_proj.stride(1),
        w_down.stride(0), TOP_K=k, INTER=inter, INTER_S=inter_s, BLOCK_H=block_h, BLOCK_K=block_k,
        num_warps=num_warps)
    return y
