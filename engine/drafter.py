"""EAGLE-3 drafter in the published checkpoint format (SGLang, vLLM, SpecForge, SafeAILab/EAGLE read and write it).

One draft layer over three target features:

    h   = fc(cat(f_low, f_mid, f_high))          # only when the input is 3 * target_hidden wide
    x   = cat(input_layernorm(emb(token)), hidden_norm(h))            # [.., 2H]
    h   = h + self_attn(x)                       # q/k/v read 2H, o writes H
    out = h + mlp(post_attention_layernorm(h))   # pre-norm output: the next draft step's hidden state
    logits = lm_head(norm(out))                  # over the draft vocabulary; target id = i + d2t[i]

Entry at position p is built from (hidden state at p, embedding of x_{p+1}) and predicts x_{p+2}.

Feature layers. `aux_layers` are the ids of the layers whose INPUT residual stream is taken (`Transformer.forward`'s
`hidden_layers`), by default (2, L//2, L-3). The published configs name the same states differently:
SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` and SpecForge count the layer whose OUTPUT is taken
(default [1, L//2-1, L-4]), so aux_layers = ids + 1. config.json is written in SGLang's numbering; a checkpoint
without the key uses the default, as SGLang does. Example: DeepSeek-V3 / Kimi (L=61) ids [1, 29, 57] -> layers
(2, 30, 58).

The checkpoint keys are `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d` and, rarely, `embed_tokens`; without
it the drafter embeds with the target's table (held by reference: not saved, not trained, not moved). vLLM's
renamed keys (`layers.0.*`, `draft_id_to_target_id`) are accepted on load.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.errors import EngineError
from engine.fsutil import atomic_write
from engine.gemv import Linear
from engine.kernels import Kernels
from engine.loading import init_weights, load_state, read_config, read_safetensors, resolve_dtype, weight_files
from engine.model import DEFAULT_ROPE_LEN, MLP, Attention, RMSNorm, StaticCacheModule, hf_to_internal, internal_to_hf

ARCHITECTURES = ("LlamaForCausalLMEagle3", "LlamaForCausalLM")
_VLLM_RENAMES = (("layers.0.", "midlayer."), ("draft_id_to_target_id", "d2t"))
# Research-layout options (SpecForge's LlamaForCausalLMEagle3, speculators' converter) that change the draft math:
# their standard values, and what the other value means. A checkpoint using one is refused, not drafted wrongly.
_STANDARD = {"fc_norm": False, "norm_before_fc": False, "norm_output": True}
_UNSUPPORTED = {"fc_norm": "an RMSNorm on each target feature before fc",
                "norm_before_fc": "an RMSNorm on the concatenated features before fc",
                "norm_output": "SpecForge: False computes logits from the layer output without the final norm"}


def aux_layers_from_ids(ids: list[int]) -> tuple[int, ...]:
    """SGLang / SpecForge output-layer ids -> the entering-layer ids `Transformer.forward` takes."""
    return tuple(int(i) + 1 for i in ids)


def ids_from_aux_layers(layers: tuple[int, ...]) -> list[int]:
    return [int(i) - 1 for i in layers]


@dataclass
class Eagle3Config:
    model: ModelConfig  # the draft layer's dimensions and RoPE (a one-layer Llama); vocab_size = the target's
    draft_vocab_size: int
    aux_layer_ids: list[int] | None = None  # SGLang numbering; None: the target's default layers
    target_hidden_size: int | None = None  # when the target is wider or narrower than the draft layer
    architecture: str = ARCHITECTURES[0]
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def tie_word_embeddings(self) -> bool:  # loading.load_state asks
        return False

    @property
    def feature_size(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Eagle3Config":
        arch = (d.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:
            raise EngineError(f"drafter config.json: architectures {d.get('architectures')!r} is not an EAGLE-3 "
                              f"drafter (expected {' or '.join(ARCHITECTURES)})")
        if "draft_vocab_size" not in d and "vocab_size" not in d:
            raise EngineError("drafter config.json has neither draft_vocab_size nor vocab_size")
        eagle = d.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (not isinstance(ids, list) or len(ids) != 3):
            raise EngineError(f"drafter config.json: eagle_aux_hidden_state_layer_ids must list 3 layer ids, "
                              f"got {ids!r}")
        for key, meaning in _UNSUPPORTED.items():
            if key in d and d[key] != _STANDARD[key]:
                raise EngineError(f"drafter config.json: {key}={json.dumps(d[key])} ({meaning}) is not supported: "
                                  f"this engine's draft layer is the standard EAGLE-3 one ({key}="
                                  f"{json.dumps(_STANDARD[key])})")
        known = {"architectures", "draft_vocab_size", "eagle_config", "target_hidden_size"}
        model = ModelConfig.from_hf({**d, "model_type": "llama", "num_hidden_layers": 1})
        extra = {k: v for k, v in model.extra.items() if k not in known}
        model.extra = {}
        return cls(model=model, draft_vocab_size=int(d.get("draft_vocab_size", d.get("vocab_size"))),
                   aux_layer_ids=ids, target_hidden_size=d.get("target_hidden_size"), architecture=arch,
                   extra=extra)

    def to_hf(self, aux_layers: tuple[int, ...]) -> dict[str, Any]:
        d = {**self.extra, **self.model.to_hf()}
        d.update(architectures=[self.architecture], draft_vocab_size=self.draft_vocab_size,
                 num_hidden_layers=1, tie_word_embeddings=False,
                 eagle_config={"eagle_aux_hidden_state_layer_ids": ids_from_aux_layers(aux_layers),
                               "use_aux_hidden_state": True})
        if self.target_hidden_size and self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        return d


class MidLayer(nn.Module):
    """The one decoder layer; attribute names are the checkpoint's `midlayer.*` keys."""

    def __init__(self, cfg: ModelConfig, kernels: Kernels | None = None):
        super().__init__()
        H = cfg.hidden_size
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, in_dim=2 * H, kernels=kernels)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size, kernels)

    def forward(self, emb, h, cos, sin, slots, mask):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
        h = h + self.self_attn(x, cos, sin, slots, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(StaticCacheModule):
    def __init__(self, cfg: Eagle3Config, aux_layers: tuple[int, ...], embedding: nn.Embedding | None = None,
                 kernels: Kernels | None = None):
        super().__init__()
        self.cfg, self.aux_layers = cfg, tuple(aux_layers)
        self.kernels = kernels = kernels or Kernels()
        mc = cfg.model
        self.fc = Linear(3 * cfg.feature_size, mc.hidden_size, bias=False, kernels=kernels)
        self.midlayer = MidLayer(mc, kernels)
        self.norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        self.lm_head = Linear(mc.hidden_size, cfg.draft_vocab_size, bias=False, kernels=kernels)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(mc.vocab_size, dtype=torch.bool))
        # The target's table sits in a tuple so that it is not registered: not saved, trained or moved with us.
        self.embed_tokens = None if embedding is not None else nn.Embedding(mc.vocab_size, mc.hidden_size)
        self._target_embedding = (embedding,)
        self.max_seq_len = 0
        self.rope_cfg, self.rope_dim = mc, mc.head_dim
        self._set_rope(DEFAULT_ROPE_LEN, None)

    @property
    def embedding(self) -> nn.Embedding:
        return self.embed_tokens if self.embed_tokens is not None else self._target_embedding[0]

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def probs_to_target(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., Vd] a distribution over the draft vocabulary -> [..., V] over target ids (0 outside the draft
        vocabulary)."""
        ids = self.draft_to_target(torch.arange(probs.shape[-1], device=probs.device))
        return probs.new_zeros(*probs.shape[:-1], self.cfg.vocab_size).index_copy(-1, ids, probs)

    def setup_caches(self, max_seq_len: int, batch_size: int = 1) -> None:
        attn = self.midlayer.self_attn
        attn.cache = attn.make_cache(batch_size, max_seq_len, self.dtype, self.device)
        self._fit_positions(max_seq_len)

    def drop_caches(self) -> None:
        self.midlayer.self_attn.cache = None
        self.max_seq_len = 0

    def forward(
        self,
        hidden: torch.Tensor,  # [B, T, 3 * target_hidden] target features, or [B, T, H] own previous output
        input_ids: torch.Tensor,  # [B, T] target-vocabulary ids of the NEXT tokens
        input_pos: torch.Tensor,  # [T]
        cache_slots: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,  # [T, S] bool; default causal by position
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> logits [B, T, draft_vocab] (float32), out [B, T, H] (pre-norm: the next step's hidden)."""
        if hidden.shape[-1] != self.cfg.hidden_size:
            hidden = self.fc(hidden)
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        slots = None
        if self.max_seq_len:
            slots = input_pos if cache_slots is None else cache_slots
            if attn_mask is None:
                attn_mask = self.slot_ids[None, :] <= input_pos[:, None]
        emb = self.embedding(input_ids).to(hidden.dtype)
        out = self.midlayer(emb, hidden, cos, sin, slots, attn_mask)
        return self.lm_head(self.norm(out)).float(), out


