"""Hugging Face-format directories <-> Transformer. Weights come only from safetensors; nothing is unpickled."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig, check_config_mapping, fp8_block_size
from engine.errors import EngineError
from engine.fsutil import atomic_write
from engine.kernels import Kernels
from engine.model import Transformer, hf_to_internal, internal_to_hf
from engine.shapes import shape_config

INDEX = "model.safetensors.index.json"
SEEDS = (-2**63, 2**64 - 1)  # torch.manual_seed's range
FP8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # safetensors' names
SCALE_SUFFIX = ".weight_scale_inv"  # DeepSeek-V3's name for an FP8 weight's block scales (already inverted)
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


def read_json_object(f: Path) -> dict[str, Any]:
    """A checkpoint's JSON file that must hold an object (config.json, the index, tokenizer_config.json)."""
    try:
        text = f.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise EngineError(f"{f}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise EngineError(f"{f}: unreadable ({e.strerror or e})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise EngineError(f"{f}: invalid JSON ({e})") from None
    if not isinstance(d, dict):
        raise EngineError(f"{f}: must hold a JSON object, got {type(d).__name__}")
    return d


def read_config(path: str | Path, config_class: Any = ModelConfig) -> Any:
    """`path`/config.json (HF keys) as a `config_class`: ModelConfig, or drafter.Eagle3Config for a drafter."""
    d = Path(path)
    if not d.is_dir():
        raise EngineError(f"{d}: not a directory")
    f = d / "config.json"
    if not f.is_file():
        raise EngineError(f"{d}: no config.json")
    raw = read_json_object(f)
    try:
        check_config_mapping(raw)  # types and ranges first: from_hf and the model then trust what they read
        return config_class.from_hf(raw)
    except EngineError as e:
        raise EngineError(f"{f}: {e}") from None


def shard_path(path: Path, index: Path, name: Any) -> Path:
    """A shard named by the index, refused unless it is a relative path inside the checkpoint directory. Checked
    by name, not by resolving links: HF cache snapshots link every file to a blob outside the directory."""
    if not isinstance(name, str) or not name:
        raise EngineError(f"{index}: weight_map must map tensor names to shard file names, got {name!r}")
    parts = PurePosixPath(name.replace("\\", "/"))
    if parts.is_absolute() or PureWindowsPath(name).drive or ".." in parts.parts:
        raise EngineError(f"{index}: shard {name!r} is outside the checkpoint directory (shard names must be "
                          f"relative to it, without '..')")
    return path / parts


def weight_files(path: Path) -> list[Path]:
    index = path / INDEX
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise EngineError(f"{index}: weight_map must be a non-empty JSON object of tensor name -> shard file "
                              f"name, got {weight_map!r:.60}")
        files = sorted({shard_path(path, index, n) for n in weight_map.values()})
        missing = [str(f.relative_to(path)) for f in files if not f.is_file()]
        if missing:
            raise EngineError(f"{path}: index names missing shard(s) {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {', '.join(pickled)}: pickled weights are never loaded; convert to safetensors)" \
            if pickled else ""
        raise EngineError(f"{path}: no *.safetensors weights{hint}")
    return files


def read_shapes(files: list[Path]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as meta tensors of their shapes, from the safetensors headers alone: what the config
    is checked against before anything the size of the model is read or allocated. FP8 tensors keep their dtype
    (dequantize_fp8 reads it); the others are float32."""
    shapes: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    shapes[k] = torch.empty(sl.get_shape(), device="meta", dtype=FP8.get(sl.get_dtype()))
        except (SafetensorError, OSError, ValueError) as e:
            raise EngineError(f"{f}: unreadable safetensors file ({e})") from None
    return shapes


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of `files`; floating-point ones must be finite (NaN weights decode token 0 forever)."""
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise EngineError(f"{f}: unreadable safetensors file ({e})") from None
        for k, t in tensors.items():
            if not finite(t):
                raise EngineError(f"{f}: tensor {k} has NaN or infinite values")
        sd.update(tensors)
    return sd


def finite(t: torch.Tensor) -> bool:
    """No NaN or inf in a floating-point tensor (FP8 upcast: isfinite has no FP8 kernel); meta tensors pass."""
    if not t.is_floating_point() or t.is_meta:
        return True
    return bool(torch.isfinite(t.float() if t.dtype in FP8.values() else t).all())


def dequantize_fp8(sd: dict[str, torch.Tensor], block: tuple[int, int] | None, where: Path
                   ) -> dict[str, torch.Tensor]:
    """Block-scaled FP8 weights (DeepSeek-V3, Kimi-K2: each `W.weight` a float8 [out, in] with a float32
    `W.weight_scale_inv` of one value per `block` of rows x columns) as float32 weights, W * its block's scale, as
    DeepSeek's weight_dequant and transformers' FP8 integration compute; the scales leave the state dict. On meta
    tensors (the header shapes) the same checks and the shapes alone. An FP8 tensor without its scales, or scales
    without their FP8 weight, is refused."""
    out: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        scale = sd.get(k.removesuffix(".weight") + SCALE_SUFFIX) if k.endswith(".weight") else None
        if k.endswith(SCALE_SUFFIX):
            weight = sd.get(k.removesuffix(SCALE_SUFFIX) + ".weight")
            if weight is None or weight.dtype not in FP8.values():
                raise EngineError(f"{where}: tensor {k} scales no FP8 weight")
        elif t.dtype not in FP8.values():
            out[k] = t
        elif block is None:
            raise EngineError(f"{where}: tensor {k} is {str(t.dtype).removeprefix('torch.')}, but config.json declares "
                              f"no quantization_config (fp8 with weight_block_size) to dequantise it with")
        elif scale is None:
            raise EngineError(f"{where}: FP8 tensor {k} has no {k.removesuffix('.weight') + SCALE_SUFFIX}")
        else:
            out[k] = block_dequant(k, t, scale, block, where)
    return out


def block_dequant(name: str, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], where: Path
                  ) -> torch.Tensor:
    """w [out, in] times scale [ceil(out / rows), ceil(in / cols)], each scale value over its block, as float32."""
    rows, cols = block
    if w.dim() != 2:
        raise EngineError(f"{where}: FP8 tensor {name} has shape {tuple(w.shape)}; block scales need a matrix")
    n, m = w.shape
    want = (-(-n // rows), -(-m // cols))
    if tuple(scale.shape) != want:
        raise EngineError(f"{where}: tensor {name.removesuffix('.weight') + SCALE_SUFFIX} has shape "
                          f"{tuple(scale.shape)}, blocks of {rows}x{cols} over {tuple(w.shape)} need {want}")
    full = scale.float().repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :m]
    deq = w.float() * full
    if not finite(deq):
        raise EngineError(f"{where}: tensor {name} has NaN or infinite values once dequantised")
    return deq


def check_counts(cfg: ModelConfig, names: list[str], where: Path) -> None:
    """A config that claims more layers (or per-expert tensors) than the weights hold is refused before the model
    is built and its keys listed: a million meta layers, or a billion experts' key names, take minutes to fail."""
    for field, what, pattern in (("num_hidden_layers", "layers", r"(?:^|\.)layers\.(\d+)\."),
                                 ("n_routed_experts", "experts", r"\.experts\.(\d+)\.")):
        found = [(int(m.group(1)), m, n) for n in names if (m := re.search(pattern, n))]
        claimed = getattr(cfg, field)
        if not found:
            if field == "num_hidden_layers" and claimed:
                raise EngineError(f"{where}: config field {field} is {claimed}, but the weights hold no layers")
            continue  # experts stored stacked (or no MoE): the shape checks compare them
        held, m, name = max(found, key=lambda f: (f[0], f[2]))
        held += 1
        if claimed > held:  # name the first tensor missing, as the tensor checks would
            first = name[:m.start(1)] + str(held) + name[m.end(1):]
            raise EngineError(f"{where}: missing tensor {first} (config field {field} is {claimed}, but the weights "
                              f"hold {held} {what})")


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


def check_state(model: torch.nn.Module, sd: dict[str, torch.Tensor], where: str) -> None:
    """A (converted) state dict against model's own, naming the first missing, unexpected or misshapen tensor.
    Shapes only: `sd` may hold meta tensors read from the headers, `model` may be on the meta device."""
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


def load_state(model: torch.nn.Module, sd: dict[str, torch.Tensor], where: str) -> None:
    """Copy a (converted) state dict into model once check_state accepts it."""
    check_state(model, sd, where)
    model.load_state_dict(sd, strict=False)


def to_internal(model: Transformer, sd: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """HF checkpoint keys -> the model's own (fused q/k/v and gate/up, stacked experts; FP8 weights dequantised);
    lm_head dropped when tied."""
    sd = dequantize_fp8(sd, fp8_block_size(model.cfg), where)
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    try:
        sd = hf_to_internal(model, sd)
    except EngineError as e:
        raise EngineError(f"{where}: {e}") from None
    if model.cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
               kernels: Kernels | None = None) -> Transformer:
    """An HF-format directory. Its config is checked against the weights' shapes (read from the safetensors headers,
    the model built on the meta device) before the weights are read or the model allocated. `kernels`: what its
    modules run (engine.kernels; default the engine's)."""
    path = Path(path)
    cfg = read_config(path)
    dtype = resolve_dtype(dtype)
    files = weight_files(path)
    shapes = read_shapes(files)
    check_counts(cfg, list(shapes), path / "config.json")
    try:
        with torch.device("meta"):
            model = Transformer(cfg, kernels)
    except EngineError as e:  # a config the model cannot build (e.g. an MLA option it does not implement)
        raise EngineError(f"{path / 'config.json'}: {e}") from None
    check_state(model, to_internal(model, shapes, path), str(path))
    sd = to_internal(model, read_safetensors(files), path)
    model = model.to_empty(device="cpu")
    load_state(model, sd, str(path))
    model._set_rope(model.rope_cos.shape[0], None)  # buffers were left empty by to_empty
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device=device, dtype=dtype).eval()


def check_seed(seed: int) -> None:
    """torch.manual_seed takes 64 bits; a larger seed is bad input, not an overflow deep inside torch."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not SEEDS[0] <= seed <= SEEDS[1]:
        raise EngineError(f"seed must be a 64-bit integer ({SEEDS[0]}..{SEEDS[1]}), got {seed!r}")


def random_model(shape: str | ModelConfig, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype = "float32", seed: int = 0, kernels: Kernels | None = None) -> Transformer:
    """A model of a named shape with N(0, 0.02) weights, built directly on the device; `kernels` as load_model's."""
    cfg = shape_config(shape) if isinstance(shape, str) else shape
    check_seed(seed)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg, kernels)
        init_weights(model)
    return model.to(dtype=resolve_dtype(dtype)).eval()


def check_chat_template(source: str, where: Path, name: str = "") -> None:
    """A Jinja chat template must compile: a syntax error found at load time, not at the first chat request."""
    try:
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # jinja2 comes with the serve extra; without it no template is ever rendered
        return
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(source)
    except TemplateSyntaxError as e:
        which = f"chat template {name!r}" if name else "chat template"
        raise EngineError(f"{where}: {which} has a syntax error at line {e.lineno}: {e.message}") from None


def read_chat_template(path: str | Path) -> str | None:
    """The checkpoint's chat template: chat_template.jinja, else tokenizer_config.json's chat_template string (a
    list of named templates is checked, not chosen from). tokenizer_config.json is checked even when the .jinja
    file wins: a garbage file is bad metadata either way."""
    path = Path(path)
    template = None
    cfg_file = path / "tokenizer_config.json"
    if cfg_file.is_file():
        template = read_json_object(cfg_file).get("chat_template")
        named = template if isinstance(template, list) else []
        if template is not None and not isinstance(template, str) and not (
                named and all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in named)):
            raise EngineError(f"{cfg_file}: chat_template must be a string or a list of "
                              f'{{"name": ..., "template": ...}} objects, got {template!r:.60}')
        if isinstance(template, str):
            check_chat_template(template, cfg_file)
        for t in named:
            check_chat_template(t["template"], cfg_file, str(t.get("name", "")))
        template = template if isinstance(template, str) else None
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        try:
            template = jinja.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise EngineError(f"{jinja}: not UTF-8 text (byte {e.start})") from None
        check_chat_template(template, jinja)
    return template


