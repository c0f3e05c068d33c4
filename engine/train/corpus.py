"""The training corpus: Python source already on this machine - the standard library and installed packages.

Files are read where they lie (never copied into the repository), deduplicated by content hash and split into
train / validation / test by that hash, so the split of a file never depends on which other files exist.

Two mixes stand in for the game plan's two targets: mix A (stdlib-heavy) trains target "A" (Kimi-K2), mix B
(mostly installed packages) trains target "B" (Kimi-K2.5) further from A. The held-out prompts for accept-length
evaluation are windows of test files.
"""
from __future__ import annotations

import functools
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError

MIN_FILE_BYTES = 256  # empty __init__.py files and stubs teach nothing
MAX_FILE_BYTES = 512 * 1024  # beyond this: generated tables and vendored blobs
SPLITS = {"train": (0, 90), "validation": (90, 95), "test": (95, 100)}  # percent ranges of the hash


@dataclass(frozen=True)
class SourceFile:
    path: Path
    group: str  # "stdlib" | "packages"
    size: int
    digest: str  # blake2b of the content, hex

    @property
    def split(self) -> str:
        bucket = int(self.digest[:8], 16) % 100
        return next(name for name, (lo, hi) in SPLITS.items() if lo <= bucket < hi)

    def text(self) -> str | None:
        try:
            return self.path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            return None


@dataclass(frozen=True)
class Mix:
    name: str
    weights: dict[str, float]  # group -> share of the bytes
    description: str


MIXES = {
    "A": Mix("A", {"stdlib": 0.5, "packages": 0.5}, "stdlib-heavy: stands for Kimi-K2's training data"),
    "B": Mix("B", {"stdlib": 0.1, "packages": 0.9}, "shifted to installed packages: Kimi-K2.5's further training"),
}


def get_mix(name: str) -> Mix:
    if name not in MIXES:
        raise EngineError(f"unknown corpus mix {name!r}; known: {', '.join(MIXES)}")
    return MIXES[name]


def source_roots() -> dict[str, list[Path]]:
    paths = sysconfig.get_paths()
    packages = sorted({Path(paths["purelib"]), Path(paths["platlib"])})
    return {"stdlib": [Path(paths["stdlib"])], "packages": packages}


def _walk(root: Path, skip: tuple[Path, ...]) -> list[Path]:
    out = []
    for p in sorted(root.rglob("*.py")):
        if any(p.is_relative_to(s) for s in skip) or "site-packages" in p.relative_to(root).parts[:-1]:
            continue
        if p.name.startswith("__editable__"):  # pip's finder for an editable install names the checkout's path
            continue
        out.append(p)
    return out


@functools.lru_cache(maxsize=4)
def scan(roots: tuple[tuple[str, tuple[Path, ...]], ...] | None = None) -> tuple[SourceFile, ...]:
    """All usable files, deduplicated by content (the first path in sorted order wins), sorted by digest.

    roots: ((group, (dir, ...)), ...); default: this interpreter's stdlib and package directories."""
    groups = roots or tuple((g, tuple(ds)) for g, ds in source_roots().items())
    package_dirs = tuple(d for g, ds in groups if g != "stdlib" for d in ds)
    seen: dict[str, SourceFile] = {}
    for group, dirs in groups:
        for d in dirs:
            # the stdlib directory may contain the base interpreter's site-packages: those are not stdlib
            for p in _walk(d, tuple(x for x in package_dirs if x != d)):
                try:
                    size = p.stat().st_size
                    if not MIN_FILE_BYTES <= size <= MAX_FILE_BYTES:
                        continue
                    digest = hashlib.blake2b(p.read_bytes(), digest_size=16).hexdigest()
                except OSError:
                    continue
                seen.setdefault(digest, SourceFile(p, group, size, digest))
    return tuple(sorted(seen.values(), key=lambda f: f.digest))


def manifest_hash(files: tuple[SourceFile, ...] | None = None) -> str:
    """Fingerprint of the corpus (groups, sizes, content hashes): provenance's `corpus` input. Paths are left out:
    the same packages in a venv at another place are the same training data."""
    files = scan() if files is None else files
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.group}\0{f.size}\0{f.digest}\n".encode())
    return h.hexdigest()[:16]


def select(mix: str, split: str, max_bytes: int, files: tuple[SourceFile, ...] | None = None) -> list[SourceFile]:
    """Files of one split for a mix: each group fills its share of the bytes in digest order (deterministic). When a
    group has fewer bytes than its share of max_bytes, the total shrinks so that the shares still hold."""
    if split not in SPLITS:
        raise EngineError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    m = get_mix(mix)
    files = scan() if files is None else files
    if not files:
        raise EngineError("empty corpus: no Python source files found in the standard library or site-packages")
    have = {g: sum(f.size for f in files if f.group == g and f.split == split) for g in m.weights}
    total = min([max_bytes] + [have[g] / share for g, share in m.weights.items() if share > 0])
    chosen: list[SourceFile] = []
    for group, share in m.weights.items():
        budget = share * total
        for f in files:
            if budget <= 0:
                break
            if f.group == group and f.split == split:
                chosen.append(f)
                budget -= f.size
    if not chosen:
        raise EngineError(f"empty corpus: no {split} files for mix {mix} (groups {', '.join(m.weights)})")
    return chosen


def texts(mix: str, split: str, max_bytes: int, files: tuple[SourceFile, ...] | None = None) -> list[str]:
    return [t for f in select(mix, split, max_bytes, files) if (t := f.text()) is not None]


def prompts(n: int, chars: int = 600, mix: str = "A", files: tuple[SourceFile, ...] | None = None) -> list[str]:
    """Held-out prompts: n windows of test files, each starting at a line boundary a third into the file
    (file heads are mostly license boilerplate) and cut at a line end near `chars` characters."""
    out = []
    for t in texts(mix, "test", 10**12, files):
        if len(t) < 2 * chars:
            continue
        start = t.index("\n", len(t) // 3) + 1
        window = t[start:start + chars]
        cut = window.rfind("\n")
        if cut > chars // 2:
            out.append(window[:cut + 1])
        if len(out) == n:
            return out
    raise EngineError(f"only {len(out)} held-out prompts of {chars} characters in mix {mix}'s test split, {n} asked")


def stats(files: tuple[SourceFile, ...] | None = None) -> dict[str, dict[str, int]]:
    """Files and bytes per group and split, for `train corpus`."""
    files = scan() if files is None else files
    out: dict[str, dict[str, int]] = {}
    for f in files:
        row = out.setdefault(f"{f.group}/{f.split}", {"files": 0, "bytes": 0})
        row["files"] += 1
        row["bytes"] += f.size
    return dict(sorted(out.items()))