def default_config(target_cfg: ModelConfig, draft_vocab_size: int, **overrides: Any) -> Eagle3Config:
    """A drafter layer as wide as the target, with the target's heads and RoPE (what SpecForge generates)."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size")
    if target_cfg.is_mla:  # MLA targets have no per-head K/V dims to copy: use a plain GQA layer of the width
        keys = ("hidden_size", "intermediate_size", "num_attention_heads", "rms_norm_eps", "rope_theta",
                "max_position_embeddings", "vocab_size")
    d = {k: getattr(target_cfg, k) for k in keys}
    if target_cfg.is_mla:
        d["num_key_value_heads"] = d["num_attention_heads"]
    d.update(overrides)
    return Eagle3Config(model=ModelConfig(model_type="llama", num_hidden_layers=1, **d),
                        draft_vocab_size=draft_vocab_size)


def draft_vocab(token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent target ids, sorted (how d2t/t2d are chosen from the training data)."""
    if not 0 < size <= token_counts.numel():
        raise EngineError(f"draft vocabulary size {size} must be in 1..{token_counts.numel()}")
    return torch.topk(token_counts.float(), size).indices.sort().values


def set_draft_vocab(drafter: Eagle3Drafter, draft_vocab_ids: torch.Tensor) -> None:
    ids = torch.as_tensor(draft_vocab_ids, dtype=torch.long).flatten().cpu()
    V, Vd = drafter.cfg.vocab_size, drafter.cfg.draft_vocab_size
    if ids.numel() != Vd:
        raise EngineError(f"draft vocabulary has {ids.numel()} ids; the drafter's draft_vocab_size is {Vd}")
    if ids.min() < 0 or ids.max() >= V or (ids[1:] <= ids[:-1]).any():
        raise EngineError(f"draft vocabulary ids must be sorted, unique and within [0, {V})")
    with torch.no_grad():
        drafter.d2t.copy_(ids - torch.arange(Vd))
        drafter.t2d.zero_()
        drafter.t2d[ids.to(drafter.t2d.device)] = True


