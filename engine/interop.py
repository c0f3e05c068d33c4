"""Interop with the ecosystem's EAGLE-3 loaders: export a drafter to the `speculators` format (what vLLM serves).

SGLang and SpecForge read and write the research layout that `engine.drafter` saves and loads (config.json with
`architectures: ["LlamaForCausalLMEagle3"]`, keys `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`); vLLM's
library `speculators` converts that layout into its own (`speculators_model_type: eagle3`, `layers.0.*`), and
`export_speculators` runs its converter (optional extra `interop`) rather than re-writing the format here.

Feature-layer ids. Three conventions name the same three residual streams of the target:

| who | where | id i means | default for L layers |
|---|---|---|---|
| this engine | `Eagle3Drafter.aux_layers`, `Transformer.forward(hidden_layers=)` | the stream entering layer i (0 = embeddings) | (2, L//2, L-3) |
| vLLM, speculators | top-level `eagle_aux_hidden_state_layer_ids` of a speculators config | the same: vLLM captures hidden + residual before running layer i | [2, L//2, L-3] |
| SGLang, SpecForge | `eagle_config.eagle_aux_hidden_state_layer_ids` of a research-layout config | the layer whose output is taken: entering layer i+1 (SGLang's `set_eagle3_layers_to_capture` adds 1) | [1, L//2-1, L-4] |

The key has the same name in both configs and means different layers, so the export passes the entering-layer ids
to the converter explicitly (its own default would be vLLM's, which differs from ours on small targets) and writes
the convention next to them (`SPECBOOK_KEY`).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.drafter import Eagle3Config, aux_layers_from_ids, check_aux_layers, check_fits
from engine.errors import EngineError
from engine.loading import read_config, weight_files

INSTALL_HINT = ("the speculators package is not installed: pip install -e '.[interop]' && "
                "pip install --no-deps speculators==0.9.0")
SPECBOOK_KEY = "specbook_interop"  # a note in the exported config.json; speculators keeps unknown keys
CONVENTION = ("eagle_aux_hidden_state_layer_ids (top level, vLLM / speculators) are entering-layer ids: id i is the "
              "residual stream entering target layer i (0 = embeddings), as vLLM captures it. SGLang and SpecForge "
              "write the same streams in eagle_config.eagle_aux_hidden_state_layer_ids as i - 1 (the layer whose "
              "output is taken).")


def feature_layers(drafter_dir: str | Path, target_dir: str | Path) -> tuple[int, ...]:
    """The drafter's three feature layers as entering-layer ids, checked against the target's config."""
    cfg = read_config(drafter_dir, Eagle3Config)
    target_cfg = read_config(target_dir)
    check_fits(cfg, target_cfg, has_embedding="embed_tokens.weight" in _weight_names(Path(drafter_dir)))
    aux = aux_layers_from_ids(cfg.aux_layer_ids) if cfg.aux_layer_ids else target_cfg.default_aux_layers()
    check_aux_layers(aux, target_cfg)
    if len(set(aux)) != len(aux):  # speculators refuses repeated ids
        raise EngineError(f"drafter feature layers {list(aux)} repeat a layer; speculators needs 3 distinct layers")
    return aux


def export_speculators(drafter_dir: str | Path, target_dir: str | Path, out_dir: str | Path,
                       verifier_name: str | None = None, include_embedding: bool = False) -> Path:
    """Convert a drafter directory (engine.drafter.save_drafter's layout) for `target_dir` into a speculators
    checkpoint in `out_dir` (must not exist or be empty), with speculators' own EAGLE-3 converter.

    `verifier_name` (e.g. a hub id) is recorded as the verifier instead of `target_dir`: speculators and vLLM read
    the verifier's config, and vLLM shares the target's embedding with a drafter that has none. `include_embedding`
    copies the target's embed_tokens into the checkpoint (a drafter that owns one always carries it): speculators
    0.9.0's `Eagle3DraftModel.from_pretrained` needs it, since it leaves a missing embed_tokens uninitialised
    instead of reading the verifier's (its NaN placeholder is lost to transformers' meta-device loading)."""
    drafter_dir, target_dir, out = Path(drafter_dir), Path(target_dir), Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise EngineError(f"export directory {out} already exists and is not empty")
    if not (drafter_dir / "model.safetensors").is_file():  # speculators' converter reads exactly this file
        raise EngineError(f"drafter {drafter_dir} has no model.safetensors (sharded drafters are not converted)")
    aux = feature_layers(drafter_dir, target_dir)
    convert_model = _speculators_converter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # nothing half-written at `out`
    try:
        source = drafter_dir
        if include_embedding and "embed_tokens.weight" not in _weight_names(drafter_dir):
            source = _with_target_embedding(drafter_dir, target_dir, tmp / "source")
        convert_model(model=str(source), verifier=str(target_dir.resolve()), algorithm="eagle3",
                      output_path=str(tmp / "converted"), eagle_aux_hidden_state_layer_ids=list(aux))
        _annotate(tmp / "converted" / "config.json", aux, verifier_name)
        if out.exists():
            out.rmdir()
        (tmp / "converted").replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _speculators_converter():
    try:
        from loguru import logger
        from speculators.convert import convert_model
    except ImportError:
        raise EngineError(INSTALL_HINT) from None
    logger.disable("speculators")  # its converter logs every renamed key
    return convert_model


def _annotate(config_path: Path, aux: tuple[int, ...], verifier_name: str | None) -> None:
    cfg: dict[str, Any] = json.loads(config_path.read_text())
    if cfg.get("eagle_aux_hidden_state_layer_ids") != list(aux):  # the converter must have taken our ids
        raise EngineError(f"speculators wrote feature layers {cfg.get('eagle_aux_hidden_state_layer_ids')}, "
                          f"expected {list(aux)}")
    cfg[SPECBOOK_KEY] = {"aux_layer_convention": CONVENTION,
                         "sglang_eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]}
    if verifier_name:
        cfg["speculators_config"]["verifier"]["name_or_path"] = verifier_name
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _with_target_embedding(drafter_dir: Path, target_dir: Path, dst: Path) -> Path:
    """A copy of the drafter (research layout) with the target's embedding table added as embed_tokens.weight."""
    table = None
    for f in weight_files(target_dir):
        with safe_open(str(f), framework="pt") as h:
            for key in ("model.embed_tokens.weight", "embed_tokens.weight"):
                if key in h.keys():
                    table = h.get_tensor(key)
    if table is None:
        raise EngineError(f"target {target_dir} has no model.embed_tokens.weight to copy into the drafter")
    weights = load_file(str(drafter_dir / "model.safetensors"))
    dtype = weights["fc.weight"].dtype if "fc.weight" in weights else table.dtype
    dst.mkdir(parents=True)
    shutil.copy(drafter_dir / "config.json", dst / "config.json")
    save_file({**weights, "embed_tokens.weight": table.to(dtype)}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def _weight_names(path: Path) -> set[str]:
    names: set[str] = set()
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as h:
            names.update(k.removeprefix("model.") for k in h.keys())
    return names
