"""SpecForge's offline feature dump, read back: per-layer similarity of two targets' hidden states, and nested subsets.

`scripts/prepare_hidden_states.py` (engine.backends.specforge.CaptureRun) writes one file per sample,
`rows_{g}-{g+2000}/data_{i}.ckpt` (or `.ckpt.gz`), a torch dict with `input_ids` [T], `loss_mask` [T],
`aux_hidden_state` [1, T, 3H] (the drafter's three feature layers, concatenated in the order of its
eagle_aux_hidden_state_layer_ids) and `hidden_state` [1, T, H] (the last layer's output).
"""
from __future__ import annotations

import gzip
import io
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import EngineError

SUFFIXES = (".ckpt", ".ckpt.gz")


def feature_files(root: str | Path) -> list[Path]:
    """The dump's files, sorted by path (SpecForge's reader orders them the same way)."""
    root = Path(root)
    if not root.is_dir():
        raise EngineError(f"{root}: no such feature directory")
    return sorted(Path(d) / n for d, _, names in os.walk(root, followlinks=True) for n in names
                  if n.endswith(SUFFIXES))


def load_record(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                rec = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
        else:
            rec = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, EOFError, gzip.BadGzipFile) as e:
        raise EngineError(f"{path}: unreadable feature file ({type(e).__name__}: {e})") from None
    missing = [k for k in ("input_ids", "aux_hidden_state", "hidden_state") if k not in rec]
    if missing:
        raise EngineError(f"{path}: not an EAGLE-3 feature file (missing {', '.join(missing)})")
    return rec


@dataclass
class Similarity:
    """Mean cosine similarity over every token of every sample, per captured layer."""

    aux: list[float]  # the drafter's feature layers, in its config's order
    last: float  # the last layer's output
    samples: int
    tokens: int

    @property
    def aux_mean(self) -> float:
        return sum(self.aux) / len(self.aux)

    @property
    def min(self) -> float:
        return min(*self.aux, self.last)


def similarity(dir_a: str | Path, dir_b: str | Path, n_aux: int = 3) -> Similarity:
    """Compare two dumps of the same samples (same data, same drafter config) taken from two targets."""
    files_a, files_b = feature_files(dir_a), feature_files(dir_b)
    rel_a = [p.relative_to(dir_a) for p in files_a]
    rel_b = [p.relative_to(dir_b) for p in files_b]
    if not rel_a:
        raise EngineError(f"{dir_a}: no feature files ({' or '.join(SUFFIXES)})")
    if rel_a != rel_b:
        only = sorted(set(map(str, rel_a)) ^ set(map(str, rel_b)))[:3]
        raise EngineError(f"{dir_a} and {dir_b} hold different samples (e.g. {', '.join(only)}): capture both "
                          f"from the same data with the same settings")
    sums = torch.zeros(n_aux + 1, dtype=torch.float64)
    tokens = 0
    for rel, fa, fb in zip(rel_a, files_a, files_b):
        a, b = load_record(fa), load_record(fb)
        if not torch.equal(a["input_ids"], b["input_ids"]):
            raise EngineError(f"{rel}: the two dumps tokenized the sample differently; the targets must share a "
                              f"tokenizer for a token-by-token comparison")
        layers_a, layers_b = _layers(a, n_aux, fa), _layers(b, n_aux, fb)
        if layers_a.shape != layers_b.shape:
            raise EngineError(f"{rel}: hidden sizes differ ({tuple(layers_a.shape)} vs {tuple(layers_b.shape)})")
        sums += torch.nn.functional.cosine_similarity(layers_a, layers_b, dim=-1).double().sum(0)
        tokens += layers_a.shape[0]
    cos = (sums / tokens).tolist()
    return Similarity(aux=cos[:n_aux], last=cos[n_aux], samples=len(rel_a), tokens=tokens)


def _layers(rec: dict[str, torch.Tensor], n_aux: int, where: Path) -> torch.Tensor:
    """[T, n_aux + 1, H] float32: the feature layers, then the last hidden state."""
    aux, last = rec["aux_hidden_state"].float(), rec["hidden_state"].float()
    aux, last = aux.reshape(-1, aux.shape[-1]), last.reshape(-1, last.shape[-1])
    H = last.shape[-1]
    if aux.shape != (last.shape[0], n_aux * H):
        raise EngineError(f"{where}: aux_hidden_state has shape {tuple(aux.shape)}, expected "
                          f"({last.shape[0]}, {n_aux} x {H})")
    return torch.cat([aux.view(-1, n_aux, H), last.unsqueeze(1)], dim=1)


def subset(src: str | Path, dst: str | Path, n: int) -> Path:
    """A dump of the first `n` samples of `src` (in SpecForge's order), as links: nested for growing n, no copies."""
    src, dst = Path(src).resolve(), Path(dst)
    files = feature_files(src)
    if n < 1 or n > len(files):
        raise EngineError(f"{src} holds {len(files)} samples; cannot take {n}")
    if dst.exists():
        if len(feature_files(dst)) == n:
            return dst  # made by an earlier, interrupted run of the same sweep
        raise EngineError(f"{dst} exists and does not hold {n} samples; remove it")
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted call
    for f in files[:n]:
        link = tmp / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(f)
    tmp.rename(dst)
    return dst
