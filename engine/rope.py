"""Rotary position embeddings: inverse frequencies per scaling type, cos/sin tables, and their application."""
from __future__ import annotations

import math

import torch

from engine.config import ModelConfig
from engine.errors import EngineError


def _llama3_scaling(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: low frequencies divided by `factor`, a smooth ramp between."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    low_wavelen = old_len / s["low_freq_factor"]
    high_wavelen = old_len / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_scaling(inv_freq: torch.Tensor, s: dict, dim: int, base: float, max_pos: int
                  ) -> tuple[torch.Tensor, float]:
    """YaRN as DeepSeek-V3 uses it: interpolate low frequencies, keep high ones, scale cos/sin by mscale ratio."""
    # Defaults as transformers fills them: the pretraining length is max_position_embeddings, factor their ratio.
    old_len = s.get("original_max_position_embeddings") or max_pos
    factor = s.get("factor") or max_pos / old_len
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(n_rot: float) -> float:
        return dim * math.log(old_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3), 0, 1)
    extrapolation = 1 - ramp
    inv = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        if m and m_all:
            attn_factor = yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
        else:
            attn_factor = yarn_mscale(factor)
    return inv, float(attn_factor)


def inv_freq_and_scale(cfg: ModelConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for a rotary dimension `dim`, and the factor cos/sin are multiplied by."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    s = cfg.rope_scaling
    kind = (s or {}).get("rope_type", "default")
    if kind == "default":
        return inv, 1.0
    if kind == "llama3":
        return _llama3_scaling(inv, s), 1.0
    if kind == "linear":
        return inv / s["factor"], 1.0
    if kind == "yarn":
        return _yarn_scaling(inv, s, dim, cfg.rope_theta, cfg.max_position_embeddings)
    raise EngineError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, yarn)")


def rope_tables(cfg: ModelConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_pos, dim] in float32, in the rotate-half layout that HF checkpoints use."""
    inv, scale = inv_freq_and_scale(cfg, dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [T, D] gathered at the tokens' positions."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)  # float32 cos/sin promote the products: no casting kernels