def device_memory_bytes(device: torch.device) -> int:
    """The device's total memory: a GPU's, or this machine's physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_cache_fits(model: Transformer, max_seq_len: int) -> None:
    """Refuse a max_seq_len whose KV cache and position tables alone exceed the device's memory, before they are
    allocated: a failed allocation is an internal failure, a cache length too large for the device is bad input."""
    meta = torch.device("meta")
    per_token = sum(layer.self_attn.make_cache(1, 1, model.dtype, meta).bytes_per_token() for layer in model.layers)
    per_token += 2 * model.rope_dim * 4 + 2 * 8  # float32 cos/sin rows; int64 slot id and sampled-token buffer
    need, have = per_token * max_seq_len, device_memory_bytes(model.device)
    if need > have:
        raise EngineError(f"max_seq_len {max_seq_len} (--max-seq-len) needs {need / 1e9:.1f} GB for the KV cache and "
                          f"position tables alone, more than the {have / 1e9:.1f} GB of {model.device}: lower it")


@torch.no_grad()
def init_weights(model: torch.nn.Module, std: float = 0.02) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("_norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        elif name.endswith(".bias") or name.endswith("e_score_correction_bias"):
            p.zero_()
        else:
            p.normal_(0.0, std)


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under transformers' names and layout (fused projections split, tied lm_head left out)."""
    sd = internal_to_hf(model, {k: v.detach() for k, v in model.state_dict().items()})
    if model.cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return {(k if k.startswith("lm_head") else f"model.{k}"): v for k, v in sd.items()}


