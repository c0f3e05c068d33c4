"""Named random-weight shapes: measure speed without checkpoints (`--shape NAME`). Numbers follow the public
configs of each model."""
from __future__ import annotations

import difflib
from typing import Any

from engine.config import ModelConfig
from engine.errors import EngineError


def _yarn(factor: float, original: int, beta_fast: float = 32, beta_slow: float = 1) -> dict[str, Any]:
    """DeepSeek-V3's YaRN settings (mscale and mscale_all_dim 1: the softmax scale grows with the factor)."""
    return dict(rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                beta_fast=beta_fast, beta_slow=beta_slow, mscale=1.0, mscale_all_dim=1.0)


SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 rope_theta=10000.0),
    "small": dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=768,
                  num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                  rope_theta=10000.0),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       rope_theta=10000.0, max_position_embeddings=4096),
    "mistral-7b": dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       rope_theta=1000000.0, max_position_embeddings=32768),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, max_position_embeddings=32768, attention_bias=True),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
    # DeepSeek-V3 family. The tiny one runs on CPU in seconds (grouped routing, a dense first layer, YaRN).
    "deepseek-v3-tiny": dict(model_type="deepseek_v3", vocab_size=4096, hidden_size=256, intermediate_size=768,
                             num_hidden_layers=4, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64,
                             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
                             num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=128,
                             first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=4, topk_group=2,
                             rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192,
                             rope_scaling=_yarn(4.0, 2048)),
    # The mini keeps DeepSeek's head dims, latent rank and routing (8 groups, 4 chosen)
    # with DeepSeek-V2-Lite's width and expert count, so one H200 holds it and the kernels see real shapes.
    "deepseek-v3-mini": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=2048,
                             intermediate_size=10944, num_hidden_layers=12, num_attention_heads=16,
                             q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                             moe_intermediate_size=1408, first_k_dense_replace=1, routed_scaling_factor=2.5,
                             n_group=8, topk_group=4, rms_norm_eps=1e-6, rope_theta=10000.0,
                             max_position_embeddings=163840, bos_token_id=0, eos_token_id=1,
                             rope_scaling=_yarn(40.0, 4096)),
    "deepseek-v3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                        num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
                        first_k_dense_replace=3, routed_scaling_factor=2.5, n_group=8, topk_group=4,
                        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=163840,
                        bos_token_id=0, eos_token_id=1,
                        rope_scaling=_yarn(40.0, 4096)),
    "kimi-k2": dict(model_type="deepseek_v3", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
                    num_hidden_layers=61, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384,
                    num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
                    first_k_dense_replace=1, routed_scaling_factor=2.827, n_group=1, topk_group=1,
                    rms_norm_eps=1e-6, rope_theta=50000.0, max_position_embeddings=131072,
                    bos_token_id=163584, eos_token_id=163585,
                    rope_scaling=_yarn(32.0, 4096, beta_fast=1.0, beta_slow=1.0)),
}


def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        close = difflib.get_close_matches(name, SHAPES, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(SHAPES)}"
        raise EngineError(f"unknown shape {name!r}{hint}")
    return ModelConfig(**SHAPES[name])
