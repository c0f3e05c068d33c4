"""Helpers for the corpus tests: small synthetic release archives (a wheel and an sdist) of generated Python files."""

from __future__ import annotations

import hashlib
import io
import random
import tarfile
import zipfile
from pathlib import Path

WORDS = "alpha beta gamma delta value index count total items result node parent child key data".split()


def fake_module(rng: random.Random, i: int) -> str:
    lines = [f'"""Module {i}."""', "import os", ""]
    for f in range(rng.randint(4, 8)):
        a, b = rng.sample(WORDS, 2)
        lines += [f"def {a}_{b}_{f}({a}, {b}=None):", f"    if {b} is None:", f"        {b} = len({a})",
                  f"    for {rng.choice(WORDS)} in range({b}):", f"        {a} = {a} + {rng.randint(0, 9)}",
                  f"    return {a}", ""]
    return "\n".join(lines) + "\n"


def write_wheel(path: Path, files: dict[str, str | bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def write_sdist(path: Path, files: dict[str, str | bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as t:
        for name, text in files.items():
            data = text.encode() if isinstance(text, str) else text
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def modules(prefix: str, n: int, seed: int) -> dict[str, str]:
    rng = random.Random(seed)
    return {f"{prefix}/m{i // 20}/f{i}.py": fake_module(rng, seed * 10_000 + i) for i in range(n)}


def make_archives(root: Path, n_classic: int = 160, n_typed: int = 160) -> tuple:
    """A wheel of the "classic" group and an sdist of the "typed" group, as scan()'s sources."""
    classic = write_wheel(root / "classic-1.0-py3-none-any.whl", modules("classic", n_classic, 1))
    typed = write_sdist(root / "typed-1.0.tar.gz", modules("typed-1.0/typed", n_typed, 2))
    return (("classic", (classic,)), ("typed", (typed,)))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_lock(path: Path, archives: list[tuple[str, Path]]) -> Path:
    """A corpus lock naming (group, archive) pairs with their real sha256."""
    rows = [f'[[archive]]\nname = "{a.name.split("-")[0]}"\nversion = "1.0"\nfilename = "{a.name}"\n'
            f'sha256 = "{sha256(a)}"\ngroup = "{g}"\n' for g, a in archives]
    path.write_text("\n".join(rows))
    return path
