"""Model configuration: one dataclass for every supported family, read from and written to HF config.json."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineError

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
              "first_k_dense_replace", "moe_layer_freq", "routed_scaling_factor", "n_group", "topk_group",
              "norm_topk_prob", "topk_method", "scoring_func", "rope_interleave")
SUPPORTED_TYPES = DENSE_TYPES + ("deepseek_v3",)
ALIASES = {"kimi_k2": "deepseek_v3"}  # Kimi-K2's config.json names its own type for the DeepSeek-V3 architecture

# ---- validation of config.json: every field this engine reads, its type and its range -------------------------
# A size above int32 cannot be a real model and overflows tensor shapes; the weights' shapes bound the rest.
MAX_SIZE = 2**31 - 1
POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings",
                 "draft_vocab_size")  # EAGLE-3 drafters' config.json (engine.drafter.Eagle3Config) shares this check
OPTIONAL_POSITIVE_INTS = ("head_dim", "q_lora_rank", "target_hidden_size")
NON_NEGATIVE_INTS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                     "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace",
                     "moe_layer_freq", "n_group", "topk_group")
OPTIONAL_TOKEN_IDS = ("bos_token_id",)
POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")
BOOLS = ("tie_word_embeddings", "attention_bias", "qk_norm", "norm_topk_prob", "rope_interleave")
STRINGS = ("model_type", "topk_method", "scoring_func")
OBJECTS = ("text_config", "rope_parameters", "rope_scaling", "eagle_config")  # JSON objects (or null) from_hf reads
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ROPE_REQUIRED = {"linear": ("factor",),
                 "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}
ROPE_DIVISORS = ("factor", "low_freq_factor", "high_freq_factor", "rope_theta")  # > 0: the tables divide by them
ROPE_NUMBERS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")  # >= 0 (0: the default)
# What the model computes that config.json could ask otherwise: the MLP gate is SiLU (transformers' ACT2FN maps
# "swish" to SiLU too). torch_dtype (transformers 5: dtype) is how the weights were stored; the engine computes in
# --dtype whatever it says, so any floating-point type is accepted.
ACTIVATIONS = ("silu", "swish")
ACTIVATION_FIELDS = ("hidden_act", "hidden_activation")
FLOAT_DTYPES = ("float32", "float", "float16", "half", "bfloat16", "float64", "double")
DTYPE_FIELDS = ("torch_dtype", "dtype")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not a layer count


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # json reads NaN, Infinity


def _int_in(name: str, v: Any, low: int, optional: bool = False) -> None:
    if optional and v is None:
        return
    if not _is_int(v) or not low <= v <= MAX_SIZE:
        raise EngineError(f"config field {name} must be an integer in {low}..{MAX_SIZE}"
                          f"{' or null' if optional else ''}, got {v!r}")


def check_fields(values: Mapping[str, Any]) -> None:
    """Types and ranges of the known fields present in `values`; EngineError naming the first bad one."""
    for name, v in values.items():
        if name in POSITIVE_INTS or name in OPTIONAL_POSITIVE_INTS:
            _int_in(name, v, 1, optional=name in OPTIONAL_POSITIVE_INTS)
        elif name in NON_NEGATIVE_INTS or name in OPTIONAL_TOKEN_IDS:
            _int_in(name, v, 0, optional=name in OPTIONAL_TOKEN_IDS)
        elif name == "eos_token_id":
            ids = v if isinstance(v, list) else [v]
            if v is not None and not all(_is_int(i) and 0 <= i <= MAX_SIZE for i in ids):
                raise EngineError(f"config field eos_token_id must be a token id, a list of them or null, got {v!r}")
        elif name in POSITIVE_NUMBERS:
            if not _is_number(v) or v <= 0:
                raise EngineError(f"config field {name} must be a finite number > 0, got {v!r}")
        elif name in BOOLS and not isinstance(v, bool):
            raise EngineError(f"config field {name} must be true or false, got {v!r}")
        elif name in STRINGS and not isinstance(v, str):
            raise EngineError(f"config field {name} must be a string, got {v!r}")
        elif name in OBJECTS and v is not None and not isinstance(v, Mapping):
            raise EngineError(f"config field {name} must be a JSON object or null, got {v!r}")
        elif name in ("rope_scaling", "rope_parameters") and v is not None:
            check_rope(name, v)
        elif name in ACTIVATION_FIELDS and v is not None and v not in ACTIVATIONS:
            raise EngineError(f"config field {name} {v!r} is not implemented (supported: {', '.join(ACTIVATIONS)})")
        elif name in DTYPE_FIELDS and v is not None and str(v).removeprefix("torch.") not in FLOAT_DTYPES:
            raise EngineError(f"config field {name} must name a floating-point type ({', '.join(FLOAT_DTYPES)}), "
                              f"got {v!r}")
        elif name == "quantization_config" and v is not None:
            check_quantization(v)


def check_quantization(q: Any) -> None:
    """Quantized weights the loader cannot turn into the engine's dtype are refused: run as they are, their integer
    codes or unscaled values would be read as weights. Block-scaled FP8 (DeepSeek-V3, Kimi-K2) is dequantised when
    loaded (engine.loading.dequantize_fp8)."""
    if not isinstance(q, Mapping):
        raise EngineError(f"config field quantization_config must be a JSON object or null, got {q!r:.60}")
    method = q.get("quant_method")
    if method != "fp8":
        raise EngineError(f"config field quantization_config: quant_method {method!r} is not implemented (supported: "
                          f"fp8 with weight_block_size, dequantised when loaded)")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(_is_int(b) and 1 <= b <= MAX_SIZE for b in block)):
        raise EngineError(f"config field quantization_config: fp8 needs weight_block_size, two positive integers "
                          f"(per-tensor scales are not implemented), got {block!r:.60}")
    if q.get("fmt", "e4m3") != "e4m3":
        raise EngineError(f"config field quantization_config: fp8 fmt {q['fmt']!r} is not implemented (supported: e4m3)")
    if q.get("activation_scheme", "dynamic") != "dynamic":  # static input scales would be tensors nothing reads
        raise EngineError(f"config field quantization_config: activation_scheme {q['activation_scheme']!r} is not "
                          f"implemented (supported: dynamic)")


def fp8_block_size(cfg: "ModelConfig") -> tuple[int, int] | None:
    """The block of rows x columns each FP8 weight scale covers, when config.json declares block-scaled FP8
    (check_quantization accepted it)."""
    q = cfg.extra.get("quantization_config")
    if not isinstance(q, Mapping) or q.get("quant_method") != "fp8":
        return None
    return q["weight_block_size"][0], q["weight_block_size"][1]


def check_rope(name: str, s: Mapping[str, Any]) -> None:
    """A rope_scaling (or transformers 5 rope_parameters) object: a type this engine computes, with its numbers."""
    kind = s.get("rope_type", s.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise EngineError(f"config field {name}: unsupported rope type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    missing = [k for k in ROPE_REQUIRED.get(kind, ()) if s.get(k) is None]
    if missing:
        raise EngineError(f"config field {name}: rope type {kind!r} needs {', '.join(missing)}")
    for k in ROPE_DIVISORS + ROPE_NUMBERS:
        v, positive = s.get(k), k in ROPE_DIVISORS
        if v is not None and not (_is_number(v) and (v > 0 if positive else v >= 0)):
            raise EngineError(f"config field {name}: {k} must be a finite number {'> 0' if positive else '>= 0'}, "
                              f"got {v!r}")
    _int_in(f"{name}.original_max_position_embeddings", s.get("original_max_position_embeddings"), 1, optional=True)
    if "truncate" in s and not isinstance(s["truncate"], bool):
        raise EngineError(f"config field {name}: truncate must be true or false, got {s['truncate']!r}")
    if kind == "llama3" and s["low_freq_factor"] == s["high_freq_factor"]:  # the smooth ramp divides by their gap
        raise EngineError(f"config field {name}: high_freq_factor must differ from low_freq_factor "
                          f"({s['low_freq_factor']})")


def check_config_mapping(d: Any) -> None:
    """What ModelConfig.from_hf (and engine.drafter.Eagle3Config.from_hf) read of a config.json, checked before they
    read it: a JSON object, its nested objects JSON objects, every known field of the right type and range. Every loader
    calls this first, so a malformed file is one EngineError naming the field, never a TypeError deep inside."""
    if not isinstance(d, Mapping):
        raise EngineError(f"config must be a JSON object, got {type(d).__name__}")
    arch = d.get("architectures")
    if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        raise EngineError(f"config field architectures must be a list of strings, got {arch!r}")
    check_fields(merged_text_config(d))  # what from_hf reads: text_config's fields where it has them
    ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and not (isinstance(ids, list) and all(_is_int(i) and -1 <= i <= MAX_SIZE for i in ids)):
        raise EngineError(f"config field eagle_config.eagle_aux_hidden_state_layer_ids must be a list of layer ids, "
                          f"got {ids!r}")


def merged_text_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """A multimodal config's language model: text_config's fields over the top level's, unless text_config names
    a model_type of its own."""
    text = d.get("text_config")
    return {**d, **text} if isinstance(text, Mapping) and "model_type" not in text else dict(d)


def check_mla(cfg: "ModelConfig") -> None:
    """Refuse a deepseek_v3 config this implementation does not compute, naming the field."""
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(cfg, name) <= 0:
            raise EngineError(f"config field {name} must be positive for deepseek_v3, got {getattr(cfg, name)}")
    if cfg.qk_rope_head_dim % 2:
        raise EngineError(f"config field qk_rope_head_dim must be even, got {cfg.qk_rope_head_dim}")
    if cfg.n_routed_experts <= 0:
        return
    if cfg.topk_method != "noaux_tc":
        raise EngineError(f"config field topk_method {cfg.topk_method!r} is not implemented (supported: noaux_tc)")
    if cfg.scoring_func != "sigmoid":
        raise EngineError(f"config field scoring_func {cfg.scoring_func!r} is not implemented (supported: sigmoid)")
    E, g = cfg.n_routed_experts, cfg.n_group
    if g <= 0 or E % g or E // g < 2:
        raise EngineError(f"config field n_group {g} must divide n_routed_experts {E} into groups of >= 2 experts")
    if not 0 < cfg.topk_group <= g:
        raise EngineError(f"config field topk_group {cfg.topk_group} must be in 1..n_group ({g})")
    if not 0 < cfg.num_experts_per_tok <= cfg.topk_group * (E // g):
        raise EngineError(f"config field num_experts_per_tok {cfg.num_experts_per_tok} must be in 1.."
                          f"{cfg.topk_group * (E // g)} (topk_group * experts per group)")
    if cfg.moe_intermediate_size <= 0:
        raise EngineError(f"config field moe_intermediate_size must be positive, got {cfg.moe_intermediate_size}")


@dataclass
class ModelConfig:
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3" | "yarn", ...}
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's q and k
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # DeepSeek-V3 / Kimi-K2: multi-head latent attention (MLA) ...
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # ... and mixture of experts
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    rope_interleave: bool = True
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # unknown keys, kept for round trips

    def __post_init__(self) -> None:
        check_fields({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"})
        if self.model_type not in SUPPORTED_TYPES:
            raise EngineError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_TYPES)}"
            )
        derived = self.head_dim is None
        if derived:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.model_type == "qwen3":
            self.qk_norm = True
        if self.is_mla:  # as transformers' DeepseekV3Config: no KV groups, head_dim is the rotary dim
            self.num_key_value_heads = self.num_attention_heads
            self.head_dim = self.qk_rope_head_dim
            check_mla(self)
        if self.head_dim <= 0 or self.head_dim % 2:  # rotary embeddings rotate the two halves of each head
            how = f" (hidden_size {self.hidden_size} // num_attention_heads {self.num_attention_heads})" \
                if derived and not self.is_mla else ""
            raise EngineError(f"config field {'qk_rope_head_dim' if self.is_mla else 'head_dim'} must be positive "
                              f"and even, got {self.head_dim}{how}")
        if not self.is_mla and self.num_attention_heads % self.num_key_value_heads:
            raise EngineError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @property
    def is_mla(self) -> bool:
        return self.model_type == "deepseek_v3"

    @property
    def eos_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.n_routed_experts > 0
            and i >= self.first_k_dense_replace
            and i % max(self.moe_layer_freq, 1) == 0
        )

    def default_aux_layers(self) -> tuple[int, int, int]:
        """EAGLE-3's three feature layers: the residual streams entering layers 2, L//2 and L-3."""
        n = self.num_hidden_layers
        return (2, n // 2, n - 3) if n >= 5 else (min(1, n), n // 2, n)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (transformers 4.x and 5.x spellings)."""
        check_config_mapping(d)
        d = merged_text_config(d)
        if d.get("model_type") in ALIASES:
            d["model_type"] = ALIASES[d["model_type"]]
        model_type = d.get("model_type")
        if model_type is None:
            raise EngineError("config.json has no model_type")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known and k != "extra"}
        # transformers 5 moved rope_theta (and the scaling dict) into rope_parameters.
        rope = d.get("rope_parameters") or {}
        if "rope_theta" not in kwargs and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            kwargs["rope_scaling"] = None if scaling["rope_type"] == "default" else scaling
        if model_type == "qwen2":
            kwargs.setdefault("attention_bias", True)
        kwargs["extra"] = {k: v for k, v in d.items() if k not in known}
        try:
            return cls(**kwargs)
        except TypeError as e:  # a field of the wrong type that check_config_mapping does not know
            raise EngineError(f"config: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers loads as the same architecture."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "extra"}
        arch = {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM",
        }[self.model_type]
        if not self.is_mla:
            for k in MLA_FIELDS:
                d.pop(k)
        d.pop("qk_norm")  # implied by model_type
        d["architectures"] = [arch]
        d["hidden_act"] = "silu"
        d["torch_dtype"] = "float32"
        return {**self.extra, **d}
