"""The target model: one Transformer for every family, a static KV cache, and forwards of T tokens at given
positions with an explicit mask - decode (T=1), chunked prefill and (tree) verification all use the same call.

Weights are kept fused (q/k/v in `wqkv`, gate/up in `w13`) so a decode step launches fewer, larger GEMVs (at one
row the smaller ones take `engine.gemv.Linear`'s kernel); `hf_to_internal` / `internal_to_hf` translate to and from
the Hugging Face layout. Which kernels the modules run is the `Kernels` value the model is built with
(engine/kernels.py): every module takes it and resolves its choices once, when it is built.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from engine import decode_attention
from engine.cache import KVCache
from engine.config import ModelConfig
from engine.errors import EngineError
from engine.gemv import Linear
from engine.kernels import Kernels, implements
from engine.rope import apply_rope, rope_tables

DEFAULT_ROPE_LEN = 4096


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, exactly as HF Llama/Qwen do; F.rms_norm is one
        # fused kernel on CUDA where the spelled-out formula launches five.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with optional q/k/v bias (Qwen2) and per-head q/k norm (Qwen3).
    `in_dim` differs from the hidden size in EAGLE-3's draft layer, whose input is concat(emb, hidden)."""

    def __init__(self, cfg: ModelConfig, in_dim: int | None = None, kernels: Kernels | None = None):
        super().__init__()
        kernels = kernels or Kernels()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_out, kv_out = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.split = {"wqkv": (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out))}
        self.wqkv = Linear(in_dim or cfg.hidden_size, q_out + 2 * kv_out, bias=cfg.attention_bias, kernels=kernels)
        self.o_proj = Linear(q_out, cfg.hidden_size, bias=False, kernels=kernels)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.cache: KVCache | None = None
        # (q, k, v, mask[, merge_counts]) -> [B, H, T, Dv], k and v as cache.update returns them: the chosen
        # attention; TTT training swaps in its own (engine.train.drafter.unrolled)
        self.attend: Callable[..., torch.Tensor] = attention_of(kernels)

    def make_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        return KVCache(batch, self.n_kv, max_seq_len, self.head_dim, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slots: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        return self.attend_qkv(self.wqkv(x), cos, sin, slots, mask)

    def attend_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        """The layer's attention from its q/k/v projection's output [B, T, (H + 2 Hkv) D] on."""
        B, T, _ = qkv.shape
        H, Hkv = self.n_heads, self.n_kv
        qkv = qkv.view(B, T, H + 2 * Hkv, self.head_dim)  # q, k and v heads side by side
        if self.q_norm is not None:  # Qwen3: per-head norms before RoPE
            qk = torch.cat([self.q_norm(qkv[:, :, :H]), self.k_norm(qkv[:, :, H:H + Hkv])], dim=2)
        else:
            qk = qkv[:, :, :H + Hkv]
        q, k = apply_rope(qk.transpose(1, 2), cos, sin).split([H, Hkv], dim=1)  # one rotation for q and k
        v = qkv[:, :, H + Hkv:].transpose(1, 2)  # [B, Hkv, T, D]
        if self.cache is not None:
            k, v = self.cache.update(slots, k, v)  # [B, Hkv, S, D]
        counts = getattr(self.cache, "merge_counts", None)  # a KVCache's; TTT training's StepKV has none
        y = self.attend(q, k, v, mask) if counts is None else self.attend(q, k, v, mask, counts)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def attention_of(kernels: Kernels) -> Callable[..., torch.Tensor]:
    """The attention a Kernels value chooses, bound to its options: (q, k, v, mask[, merge_counts]) -> output."""
    return partial(kernels.pick("attention"), fuse_merge=kernels.fuse_merge, merge=kernels.pick("merge"),
                   block_n=kernels.attention_block_n or decode_attention.BLOCK_N)


@implements("attention")
def split_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             merge_counts: torch.Tensor | None = None, fuse_merge: bool = True, merge: Callable | None = None,
             block_n: int = decode_attention.BLOCK_N) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, Hkv, S, D], mask [T, S] bool (None: causal) -> [B, H, T, Dv]. merge_counts: the
    cache's, for the split-KV kernel; fuse_merge, merge, block_n: its merge and tile (attention_of binds the
    Kernels value's). Short queries on CUDA (decode, verify, draft steps) take the split-KV kernel of
    engine.decode_attention, everything else `sdpa`."""
    B, H, T, D = q.shape
    kv = k.shape[1]
    if mask is not None and decode_attention.available(q, k, H // kv * T):
        return decode_attention.split_kv_attention(q.reshape(B, kv, H // kv * T, D), k, v, mask, T,
                                                   merge_counts if fuse_merge else None, merge,
                                                   block_n).reshape(B, H, T, -1)
    return sdpa(q, k, v, mask)


@implements("attention")
def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         merge_counts: torch.Tensor | None = None, **_split_kv: object) -> torch.Tensor:
    """split_kv's arguments -> its result, by torch's SDPA on every device (the split-KV options unused).

    Each KV head's query heads are stacked along the query axis, so plain SDPA computes GQA and its fused kernels
    (memory-efficient, cuDNN) accept the mask: with enable_gqa and a mask only the math kernel runs on CUDA, and it
    materialises the repeated K/V of the whole cache in every layer of every decode step."""
    B, H, T, D = q.shape
    kv = k.shape[1]
    rep = H // kv
    if rep == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[None, None],
                                              is_causal=mask is None)
    if mask is None and q.is_cuda:  # training: flash attention takes GQA and causality itself, and its backward has
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # a deterministic mode
    if mask is None:
        mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=q.device).tril()
    y = F.scaled_dot_product_attention(q.reshape(B, kv, rep * T, D), k, v, attn_mask=mask.repeat(rep, 1)[None, None])
    return y.reshape(B, H, T, v.shape[-1])  # row r*T + t of KV head j is query head j*rep + r at token t


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, kernels: Kernels | None = None):
        super().__init__()
        self.split = {"w13": (("gate_proj", hidden), ("up_proj", hidden))}
        self.w13 = Linear(dim, 2 * hidden, bias=False, kernels=kernels)
        self.down_proj = Linear(hidden, dim, bias=False, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, h, residual, cos, sin, slots, mask):
        """The layer's input is h + residual; returns (h, residual) for the next layer, whose first op adds them.
        The residual add that ends a layer thus runs in the next layer's compiled region, fused with that layer's
        norm: one kernel a layer fewer in a compiled step. Eagerly the adds run in the same order as ever."""
        x = h + residual
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, mask)
        return self.mlp(self.post_attention_layernorm(x)), x


class ProductBlock(Block):
    """A Llama-family layer (Attention, MLP) that hands each residual add and norm, and its SwiGLU, to the product
    after it (`Linear.add_norm`, `Linear.swiglu`: by the Kernels value's norm_prologue and swiglu_prologue, one
    kernel at a decode step's one row, the plain ops elsewhere). Built only where a Kernels value fuses a prologue;
    the same sums as Block's with the plain prologues."""

    def forward(self, h, residual, cos, sin, slots, mask):
        attn, mlp = self.self_attn, self.mlp
        x, qkv = attn.wqkv.add_norm(h, residual, self.input_layernorm)
        x, gate_up = mlp.w13.add_norm(attn.attend_qkv(qkv, cos, sin, slots, mask), x, self.post_attention_layernorm)
        return mlp.down_proj.swiglu(gate_up), x


def block_parts(cfg: ModelConfig, i: int, kernels: Kernels | None = None) -> tuple[nn.Module, nn.Module]:
    """The attention and feed-forward modules of layer i for this family."""
    if cfg.is_mla:
        from engine import deepseek

        return deepseek.block_parts(cfg, i, kernels)
    return Attention(cfg, kernels=kernels), MLP(cfg.hidden_size, cfg.intermediate_size, kernels)


def block(cfg: ModelConfig, i: int, kernels: Kernels) -> Block:
    """Layer i: a ProductBlock where the kernels fuse a prologue into a Llama-family layer's products."""
    attn, mlp = block_parts(cfg, i, kernels)
    fused = kernels.fuses_prologue and type(attn) is Attention and type(mlp) is MLP
    return (ProductBlock if fused else Block)(cfg, attn, mlp)


class StaticCacheModule(nn.Module):
    """A module over a static KV cache (Transformer, Eagle3Drafter): what every such module keeps besides its
    layers - float32 cos/sin tables `rope_cos`, `rope_sin` covering the cache's positions and the cache's
    `slot_ids`, none of them saved - and its device and dtype. The subclass sets `rope_cfg` (the ModelConfig whose
    rope the tables follow), `rope_dim` and `max_seq_len`, and ends in a `norm`."""

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device  # every such module ends in a norm; .to() moves and casts it with the rest

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def _set_rope(self, length: int, device: torch.device | None) -> None:
        cos, sin = rope_tables(self.rope_cfg, self.rope_dim, length)  # float32, whatever the weights' dtype
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def _fit_positions(self, max_seq_len: int) -> None:
        """Once the caches hold max_seq_len tokens: tables for at least as many positions, one slot id per token."""
        self.max_seq_len = max_seq_len
        self._set_rope(max(max_seq_len, DEFAULT_ROPE_LEN), self.device)
        self.register_buffer("slot_ids", torch.arange(max_seq_len, device=self.device), persistent=False)


class Transformer(StaticCacheModule):
    def __init__(self, cfg: ModelConfig, kernels: Kernels | None = None):
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels = kernels or Kernels()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(block(cfg, i, kernels) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, kernels=kernels)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope_cfg, self.rope_dim = cfg, cfg.qk_rope_head_dim if cfg.is_mla else cfg.head_dim
        self.max_seq_len = 0
        self._set_rope(min(cfg.max_position_embeddings, DEFAULT_ROPE_LEN), None)

    def with_kernels(self, kernels: Kernels) -> Transformer:
        """This model built with other kernel choices, its parameters and buffers shared (not copied): the B side
        of an A/B (scripts/ab-decode.py). Without caches, as built."""
        with torch.device("meta"):
            twin = Transformer(self.cfg, kernels)
        twin.load_state_dict(self.state_dict(), strict=True, assign=True)
        if self.cfg.tie_word_embeddings:
            twin.lm_head.weight = twin.embed_tokens.weight
        twin._set_rope(self.rope_cos.shape[0], self.device)
        return twin.train(self.training)

    def setup_caches(self, max_seq_len: int, batch_size: int = 1) -> None:
        """Preallocate every layer's cache for max_seq_len tokens; from now on forwards read and write it."""
        dev, dt = self.device, self.dtype
        for layer in self.layers:
            layer.self_attn.cache = layer.self_attn.make_cache(batch_size, max_seq_len, dt, dev)
        self._fit_positions(max_seq_len)

    def drop_caches(self) -> None:
        for layer in self.layers:
            layer.self_attn.cache = None
        self.max_seq_len = 0

    def cache_bytes_per_token(self) -> int:
        return sum(layer.self_attn.cache.bytes_per_token() for layer in self.layers) if self.max_seq_len else 0

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        input_pos: torch.Tensor,  # [T] RoPE positions
        cache_slots: torch.Tensor | None = None,  # [T] where K/V are written (default: input_pos)
        attn_mask: torch.Tensor | None = None,  # [T, S] bool, True = may attend
        hidden_layers: tuple[int, ...] = (),
        last_logits_only: bool = False,
        compiled: bool = False,  # each layer through torch.compile (compiled_layers)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        slots = None
        if self.max_seq_len:
            slots = input_pos if cache_slots is None else cache_slots
            if attn_mask is None:
                attn_mask = self.slot_ids[None, :] <= input_pos[:, None]
        # the first layer adds a zero residual (exact) so that every layer of one structure shares one compile
        h = self.embed_tokens(input_ids)
        residual = torch.zeros_like(h)
        taken: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.compiled_layers() if compiled else self.layers):
            if i in hidden_layers:
                taken[i] = h + residual  # the layer's input, as the layer computes it
            h, residual = layer(h, residual, cos, sin, slots, attn_mask)
        x = h + residual
        if len(self.layers) in hidden_layers:
            taken[len(self.layers)] = x
        aux = torch.cat([taken[i] for i in hidden_layers], dim=-1) if hidden_layers else None
        if last_logits_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x)).float(), aux

    def compiled_layers(self) -> list[Callable[..., torch.Tensor]]:
        """Every layer through torch.compile (inductor fuses the norms, RoPE and activations between the matrix
        reads): regional compilation. Dynamo caches the compiled layer by code and guards on the layer's structure,
        not its identity, so all layers of one structure share one compile per input shape - a deep model compiles
        in the time of one layer, where compiling the whole forward traces every layer. Only the embedding, the final
        norm and the lm_head stay outside, a few kernels per step. The wrappers live outside the module tree:
        state_dict and .to() never see them."""
        calls = vars(self).get("_compiled_layers")
        if calls is None:
            limit = torch._dynamo.config.recompile_limit  # one entry per (layer structure, input shape): widen
            torch._dynamo.config.recompile_limit = max(limit, 64)
            calls = [torch.compile(layer._call_impl, fullgraph=True, dynamic=False) for layer in self.layers]
            vars(self)["_compiled_layers"] = calls
        return calls

    @torch.no_grad()
    def move_cache(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        for layer in self.layers:
            layer.self_attn.cache.move(src_slots, dst_slots)

    def weight_bytes(self, per_token: bool = True) -> int:
        """Bytes of weights one decode step reads: all parameters but the embedding table (one row is read),
        and with MoE only the experts a token is routed to."""
        total = 0
        seen: set[int] = set()
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel() * p.element_size()
        if per_token:
            emb = self.embed_tokens.weight
            if not self.cfg.tie_word_embeddings:
                total -= emb.numel() * emb.element_size()
            total -= sum(getattr(layer.mlp, "inactive_bytes", lambda: 0)() for layer in self.layers)
        return total


def _fused_modules(model: nn.Module):
    for prefix, mod in model.named_modules():
        for fused, parts in getattr(mod, "split", {}).items():
            yield prefix, fused, parts


def _stacked_modules(model: nn.Module):
    """Modules with a `stack` attribute: {param: (per-entry key templates with {e}, ...)}. Entry e of the
    [E, ...] parameter is the concatenation (dim 0) of its templates' tensors, e.g. MoE experts."""
    for prefix, mod in model.named_modules():
        for name, templates in getattr(mod, "stack", {}).items():
            yield prefix, mod, name, templates


def _stack(out: dict[str, torch.Tensor], prefix: str, mod: nn.Module, name: str, templates: tuple[str, ...]) -> None:
    n = getattr(mod, name).shape[0]
    field = getattr(mod, "stack_field", "the config")
    keys = [[f"{prefix}.{t.format(e=e)}" for t in templates] for e in range(n)]
    if not any(k in out for row in keys for k in row):
        return  # already stacked in the checkpoint (or absent: load_state names it)
    missing = [k for row in keys for k in row if k not in out]
    if missing:
        raise EngineError(f"missing tensor {missing[0]} ({field} implies {n} entries of {prefix}.{name})")
    surplus = f"{prefix}.{templates[0].format(e=n)}"
    if surplus in out:
        raise EngineError(f"unexpected tensor {surplus}: {field} implies only {n} entries of {prefix}.{name}")
    out[f"{prefix}.{name}"] = torch.stack([torch.cat([out.pop(k) for k in row], dim=0) for row in keys])


def hf_to_internal(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF keys (without the leading "model.") -> this module's keys: q/k/v and gate/up concatenated,
    per-expert tensors stacked."""
    out = dict(sd)
    for prefix, mod, name, templates in _stacked_modules(model):
        _stack(out, prefix, mod, name, templates)
    for prefix, fused, parts in _fused_modules(model):
        for kind in ("weight", "bias"):
            keys = [f"{prefix}.{name}.{kind}" for name, _ in parts]
            if all(k in out for k in keys):
                out[f"{prefix}.{fused}.{kind}"] = torch.cat([out.pop(k) for k in keys], dim=0)
    return out


def internal_to_hf(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(sd)
    for prefix, fused, parts in _fused_modules(model):
        for kind in ("weight", "bias"):
            key = f"{prefix}.{fused}.{kind}"
            if key in out:
                pieces = out.pop(key).split([n for _, n in parts], dim=0)
                out.update({f"{prefix}.{name}.{kind}": t.contiguous() for (name, _), t in zip(parts, pieces)})
    for prefix, _, name, templates in _stacked_modules(model):
        key = f"{prefix}.{name}"
        if key in out:
            for e, entry in enumerate(out.pop(key)):
                pieces = entry.chunk(len(templates), dim=0)
                out.update({f"{prefix}.{t.format(e=e)}": p.contiguous() for t, p in zip(templates, pieces)})
    return out
