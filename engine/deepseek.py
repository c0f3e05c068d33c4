"""DeepSeek-V3 / Kimi-K2 blocks: multi-head latent attention (MLA) and the routed mixture of experts.

MLA caches only the compressed latent (kv_lora_rank) and one shared rope key per token. Attention runs over that
cache directly by weight absorption: the query's no-rope part is multiplied into latent space by W_uk (from
kv_b_proj), scores are taken against the latent, and the weighted latent goes out through W_uv. Nothing is expanded
per head, so a decode step reads the cache once, whatever the number of heads. Without a cache (training) the
latent is expanded per head instead, so that SDPA's fused kernels keep memory linear in the sequence.

The routed experts are two stacked parameters ([E, 2I, H] and [E, H, I], the layout transformers 5 uses in memory);
the `stack` attribute tells `model.hf_to_internal` how the per-expert checkpoint tensors map onto them. Routing and
expert compute are loop-free over experts, so decode and verify are graph-capturable: inference runs one grouped
GEMM per projection over the token-expert pairs sorted by expert; training runs every expert and zeroes the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import moe_decode
from engine.cache import MLACache
from engine.config import ModelConfig, check_mla
from engine.errors import EngineError
from engine.gemv import Linear
from engine.kernels import Kernels
from engine.model import MLP, RMSNorm
from engine.rope import apply_rope, yarn_mscale

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3 builds q_a/kv_a layernorms with the default eps, not rms_norm_eps


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)**2 when the rope is scaled (as HF does)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    s = cfg.rope_scaling or {}
    if s.get("rope_type", "default") != "default" and s.get("mscale_all_dim"):
        scale *= yarn_mscale(s["factor"], s["mscale_all_dim"]) ** 2
    return scale


class MLAttention(nn.Module):
    """Multi-head latent attention with q_lora_rank set (q_a_proj, q_a_layernorm, q_b_proj) or unset (q_proj)."""

    def __init__(self, cfg: ModelConfig, kernels: Kernels | None = None):
        super().__init__()
        self.n_heads = H = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.q_lora = cfg.q_lora_rank
        self.interleave = cfg.rope_interleave
        self.scale = softmax_scale(cfg)
        qk = H * (self.nope + self.rope)
        if self.q_lora is None and cfg.attention_bias:
            raise EngineError("attention_bias with q_lora_rank unset is not supported (q_proj has no bias)")
        # q's first projection and kv_a_proj_with_mqa read the same input: one fused GEMV.
        q_in = ("q_a_proj", self.q_lora) if self.q_lora else ("q_proj", qk)
        self.split = {"wa": (q_in, ("kv_a_proj_with_mqa", self.rank + self.rope))}
        self.wa = Linear(cfg.hidden_size, q_in[1] + self.rank + self.rope, bias=cfg.attention_bias, kernels=kernels)
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(self.q_lora, LATENT_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora, qk, bias=False, kernels=kernels)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.rank, H * (self.nope + self.v_dim), bias=False, kernels=kernels)
        self.o_proj = Linear(H * self.v_dim, cfg.hidden_size, bias=cfg.attention_bias, kernels=kernels)
        fused = f"{q_in[0]} + kv_a_proj_with_mqa, fused: " + ("q_lora_rank" if self.q_lora else
                                                              "num_attention_heads, qk_nope_head_dim")
        self.shape_fields = {
            "wa.weight": f"{fused}, kv_lora_rank, qk_rope_head_dim", "q_a_layernorm.weight": "q_lora_rank",
            "q_b_proj.weight": "q_lora_rank, num_attention_heads, qk_nope_head_dim, qk_rope_head_dim",
            "kv_a_layernorm.weight": "kv_lora_rank",
            "kv_b_proj.weight": "kv_lora_rank, num_attention_heads, qk_nope_head_dim, v_head_dim",
            "o_proj.weight": "num_attention_heads, v_head_dim",
        }
        self.cache: MLACache | None = None

    def make_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> MLACache:
        return MLACache(batch, max_seq_len, self.rank, self.rope, dtype, device)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., T, Dr]. Interleaved checkpoints pair dims (0,1), (2,3)...: de-interleave, then rotate-half
        (the result is in HF's output layout; q and k share it, so scores are unchanged)."""
        if self.interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rope(x, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slots: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.n_heads
        q, kv = self.wa(x).split([self.wa.out_features - self.rank - self.rope, self.rank + self.rope], dim=-1)
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_rope = q.view(B, T, H, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rope = kv.split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [B, T, R]
        # the shared rope key rides along as one more head: a single rotation for q and k
        qk_rope = self._rope(torch.cat([q_rope.transpose(1, 2), k_rope[:, None]], dim=1), cos, sin)
        q_rope, k_rope = qk_rope[:, :H], qk_rope[:, H]  # [B, H, T, Dr], [B, T, Dr]
        if self.cache is None:
            y = self._expanded(q_nope, q_rope, latent, k_rope, mask)
        else:
            latent, k_rope = self.cache.update(slots, latent, k_rope)  # [B, S, R], [B, S, Dr]
            y = self._absorbed(q_nope, q_rope, latent, k_rope, mask)
        return self.o_proj(y.reshape(B, T, H * self.v_dim))

    def _absorbed(self, q_nope, q_rope, latent, k_rope, mask) -> torch.Tensor:
        """Attention over the compressed cache: q_nope [B, T, H, Dn], q_rope [B, H, T, Dr], latent [B, S, R],
        k_rope [B, S, Dr], mask [T, S] -> [B, T, H, Dv]."""
        B, T, H, _ = q_nope.shape
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]  # [H, Dn, R], [H, Dv, R]
        q_lat = torch.einsum("bthd,hdr->bhtr", q_nope, w_uk)  # the query in latent space
        # Heads fold into the rows of one matmul, so the shared latent/rope cache is read once, not per head.
        scores = (q_lat.reshape(B, H * T, self.rank) @ latent.transpose(1, 2)
                  + q_rope.reshape(B, H * T, self.rope) @ k_rope.transpose(1, 2))
        scores = scores.view(B, H, T, -1).float() * self.scale
        p = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(q_nope.dtype)
        out_lat = (p.view(B, H * T, -1) @ latent).view(B, H, T, self.rank)
        return torch.einsum("bhtr,hvr->bthv", out_lat, w_uv)

    def _expanded(self, q_nope, q_rope, latent, k_rope, mask) -> torch.Tensor:
        """Without a cache (training, uncached scoring): per-head K/V from the latent, as transformers does, so
        SDPA's fused kernels apply and no [T, T] scores are kept for backward. -> [B, T, H, Dv]."""
        B, T, H, _ = q_nope.shape
        k_nope, v = self.kv_b_proj(latent).view(B, T, H, self.nope + self.v_dim).split([self.nope, self.v_dim], -1)
        k = torch.cat([k_nope.transpose(1, 2), k_rope[:, None].expand(B, H, T, self.rope)], dim=-1)
        q = torch.cat([q_nope.transpose(1, 2), q_rope], dim=-1)
        y = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=mask is None, scale=self.scale,
                                           attn_mask=None if mask is None else mask[None, None])
        return y.transpose(1, 2)


