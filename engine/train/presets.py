"""Named training presets: `cpu` (everything in a few minutes on 2 CPU cores, for CI) and `gpu` (one H200: both
targets in about a minute, ~169M parameters, bf16). A preset fixes the tokenizer, the target shape, target A's
and B's runs, the drafter's run and approach A's fine-tuning run; runbooks override single fields."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.config import ModelConfig
from engine.errors import EngineError

FAMILIES = ("llama", "deepseek_v3")


@dataclass(frozen=True)
class TargetRun:
    mix: str  # corpus mix (engine.train.corpus.MIXES)
    steps: int
    lr: float
    warmup: int
    batch_size: int
    seq_len: int
    data_bytes: int  # bytes of source text taken from the mix's train split
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    ckpt_every: int = 25
    eval_every: int = 0  # 0: validation loss at the end only
    eval_batches: int = 4
    seed: int = 0
    compile: bool = False  # torch.compile the forward (CUDA only)


@dataclass(frozen=True)
class DrafterRun:
    mix: str
    steps: int
    lr: float
    warmup: int
    batch_size: int
    seq_len: int
    data_bytes: int
    draft_vocab_size: int
    samples: int  # training sequences of seq_len tokens (the game plan's "37K" and "1.4M samples")
    regen_tokens: int  # each sequence = a corpus prompt + this many tokens of the target's own greedy answer
    regen_batch: int = 64  # sequences generated at once
    ttt_steps: int = 7  # unrolled training-time-test steps
    step_decay: float = 0.8  # loss weight of step j: step_decay ** j
    # > 0: also fit the target's distribution at this sampling temperature, T**2 * KL(p_T || q_T) per step (as
    # EAGLE-3 and SpecForge distil); 0: off. Helps a drafter whose drafts are sampled from q_T; the engine drafts
    # greedily (acceptance p_T(argmax q)), which only argmax q decides
    kl_temperature: float = 0.0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ckpt_every: int = 25
    seed: int = 0


@dataclass(frozen=True)
class Preset:
    name: str
    vocab_size: int
    tokenizer_bytes: int  # training text of the tokenizer, from both mixes
    model: dict[str, Any]  # llama-family ModelConfig fields of the targets
    target_a: TargetRun
    target_b: TargetRun
    drafter: DrafterRun
    finetune: DrafterRun  # approach A: drafter-A trained further on a small sample of mix B
    eval_prompts: int = 8  # held-out prompts for accept length
    prompt_chars: int = 600
    max_new_tokens: int = 64
    device: str = "cpu"
    dtype: str = "float32"  # dtype of the saved checkpoints (training keeps fp32 weights)


cpu = Preset(
    name="cpu",
    vocab_size=4096,
    tokenizer_bytes=4_000_000,
    model=dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=4, max_position_embeddings=2048, rope_theta=10000.0),
    target_a=TargetRun(mix="A", steps=150, lr=3e-3, warmup=15, batch_size=16, seq_len=128, data_bytes=3_000_000),
    target_b=TargetRun(mix="B", steps=60, lr=1.5e-3, warmup=6, batch_size=16, seq_len=128, data_bytes=3_000_000,
                       seed=1),
    drafter=DrafterRun(mix="A", steps=160, lr=3e-3, warmup=16, batch_size=8, seq_len=128, data_bytes=3_000_000,
                       draft_vocab_size=2048, samples=512, regen_tokens=48),
    finetune=DrafterRun(mix="B", steps=60, lr=1e-3, warmup=6, batch_size=8, seq_len=128, data_bytes=300_000,
                        draft_vocab_size=2048, samples=64, regen_tokens=48, seed=1),
    eval_prompts=8, prompt_chars=600, max_new_tokens=48,
)

gpu = Preset(  # sized so that every h200 runbook, trained with deterministic kernels, re-runs in minutes on one H200
    # (`runbook verify --profile h200`): ~169M parameters, 512-token sequences; data_bytes stays within what the pinned
    # corpus holds per mix (`python -m engine train corpus`)
    name="gpu",
    vocab_size=16384,
    tokenizer_bytes=10_000_000,
    model=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
               num_key_value_heads=4, max_position_embeddings=4096, rope_theta=10000.0),
    target_a=TargetRun(mix="A", steps=250, lr=1e-3, warmup=25, batch_size=32, seq_len=512,
                       data_bytes=16_000_000, ckpt_every=125, eval_every=125, eval_batches=8),
    target_b=TargetRun(mix="B", steps=80, lr=5e-4, warmup=8, batch_size=32, seq_len=512,
                       data_bytes=16_000_000, ckpt_every=80, eval_every=80, eval_batches=8, seed=1),
    # the drafter learns from answers as long as the ones it is measured on (baseline-eagle3 and the accept-length
    # evals generate 256 tokens): with 128-token answers it drafted well for 128 tokens and worse after them. Its steps
    # and batch were chosen by scripts/ab-train.py (findings 30): the drafter was short of data, not of learning rate
    drafter=DrafterRun(mix="A", steps=1000, lr=1e-3, warmup=30, batch_size=16, seq_len=512,
                       data_bytes=8_000_000, draft_vocab_size=8192, samples=8192, regen_tokens=256,
                       regen_batch=512, ckpt_every=250),
    finetune=DrafterRun(mix="B", steps=150, lr=3e-4, warmup=15, batch_size=8, seq_len=512,
                        data_bytes=4_000_000, draft_vocab_size=8192, samples=1024, regen_tokens=256,
                        regen_batch=512, ckpt_every=150, seed=1),
    eval_prompts=16, prompt_chars=1200, max_new_tokens=256, device="cuda", dtype="bfloat16",
)

def names() -> list[str]:
    """The presets defined here (module-level Preset values named as they are called)."""
    return sorted(n for n, v in globals().items() if isinstance(v, Preset) and v.name == n)


def get_preset(name: str) -> Preset:
    """A preset by name. Looked up by name, not through a table of all presets: a record's fingerprint then covers
    the preset its run names and no other (specbook/codehash.py), so changing the gpu preset stales no cpu record."""
    preset = globals().get(name) if isinstance(name, str) else None
    if not isinstance(preset, Preset) or preset.name != name:
        raise EngineError(f"unknown training preset {name!r}; known: {', '.join(names())}")
    return preset


def with_overrides(run: TargetRun | DrafterRun, **overrides: Any) -> TargetRun | DrafterRun:
    """A copy with some fields replaced (None values ignored); unknown names are one clear error."""
    names = {f.name for f in dataclasses.fields(run)}
    if unknown := sorted(k for k in overrides if k not in names):
        raise EngineError(f"unknown {type(run).__name__} field(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(names))}")
    return dataclasses.replace(run, **{k: v for k, v in overrides.items() if v is not None})


def target_config(preset: Preset, family: str = "llama", vocab_size: int | None = None, eos_id: int = 0
                  ) -> ModelConfig:
    """The targets' ModelConfig for a family. deepseek_v3 keeps width and depth and swaps in MLA attention and a
    small MoE (one dense layer first, as DeepSeek-V3 and Kimi-K2 have)."""
    if family not in FAMILIES:
        raise EngineError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    m = dict(preset.model, model_type=family, vocab_size=vocab_size or preset.vocab_size, eos_token_id=eos_id,
             tie_word_embeddings=False)
    if family == "deepseek_v3":
        d, heads = m["hidden_size"], m["num_attention_heads"]
        head = d // heads
        m.update(num_key_value_heads=heads, q_lora_rank=d // 2, kv_lora_rank=d // 4, qk_nope_head_dim=head,
                 qk_rope_head_dim=head // 2, v_head_dim=head, n_routed_experts=8, num_experts_per_tok=2,
                 n_shared_experts=1, moe_intermediate_size=m["intermediate_size"] // 4, first_k_dense_replace=1,
                 routed_scaling_factor=1.0, n_group=1, topk_group=1)
    return ModelConfig(**m)
