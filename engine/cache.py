"""Static, preallocated KV caches. Each attention module owns one; all share `update` and `move`.

Writes go to explicit slots (index_copy_) so that the same code runs eagerly and inside a CUDA graph, and so
that tree verification can write draft nodes to scratch slots and `move` the accepted path into place.
"""
from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """Per-head keys and values: k, v [B, Hkv, S, D]."""

    def __init__(self, batch: int, kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None, v_head_dim: int | None = None):
        super().__init__()
        shape = (batch, kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        vshape = shape[:-1] + (v_head_dim or head_dim,)
        self.register_buffer("v", torch.zeros(vshape, dtype=dtype, device=device), persistent=False)
        # engine.decode_attention's split counts: the last block of a KV head merges its splits, then sets it to 0
        self.register_buffer("merge_counts", torch.zeros(batch * kv_heads, dtype=torch.int32, device=device),
                             persistent=False)

    def update(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [T]; k, v [B, Hkv, T, D] -> the whole cache."""
        self.k.index_copy_(2, slots, k)
        self.v.index_copy_(2, slots, v)
        return self.k, self.v

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.k.index_copy_(2, dst, self.k.index_select(2, src))
        self.v.index_copy_(2, dst, self.v.index_select(2, src))

    def bytes_per_token(self) -> int:
        return (self.k[:, :, 0].numel() * self.k.element_size() + self.v[:, :, 0].numel() * self.v.element_size())


class MLACache(nn.Module):
    """Multi-head latent attention keeps the compressed latent and the shared rope key, not per-head K/V:
    latent [B, S, kv_lora_rank], k_rope [B, S, qk_rope_head_dim]."""

    def __init__(self, batch: int, max_seq_len: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.register_buffer("latent", torch.zeros(batch, max_seq_len, kv_lora_rank, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("k_rope", torch.zeros(batch, max_seq_len, rope_dim, dtype=dtype, device=device),
                             persistent=False)

    def update(self, slots: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [T]; latent [B, T, R]; k_rope [B, T, Dr] -> the whole cache."""
        self.latent.index_copy_(1, slots, latent)
        self.k_rope.index_copy_(1, slots, k_rope)
        return self.latent, self.k_rope

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.latent.index_copy_(1, dst, self.latent.index_select(1, src))
        self.k_rope.index_copy_(1, dst, self.k_rope.index_select(1, src))

    def bytes_per_token(self) -> int:
        return (self.latent[:, 0].numel() * self.latent.element_size()
                + self.k_rope[:, 0].numel() * self.k_rope.element_size())