def save_model(model: Transformer, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors in the HF layout (transformers loads it)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = {k: (v.to(dtype) if dtype else v).contiguous().cpu() for k, v in hf_state_dict(model).items()}
    atomic_write(path / "model.safetensors", lambda tmp: save_file(hf, str(tmp), metadata={"format": "pt"}))
    cfg = model.cfg.to_hf()
    cfg["torch_dtype"] = str(dtype or model.dtype).removeprefix("torch.")
    atomic_write(path / "config.json", json.dumps(cfg, indent=2) + "\n")
    return path


@torch.no_grad()
def transformers_twin(model: Transformer) -> torch.nn.Module:
    """transformers' own model of the same architecture with a copy of the weights, built on the model's device from
    memory: what `save_model` then `from_pretrained` gives, without writing every weight to disk and reading it back
    through the host (for a large model the round trip costs more than the benchmark it serves)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(**{k: v for k, v in model.cfg.to_hf().items() if k != "torch_dtype"})
    with torch.device(model.device):
        hf = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    # transformers keeps some weights stacked as the engine does (MoE experts as [E, ...] tensors): each of its
    # keys is taken from the checkpoint layout or, failing that, from the engine's own
    ours = {f"model.{k}": v.detach() for k, v in model.state_dict().items()} | hf_state_dict(model)
    if model.cfg.tie_word_embeddings:  # one tensor under both names, as transformers' state_dict lists it
        ours["lm_head.weight"] = ours["model.embed_tokens.weight"]
    want = hf.state_dict()
    wrong = [k for k, v in want.items() if k not in ours or ours[k].shape != v.shape]
    if wrong:
        raise EngineError(f"transformers' {type(hf).__name__} does not take this model's weights: "
                          f"{len(wrong)} tensors missing or of another shape, e.g. {wrong[0]}")
    hf.load_state_dict({k: ours[k] for k in want})
    return hf.eval()