def new_drafter(target_cfg: ModelConfig, draft_vocab_ids: torch.Tensor, embedding: nn.Embedding | None = None,
                aux_layers: tuple[int, ...] | None = None, seed: int = 0, device: str | torch.device = "cpu",
                dtype: str | torch.dtype = "float32", kernels: Kernels | None = None, **overrides: Any
                ) -> Eagle3Drafter:
    """A randomly initialised drafter for `target_cfg` (for training); pass the target's embedding to share it.
    `overrides` change the draft layer's dimensions (intermediate_size, num_attention_heads, ...); `kernels` what
    its modules run (default: the engine's)."""
    draft_vocab_ids = torch.as_tensor(draft_vocab_ids)
    cfg = default_config(target_cfg, int(draft_vocab_ids.numel()), **overrides)
    if cfg.hidden_size != target_cfg.hidden_size:
        cfg.target_hidden_size = target_cfg.hidden_size
    if embedding is not None and embedding.weight.shape[1] != cfg.hidden_size:
        raise EngineError(f"the shared embedding is {embedding.weight.shape[1]} wide; the drafter is "
                          f"{cfg.hidden_size}")
    aux = tuple(aux_layers or target_cfg.default_aux_layers())
    check_aux_layers(aux, target_cfg)
    torch.manual_seed(seed)
    with torch.device(device):
        drafter = Eagle3Drafter(cfg, aux, embedding, kernels)
        init_weights(drafter)
    set_draft_vocab(drafter, draft_vocab_ids)
    return drafter.to(dtype=resolve_dtype(dtype))


def check_aux_layers(aux: tuple[int, ...], target_cfg: ModelConfig) -> None:
    L = target_cfg.num_hidden_layers
    if len(aux) != 3 or not all(0 <= i <= L for i in aux):
        raise EngineError(f"drafter feature layers {list(aux)} (entering-layer ids) must be 3 ids in 0..{L} "
                          f"for a {L}-layer target")


