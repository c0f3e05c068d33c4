"""Hugging Face-format directories <-> Transformer. Weights come only from safetensors; nothing is unpickled."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig, shape_config
from engine.errors import EngineError
from engine.model import Transformer, hf_to_internal, internal_to_hf

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise EngineError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise EngineError("--device cuda was asked for, but no CUDA GPU is available (use --device cpu)")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise EngineError(f"unknown device {name!r}; use cpu or cuda")
    return torch.device(name)


def read_config(path: str | Path, config_class: Any = ModelConfig) -> Any:
    """`path`/config.json (HF keys) as a `config_class`: ModelConfig, or drafter.Eagle3Config for a drafter."""
    d = Path(path)
    if not d.is_dir():
        raise EngineError(f"{d}: not a directory")
    f = d / "config.json"
    if not f.is_file():
        raise EngineError(f"{d}: no config.json")
    try:
        return config_class.from_hf(json.loads(f.read_text()))
    except json.JSONDecodeError as e:
        raise EngineError(f"{f}: invalid JSON ({e})") from None


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise EngineError(f"{path}: index names missing shard(s) {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {', '.join(pickled)}: pickled weights are never loaded; convert to safetensors)" \
            if pickled else ""
        raise EngineError(f"{path}: no *.safetensors weights{hint}")
    return files


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise EngineError(f"{f}: unreadable safetensors file ({e})") from None
    return sd


def shape_hint(model: torch.nn.Module, key: str) -> str:
    """The config fields behind a tensor's shape, where its module declares them in `shape_fields`."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            fields = getattr(model.get_submodule(".".join(parts[:i])), "shape_fields", {})
        except AttributeError:
            continue
        if ".".join(parts[i:]) in fields:
            return f" (config fields: {fields['.'.join(parts[i:])]})"
    return ""


def load_state(model: torch.nn.Module, sd: dict[str, torch.Tensor], where: str) -> None:
    """Copy a (converted) state dict into model, naming the first missing, unexpected or misshapen tensor."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd and not (k == "lm_head.weight" and model.cfg.tie_word_embeddings)]
    if missing:
        raise EngineError(f"{where}: missing tensor {missing[0]}{shape_hint(model, missing[0])}"
                          + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = [k for k in sd if k not in own]
    if unexpected:
        raise EngineError(f"{where}: unexpected tensor {unexpected[0]} (does config.json match the weights?)")
    for k, t in sd.items():
        if tuple(t.shape) != tuple(own[k].shape):
            raise EngineError(f"{where}: tensor {k} has shape {tuple(t.shape)}, config implies "
                              f"{tuple(own[k].shape)}{shape_hint(model, k)}")
    model.load_state_dict(sd, strict=False)


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32"
               ) -> Transformer:
    path = Path(path)
    cfg = read_config(path)
    sd = read_safetensors(weight_files(path))
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    dtype = resolve_dtype(dtype)
    with torch.device("meta"):
        model = Transformer(cfg)
    try:
        sd = hf_to_internal(model, sd)
    except EngineError as e:
        raise EngineError(f"{path}: {e}") from None
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    model = model.to_empty(device="cpu")
    load_state(model, sd, str(path))
    model._set_rope(model.rope_cos.shape[0], None)  # buffers were left empty by to_empty
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device=device, dtype=dtype).eval()


def random_model(shape: str | ModelConfig, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype = "float32", seed: int = 0) -> Transformer:
    """A model of a named shape with N(0, 0.02) weights, built directly on the device."""
    cfg = shape_config(shape) if isinstance(shape, str) else shape
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg)
        init_weights(model)
    return model.to(dtype=resolve_dtype(dtype)).eval()


@torch.no_grad()
def init_weights(model: torch.nn.Module, std: float = 0.02) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("_norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        elif name.endswith(".bias") or name.endswith("e_score_correction_bias"):
            p.zero_()
        else:
            p.normal_(0.0, std)


def save_model(model: Transformer, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors in the HF layout (transformers loads it)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = internal_to_hf(model, {k: v.detach() for k, v in model.state_dict().items()})
    if model.cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    hf = {(k if k.startswith("lm_head") else f"model.{k}"): (v.to(dtype) if dtype else v).contiguous().cpu()
          for k, v in sd.items()}
    tmp = path / "model.safetensors.tmp"
    save_file(hf, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / "model.safetensors")
    cfg = model.cfg.to_hf()
    cfg["torch_dtype"] = str(dtype or model.dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path
