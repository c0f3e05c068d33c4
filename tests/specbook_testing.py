"""Helpers for the specbook tests: a throwaway repository with small runbooks (never the real baselines/)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import yaml
from click.testing import CliRunner

from specbook.cli import main


def runbook_text(title: str = "T", profiles: str = "{cpu: {}}", params: str = "value = 1.0",
                 body: str = 'record("x", value, unit="u", direction="higher", rel_tol=0.1)',
                 extra_header: str = "") -> str:
    """A percent-format runbook: YAML header, parameters cell, one cell that imports record, and `body`."""
    header = f"title: {title}\nprofiles: {profiles}\n{extra_header}".strip()
    return (
        "# %% [markdown]\n# # Runbook\n#\n# ```yaml\n"
        + "".join(f"# {line}\n" for line in header.splitlines())
        + "# ```\n\n# %% tags=[\"parameters\"]\n" + textwrap.dedent(params).strip() + "\n\n"
        + "# %%\nfrom specbook import record\n\n# %%\n" + textwrap.dedent(body).strip() + "\n"
    )


def make_repo(tmp: Path, **runbooks: str) -> Path:
    """A repository root with runbooks/<name>.py (underscores in names become dashes) and an empty baselines/."""
    (tmp / "runbooks").mkdir(parents=True)
    (tmp / "baselines").mkdir()
    (tmp / "pyproject.toml").write_text("[project]\nname = 'x'\n\n[tool.specbook]\nengine_package = 'engine'\n")
    for name, text in runbooks.items():
        write_runbook(tmp, name.replace("_", "-"), text)
    return tmp


def write_runbook(root: Path, name: str, text: str) -> None:
    (root / "runbooks" / f"{name}.py").write_text(text)


def cli(root: Path, *args: str):
    """Run `runbook --root ROOT ARGS...` in process; returns click's Result (exit_code, stdout, stderr)."""
    return CliRunner().invoke(main, ["--root", str(root), *args])


def baseline(root: Path, name: str) -> dict:
    return yaml.safe_load((root / "baselines" / f"{name}.yaml").read_text())