def check_fits(cfg: Eagle3Config, target_cfg: ModelConfig, has_embedding: bool) -> None:
    """A drafter that does not fit its target: name the field and both sizes."""
    if cfg.vocab_size != target_cfg.vocab_size:
        raise EngineError(f"drafter vocab_size {cfg.vocab_size} does not match the target's "
                          f"{target_cfg.vocab_size}")
    if cfg.feature_size != target_cfg.hidden_size:
        which = "target_hidden_size" if cfg.target_hidden_size else "hidden_size"
        raise EngineError(f"drafter {which} {cfg.feature_size} does not match the target's hidden_size "
                          f"{target_cfg.hidden_size}")
    if not has_embedding and cfg.hidden_size != target_cfg.hidden_size:
        raise EngineError(f"drafter has no embed_tokens.weight and its hidden_size {cfg.hidden_size} differs from "
                          f"the target's {target_cfg.hidden_size}, so it cannot use the target's embedding")
    if not 0 < cfg.draft_vocab_size <= cfg.vocab_size:
        raise EngineError(f"drafter draft_vocab_size {cfg.draft_vocab_size} must be in 1..{cfg.vocab_size}")


def check_layout(sd: dict[str, torch.Tensor], drafter: Eagle3Drafter, where: str) -> None:
    """Checkpoint keys and shapes against the published layout the config implies; d2t within the vocabulary."""
    want = {k: tuple(v.shape) for k, v in internal_to_hf(drafter, dict(drafter.state_dict())).items()}
    for k, shape in want.items():
        if k not in sd:
            raise EngineError(f"{where}: missing tensor {k} (expected shape {list(shape)})")
        if tuple(sd[k].shape) != shape:
            raise EngineError(f"{where}: tensor {k} has shape {list(sd[k].shape)}, expected {list(shape)}")
    unexpected = sorted(set(sd) - set(want))
    if unexpected:
        raise EngineError(f"{where}: unexpected tensor {unexpected[0]} (does config.json match the weights?)")
    V = drafter.cfg.vocab_size
    target_ids = torch.arange(drafter.cfg.draft_vocab_size) + sd["d2t"].long()
    bad = ((target_ids < 0) | (target_ids >= V)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise EngineError(f"{where}: d2t maps draft id {i} to target id {int(target_ids[i])}, outside the "
                          f"vocabulary [0, {V})")


def _rename(key: str) -> str:
    for old, new in _VLLM_RENAMES:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def load_drafter(path: str | Path, target: nn.Module, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, kernels: Kernels | None = None) -> Eagle3Drafter:
    """A published-format drafter directory, checked against `target` (a Transformer). Device and dtype default
    to the target's; d2t/t2d stay int64/bool; kernels to the target's too."""
    path = Path(path)
    cfg = read_config(path, Eagle3Config)
    sd = {_rename(k.removeprefix("model.")): v for k, v in read_safetensors(weight_files(path)).items()}
    own_embedding = "embed_tokens.weight" in sd
    check_fits(cfg, target.cfg, own_embedding)
    aux = aux_layers_from_ids(cfg.aux_layer_ids) if cfg.aux_layer_ids else target.cfg.default_aux_layers()
    check_aux_layers(aux, target.cfg)
    with torch.device("meta"):
        drafter = Eagle3Drafter(cfg, aux, None if own_embedding else target.embed_tokens,
                                kernels or getattr(target, "kernels", None))
    check_layout(sd, drafter, str(path))
    sd["d2t"], sd["t2d"] = sd["d2t"].long(), sd["t2d"].bool()
    sd = hf_to_internal(drafter, sd)
    drafter = drafter.to_empty(device="cpu")
    load_state(drafter, sd, str(path))
    drafter._set_rope(DEFAULT_ROPE_LEN, None)  # to_empty left the buffers uninitialised
    dt = resolve_dtype(dtype) if dtype is not None else target.dtype
    return drafter.to(device=device or target.device, dtype=dt).eval()


def save_drafter(drafter: Eagle3Drafter, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """config.json + model.safetensors in the published layout (no embed_tokens unless the drafter owns one)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = internal_to_hf(drafter, {k: v.detach() for k, v in drafter.state_dict().items()})
    out = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).contiguous().cpu() for k, v in sd.items()}
    atomic_write(path / "model.safetensors", lambda tmp: save_file(out, str(tmp), metadata={"format": "pt"}))
    cfg = drafter.cfg.to_hf(drafter.aux_layers)
    cfg["torch_dtype"] = str(dtype or drafter.dtype).removeprefix("torch.")
    atomic_write(path / "config.json", json.dumps(cfg, indent=2) + "\n")
    return path
