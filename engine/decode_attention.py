"""Split-KV ("flash-decoding") attention for short queries over the static cache, in Triton.

A decode step's attention has few query rows (the query heads of one KV head, times T tokens) and reads the
whole static cache. SDPA's fused kernels start one block per (KV head, row block): a handful of blocks on a GPU of
over a hundred SMs, which leaves most of it idle while the cache streams. Here the cache is cut into splits, each
block computes a partial softmax over its split (all query rows of one KV head at once, so every K/V tile is read
once), and the splits are merged by their log-sum-exp. Used by `engine.model.grouped_attention` on CUDA when
Triton is installed; everything else (CPU, long queries) takes SDPA. What it costs per step: baseline-decode's
profile (docs/findings.md, section 6).

The merge: with a cache's `merge_counts` (one int32 per batch row and KV head, zero between calls) and few splits,
the block that finishes a KV head's last split merges all of them in the same kernel (each block counts itself in with an atomic
add; the last one also sets the count back to zero, so a CUDA graph replays it as captured). Without counts, a
second kernel merges. Both sum the splits in split order, so the result does not depend on which block came last.
The merge's loop is a choice by name (engine.kernels `merge`): `unrolled_merge` unrolls it over every split, so all
their loads are in flight at once; `grouped_merge` (off by default) does so only for a decode step's narrow
partials and unrolls a register-sized group of splits at a time for a verify's wider ones, which over all the splits
of a long context spill (scripts/kernel-report.py); same sums, same order. Which attention runs at all, and whether
the merge is fused, are choices too (engine.model.split_kv, Kernels.fuse_merge).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.kernels import implements

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch wheels come without Triton
    triton = None

MAX_ROWS = 64  # query rows per KV head (query heads per KV head x tokens) this kernel takes
BLOCK_N = 64  # cached positions per tile
TARGET_BLOCKS = 264  # two blocks per SM of an H100/H200 (132 SMs)
# Above this many splits (long contexts) a kernel of its own merges: the last block's merge reads every split's
# partials alone while the second kernel's launch no longer weighs (docs/findings.md, section 23).
FUSE_MAX_SPLITS = 16


def available(q: torch.Tensor, k: torch.Tensor, rows: int) -> bool:
    # half precision only: in float32 tl.dot would round through TF32 where SDPA does not
    return (triton is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and rows <= MAX_ROWS and k.stride(-1) == 1 and q.shape[-1] in (64, 128, 256))


if triton is not None:

    @triton.jit
    def _partial(Q, K, V, Mask, O, ML, S, T, n_kv, sq_b, sq_h, sq_r, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_t,
                 R: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
                 PER_SPLIT: tl.constexpr, N_SPLIT: tl.constexpr, SCALE: tl.constexpr):
        """This block's split of one KV head: the partial softmax of all its query rows, stored to O and ML."""
        bh, split = tl.program_id(0), tl.program_id(1)
        b, h = bh // n_kv, bh % n_kv
        rows = tl.arange(0, BLOCK_R)
        d, dv = tl.arange(0, D), tl.arange(0, DV)
        q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_r + d[None, :], mask=rows[:, None] < R, other=0.0)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, DV], tl.float32)
        start = split * PER_SPLIT
        stop = tl.minimum(start + PER_SPLIT, S)
        for j in range(0, PER_SPLIT, BLOCK_N):
            n = start + j + tl.arange(0, BLOCK_N)
            inside = n < stop
            k = tl.load(K + b * sk_b + h * sk_h + n[:, None] * sk_s + d[None, :], mask=inside[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * SCALE  # [BLOCK_R, BLOCK_N] fp32
            # row r is token r % T of query head r // T (the caller stacks each KV head's query heads)
            ok = tl.load(Mask + (rows % T)[:, None] * sm_t + n[None, :],
                         mask=(rows[:, None] < R) & inside[None, :], other=0) != 0
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays empty
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            v = tl.load(V + b * sv_b + h * sv_h + n[:, None] * sv_s + dv[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l = l * alpha + tl.sum(p, 1)
            m = m_new
        base = (bh * N_SPLIT + split) * BLOCK_R
        real = rows < R  # tl.dot's padding rows (BLOCK_R >= 16) are neither stored nor merged
        tl.store(O + (base + rows[:, None]) * DV + dv[None, :], acc, mask=real[:, None])
        tl.store(ML + (base + rows) * 2, m, mask=real)
        tl.store(ML + (base + rows) * 2 + 1, l, mask=real)

    @triton.jit
    def _last_split(Counts, bh, N_SPLIT: tl.constexpr):
        """Whether this block stored the last split of its KV head (each block counts itself in)."""
        tl.debug_barrier()  # every thread's partial stored before the count says so (the atomic releases them)
        return tl.atomic_add(Counts + bh, 1, sem="acq_rel", scope="gpu") == N_SPLIT - 1

    @triton.jit
    def _splitkv_partial(Q, K, V, Mask, O, ML, Out, Counts, S, T, n_kv,
                         sq_b, sq_h, sq_r, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_t, so_b, so_h, so_r,
                         R: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                         BLOCK_N: tl.constexpr, PER_SPLIT: tl.constexpr, N_SPLIT: tl.constexpr,
                         SCALE: tl.constexpr, FUSED_MERGE: tl.constexpr):
        _partial(Q, K, V, Mask, O, ML, S, T, n_kv, sq_b, sq_h, sq_r, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_t,
                 R, BLOCK_R, D, DV, BLOCK_N, PER_SPLIT, N_SPLIT, SCALE)
        if FUSED_MERGE:
            bh = tl.program_id(0)
            if _last_split(Counts, bh, N_SPLIT):  # the others' partials are all written
                _merge(O, ML, Out, (bh // n_kv) * so_b + (bh % n_kv) * so_h, so_r, bh, R, BLOCK_R, DV, N_SPLIT)
                tl.atomic_xchg(Counts + bh, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _merge(O, ML, Out, out_off, so_r, bh, R: tl.constexpr, BLOCK_R: tl.constexpr, DV: tl.constexpr,
               N_SPLIT: tl.constexpr):
        """The splits of one KV head, by log-sum-exp, in split order. Loads bypass L1 (.cg): other blocks wrote
        them in this kernel. The loops unroll, so every split's loads are in flight at once."""
        rows = tl.arange(0, BLOCK_R)
        real = rows < R  # only the real rows were stored: the padding rows' loads are masked off, never read
        dv = tl.arange(0, DV)
        m_all = tl.full([BLOCK_R], float("-inf"), tl.float32)
        for i in tl.static_range(N_SPLIT):
            m_all = tl.maximum(m_all, tl.load(ML + ((bh * N_SPLIT + i) * BLOCK_R + rows) * 2, mask=real,
                                              other=float("-inf"), cache_modifier=".cg"))
        m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, DV], tl.float32)
        for i in tl.static_range(N_SPLIT):
            base = (bh * N_SPLIT + i) * BLOCK_R
            w = tl.exp(tl.load(ML + (base + rows) * 2, mask=real, other=float("-inf"), cache_modifier=".cg") - m_all)
            l += w * tl.load(ML + (base + rows) * 2 + 1, mask=real, other=0.0, cache_modifier=".cg")
            acc += w[:, None] * tl.load(O + (base + rows[:, None]) * DV + dv[None, :], mask=real[:, None], other=0.0,
                                        cache_modifier=".cg")
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # padding rows have l = 0
        tl.store(Out + out_off + rows[:, None] * so_r + dv[None, :], out.to(Out.dtype.element_ty),
                 mask=real[:, None])

    @triton.jit
    def _splitkv_merge(O, ML, Out, so_b, so_h, so_r, n_kv,
                       R: tl.constexpr, BLOCK_R: tl.constexpr, DV: tl.constexpr, N_SPLIT: tl.constexpr):
        bh = tl.program_id(0)
        _merge(O, ML, Out, (bh // n_kv) * so_b + (bh % n_kv) * so_h, so_r, bh, R, BLOCK_R, DV, N_SPLIT)


@implements("merge")
def unrolled_merge() -> tuple[Callable, Callable]:
    """(partial kernel, merge kernel) whose merge unrolls its loop over every split."""
    return _splitkv_partial, _splitkv_merge


# ---- grouped_merge (merge): a verify's wide partials merged a register-sized group of splits at a time ----------
if triton is not None:
    # The merge's partials in flight: all of a decode step's splits (its real rows hold GROUPED_MERGE_TILE values a
    # split at most: 4 query heads a KV head, head dim 128), and GROUPED_MERGE_VALUES values' worth of splits at a
    # time of a verify's wider ones. Constexprs: kernels read them.
    GROUPED_MERGE_TILE = tl.constexpr(4 * 128)
    GROUPED_MERGE_VALUES = tl.constexpr(2 * 32 * 128)

    @triton.jit
    def _merge_split(O, ML, base, rows, real, dv, m_all, l, acc, DV: tl.constexpr):
        """One split's partial added into the running (l, acc) at the common max m_all."""
        w = tl.exp(tl.load(ML + (base + rows) * 2, mask=real, other=float("-inf"), cache_modifier=".cg") - m_all)
        l += w * tl.load(ML + (base + rows) * 2 + 1, mask=real, other=0.0, cache_modifier=".cg")
        acc += w[:, None] * tl.load(O + (base + rows[:, None]) * DV + dv[None, :], mask=real[:, None], other=0.0,
                                    cache_modifier=".cg")
        return l, acc

    @triton.jit
    def _merge_in_groups(O, ML, Out, out_off, so_r, bh, R: tl.constexpr, BLOCK_R: tl.constexpr, DV: tl.constexpr,
                         N_SPLIT: tl.constexpr):
        """`_merge`'s sums in its order; a decode step's loops unroll, so every split's loads are in flight at
        once; a wider partial (a verify's rows: over GROUPED_MERGE_TILE values in its real rows) unrolls
        GROUPED_MERGE_VALUES values' worth of splits at a time, which the registers hold (over all the splits of a
        long context they spill: scripts/kernel-report.py)."""
        rows = tl.arange(0, BLOCK_R)
        real = rows < R
        dv = tl.arange(0, DV)
        m_all = tl.full([BLOCK_R], float("-inf"), tl.float32)
        for i in tl.static_range(N_SPLIT):
            m_all = tl.maximum(m_all, tl.load(ML + ((bh * N_SPLIT + i) * BLOCK_R + rows) * 2, mask=real,
                                              other=float("-inf"), cache_modifier=".cg"))
        m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, DV], tl.float32)
        if R * DV <= GROUPED_MERGE_TILE:
            for i in tl.static_range(N_SPLIT):
                l, acc = _merge_split(O, ML, (bh * N_SPLIT + i) * BLOCK_R, rows, real, dv, m_all, l, acc, DV)
        else:
            for i in tl.range(N_SPLIT, loop_unroll_factor=max(1, GROUPED_MERGE_VALUES // (R * DV))):
                l, acc = _merge_split(O, ML, (bh * N_SPLIT + i) * BLOCK_R, rows, real, dv, m_all, l, acc, DV)
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # padding rows have l = 0
        tl.store(Out + out_off + rows[:, None] * so_r + dv[None, :], out.to(Out.dtype.element_ty),
                 mask=real[:, None])

    @triton.jit
    def _splitkv_partial_grouped(Q, K, V, Mask, O, ML, Out, Counts, S, T, n_kv,
                                 sq_b, sq_h, sq_r, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_t, so_b, so_h, so_r,
                                 R: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                                 BLOCK_N: tl.constexpr, PER_SPLIT: tl.constexpr, N_SPLIT: tl.constexpr,
                                 SCALE: tl.constexpr, FUSED_MERGE: tl.constexpr):
        _partial(Q, K, V, Mask, O, ML, S, T, n_kv, sq_b, sq_h, sq_r, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_t,
                 R, BLOCK_R, D, DV, BLOCK_N, PER_SPLIT, N_SPLIT, SCALE)
        if FUSED_MERGE:
            bh = tl.program_id(0)
            if _last_split(Counts, bh, N_SPLIT):
                _merge_in_groups(O, ML, Out, (bh // n_kv) * so_b + (bh % n_kv) * so_h, so_r, bh, R, BLOCK_R, DV,
                                 N_SPLIT)
                tl.atomic_xchg(Counts + bh, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _splitkv_merge_grouped(O, ML, Out, so_b, so_h, so_r, n_kv,
                               R: tl.constexpr, BLOCK_R: tl.constexpr, DV: tl.constexpr, N_SPLIT: tl.constexpr):
        bh = tl.program_id(0)
        _merge_in_groups(O, ML, Out, (bh // n_kv) * so_b + (bh % n_kv) * so_h, so_r, bh, R, BLOCK_R, DV, N_SPLIT)


@implements("merge")
def grouped_merge() -> tuple[Callable, Callable]:
    """(partial kernel, merge kernel) whose merge unrolls a register-sized group of a verify's splits at a time."""
    return _splitkv_partial_grouped, _splitkv_merge_grouped


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, tokens: int,
                       merge_counts: torch.Tensor | None = None, merge: Callable | None = None,
                       block_n: int = BLOCK_N) -> torch.Tensor:
    """q [B, Hkv, R, D] (row r: token r % tokens of one of the KV head's query heads), k [B, Hkv, S, D],
    v [B, Hkv, S, Dv], mask [tokens, S] bool -> [B, Hkv, R, Dv]. merge_counts: int32, at least B * Hkv, all zero
    (KVCache.merge_counts): the splits merge in the same kernel; None: in a second one. `merge`: an implementation
    of the merge choice (default unrolled_merge); block_n: cached positions a tile."""
    partial_kernel, merge_kernel = (merge or unrolled_merge)()
    B, n_kv, R, D = q.shape
    S, DV = k.shape[2], v.shape[3]
    block_r = max(16, triton.next_power_of_2(R))  # tl.dot needs 16 rows
    n_split = max(1, min(triton.cdiv(S, block_n), TARGET_BLOCKS // (B * n_kv)))
    per_split = triton.cdiv(triton.cdiv(S, n_split), block_n) * block_n
    n_split = triton.cdiv(S, per_split)
    part = torch.empty(B * n_kv * n_split * block_r, DV, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * n_kv * n_split * block_r, 2, dtype=torch.float32, device=q.device)
    out = torch.empty(B, n_kv, R, DV, dtype=q.dtype, device=q.device)
    q, mask = q.contiguous(), mask.contiguous()
    fused = merge_counts is not None and n_split <= FUSE_MAX_SPLITS
    if fused and (merge_counts.dtype != torch.int32 or merge_counts.numel() < B * n_kv):
        raise ValueError(f"merge_counts: int32 with at least {B * n_kv} elements")
    partial_kernel[(B * n_kv, n_split)](
        q, k, v, mask, part, ml, out, merge_counts if fused else ml, S, tokens, n_kv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask.stride(0), out.stride(0), out.stride(1), out.stride(2),
        R=R, BLOCK_R=block_r, D=D, DV=DV, BLOCK_N=block_n, PER_SPLIT=per_split, N_SPLIT=n_split,
        SCALE=D ** -0.5, FUSED_MERGE=fused, num_warps=4)
    if not fused:
        merge_kernel[(B * n_kv,)](part, ml, out, out.stride(0), out.stride(1), out.stride(2), n_kv,
                                  R=R, BLOCK_R=block_r, DV=DV, N_SPLIT=n_split, num_warps=4)
    return out
