"""Shared by the docs tests: build the site of this repository and know which records it was built from."""
import os
import subprocess
import sys
from pathlib import Path

from specbook import records

ROOT = Path(__file__).resolve().parents[1]


def recorded_values(root: Path = ROOT) -> dict[str, float]:
    return {f"{rb}/{pf}/{m}": e["value"] for rb, rf in records.load_all(root).items()
            for pf, prof in rf.data["profiles"].items() for m, e in prof["metrics"].items()}


def build_site(out: Path) -> dict[str, float]:
    """`mkdocs build --strict` into `out`; returns the records read just before (others may record meanwhile)."""
    values = recorded_values()
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return values