class Router(nn.Module):
    """Sigmoid scores, the score-correction bias for choosing (not weighting), grouped top-k (noaux_tc).
    Kept in float32 whatever the model's dtype, as transformers keeps gate.weight and the bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E = cfg.n_routed_experts
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        def keep_fp32(t: torch.Tensor) -> torch.Tensor:  # move with the model, never round to its dtype
            out = fn(t)
            return out.float() if t.is_meta or out.dtype == torch.float32 else t.to(out.device, torch.float32)

        return super()._apply(keep_fp32, recurse)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> weights [N, k] float32, expert ids [N, k], largest choice score first."""
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        select = self.select_by_ranks if torch.compiler.is_compiling() else self.select_by_topk
        idx = select(choice)
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, idx

    def select_by_topk(self, choice: torch.Tensor) -> torch.Tensor:
        """Grouped top-k by torch.topk: the best groups by their two best scores, then the best experts in them."""
        N, E = choice.shape
        group_scores = choice.view(N, self.n_group, E // self.n_group).topk(2, dim=-1)[0].sum(-1)
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand(-1, -1, E // self.n_group).reshape(N, E)
        return choice.masked_fill(~expert_mask, float("-inf")).topk(self.top_k, dim=-1, sorted=True)[1]

    def select_by_ranks(self, choice: torch.Tensor) -> torch.Tensor:
        """The same selection by ranks (engine.deepseek.ranks), which torch.compile fuses into the ops around it;
        torch.topk stays a radix select of several kernels of its own, three calls in every MoE layer of a step.
        The same ids in the same order as select_by_topk wherever the scores differ (ties: the lower index)."""
        N, E = choice.shape
        groups = choice.view(N, self.n_group, E // self.n_group)
        group_scores = torch.where(ranks(groups) < 2, groups, 0.0).sum(-1)  # a + b exactly, as topk(2)'s sum
        keep = (ranks(group_scores) < self.topk_group)[:, :, None].expand_as(groups).reshape(N, E)
        place = ranks(choice.masked_fill(~keep, float("-inf")))
        return (place[:, None, :] == torch.arange(self.top_k, device=choice.device)[:, None]).int().argmax(-1)


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Each element's place along the last dim, 0 for the largest, ties to the lower index: a compare of every pair
    and a sum (rows of tens to hundreds of experts)."""
    i = torch.arange(x.shape[-1], device=x.device)
    a, b = x[..., :, None], x[..., None, :]  # a: the element, b: every element of its row
    return ((b > a) | ((b == a) & (i[None, :] < i[:, None]))).sum(-1)


class Experts(nn.Module):
    """The routed experts as stacked weights: gate_up_proj [E, 2I, H] (gate rows, then up), down_proj [E, H, I]."""

    def __init__(self, n: int, dim: int, hidden: int, kernels: Kernels | None = None):
        super().__init__()
        kernels = kernels or Kernels()
        # the decode kernels' options, resolved once (engine.kernels: fuse_shared, moe_*)
        self.fuse_shared = kernels.fuse_shared
        self.blocks = {"block_i": kernels.moe_block_i or moe_decode.BLOCK_I,
                       "block_h": kernels.moe_block_h or moe_decode.BLOCK_H,
                       "block_k": kernels.moe_block_k or moe_decode.BLOCK_K,
                       "num_warps": kernels.moe_warps or moe_decode.NUM_WARPS}
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n, dim, hidden))
        self.stack = {"gate_up_proj": ("{e}.gate_proj.weight", "{e}.up_proj.weight"),
                      "down_proj": ("{e}.down_proj.weight",)}
        self.stack_field = "n_routed_experts"

    def expert_bytes(self) -> int:
        return (self.gate_up_proj[0].numel() * self.gate_up_proj.element_size()
                + self.down_proj[0].numel() * self.down_proj.element_size())

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, shared: MLP | None = None
                ) -> torch.Tensor:
        """x [N, H]; weights, idx [N, k] -> [N, H], plus shared(x) when given (the MoE's shared experts). A decode
        step or a verify (few tokens, on a GPU) runs the matrix-vector kernels of engine/moe_decode.py, which at one
        token read the shared experts' weights in the same launches; more tokens the grouped GEMM; training every
        expert."""
        if torch.is_grad_enabled():
            y = self._all_experts(x, weights, idx)
        elif moe_decode.available(x, idx.shape[1]):
            if shared is not None and self.fuse_shared and x.shape[0] <= moe_decode.SHARED_MAX_TOKENS:
                return moe_decode.routed_experts(x, weights, idx, self.gate_up_proj, self.down_proj,
                                                 shared=(shared.w13.weight, shared.down_proj.weight), **self.blocks)
            y = moe_decode.routed_experts(x, weights, idx, self.gate_up_proj, self.down_proj, **self.blocks)
        elif not grouped_mm_ok(x):
            y = self._all_experts(x, weights, idx)
        else:
            y = self._grouped(x, weights, idx)
        return y if shared is None else y + shared(x)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Token-expert pairs sorted by expert, one grouped GEMM per projection: each active expert's weights are
        read once and inactive ones not at all, with no host sync (histogram by scatter_add, offsets on device)."""
        N, k = idx.shape
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=flat.dtype, device=x.device)
        offs = counts.scatter_add_(0, flat, torch.ones_like(flat)).cumsum(0, dtype=torch.int32)
        gate, up = F.grouped_mm(x[order // k], self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        ys = F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)
        y = torch.empty_like(ys).index_copy_(0, order, ys).view(N, k, -1)  # back to (token, slot) order
        return (y * weights[..., None]).sum(1).to(x.dtype)

    def _all_experts(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Every expert over every token, unrouted pairs weighted by zero: differentiable and loop-free (training,
        and devices without a sync-free grouped GEMM)."""
        gate, up = torch.einsum("nh,eoh->eno", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("eni,ehi->enh", F.silu(gate) * up, self.down_proj)
        dense = torch.zeros(idx.shape[0], y.shape[0], dtype=weights.dtype, device=x.device).scatter_(1, idx, weights)
        return torch.einsum("enh,ne->nh", y.float(), dense).to(x.dtype)


def grouped_mm_ok(x: torch.Tensor) -> bool:
    """Where torch's grouped GEMM runs without a host sync: CPU, and bf16 on Hopper/Blackwell (other CUDA cases
    fall back to a loop over offsets copied to the host, which would break graph capture). torch.compile traces
    it in bf16 only."""
    if x.dtype != torch.bfloat16:
        return x.device.type == "cpu" and not torch.compiler.is_compiling()
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device)[0] in (9, 10)
    return x.device.type == "cpu"


class MoE(nn.Module):
    """Routed experts plus always-on shared experts (one MLP of n_shared_experts * moe_intermediate_size)."""

    def __init__(self, cfg: ModelConfig, kernels: Kernels | None = None):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, kernels)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = MLP(cfg.hidden_size, shared, kernels) if shared else None
        self.top_k = cfg.num_experts_per_tok
        self.shape_fields = {
            "gate.weight": "n_routed_experts", "gate.e_score_correction_bias": "n_routed_experts",
            "experts.gate_up_proj": "n_routed_experts, moe_intermediate_size",
            "experts.down_proj": "n_routed_experts, moe_intermediate_size",
            "shared_experts.w13.weight": "n_shared_experts, moe_intermediate_size",
            "shared_experts.down_proj.weight": "n_shared_experts, moe_intermediate_size",
        }

    def inactive_bytes(self) -> int:
        """Expert weights one token does not read: what weight_bytes() leaves out of a decode step."""
        return (self.experts.gate_up_proj.shape[0] - self.top_k) * self.experts.expert_bytes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, idx = self.gate(flat)
        return self.experts(flat, weights, idx, self.shared_experts).view_as(x)


@dataclass
class ExpertReads:
    """Routed experts one forward reads, per MoE layer, and the weight bytes that forward reads in all."""
    experts: list[list[int]]  # ids of the experts the forward's tokens route to, each MoE layer
    weight_bytes: int  # weight_bytes() with each MoE layer's top_k experts replaced by those it really reads

    @property
    def mean(self) -> float:
        return sum(map(len, self.experts)) / len(self.experts)


@torch.no_grad()
def expert_reads(model: nn.Module, input_ids: torch.Tensor, input_pos: torch.Tensor) -> ExpertReads:
    """Which routed experts one forward of these tokens reads (an eager forward, its routing recorded by hooks):
    a decode token reads top_k experts a layer, a verify of T tokens the union of T tokens' choices, which is what
    makes it cost more than a decode step in a memory-bound MoE."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise EngineError("expert_reads needs a model with MoE layers")
    experts: list[list[int]] = []
    hooks = [m.gate.register_forward_hook(lambda _m, _i, out: experts.append(out[1].unique().tolist()))
             for m in layers]
    try:
        model(input_ids, input_pos)
    finally:
        for h in hooks:
            h.remove()
    extra = sum((len(e) - m.top_k) * m.experts.expert_bytes() for e, m in zip(experts, layers))
    return ExpertReads(experts, model.weight_bytes() + extra)


def check_config(cfg: ModelConfig) -> None:
    """Refuse what this implementation does not compute (ModelConfig checks it when built; kept for callers)."""
    check_mla(cfg)


def block_parts(cfg: ModelConfig, i: int, kernels: Kernels | None = None) -> tuple[nn.Module, nn.Module]:
    """Layer i: MLA, and a dense MLP for the first first_k_dense_replace layers, MoE after."""
    check_config(cfg)
    mlp = MoE(cfg, kernels) if cfg.is_moe_layer(i) else MLP(cfg.hidden_size, cfg.intermediate_size, kernels)
    return MLAttention(cfg, kernels), mlp


@dataclass
class CacheBytes:
    """Cache bytes per token (all layers): MLA's latent + rope key against per-head keys and values."""
    latent: int
    expanded: int

    @property
    def ratio(self) -> float:
        return self.expanded / self.latent


def cache_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> CacheBytes:
    size = torch.empty((), dtype=dtype).element_size()
    L, H = cfg.num_hidden_layers, cfg.num_attention_heads
    latent = L * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * size
    expanded = L * H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * size
    return CacheBytes(latent, expanded)
