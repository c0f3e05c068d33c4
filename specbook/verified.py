"""The last verify's verdict per number, committed: baselines/verified/verdicts.yaml.

A record says what a run measured and `status` whether its inputs changed since; neither says whether anybody
re-measured the number since, where, and with what verdict. `runbook verify --save` writes that here, one entry per
number it re-measured (its state, when, on what machine and profile, at which commit, whether the tree had
uncommitted changes, and the record run it was judged against), keeping the entries of numbers it did not
re-measure. The file is apart from the records so that a verify never rewrites a record; the status page shows it
as "last verified". Entries of numbers no longer recorded are dropped at the next save.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from specbook import SpecbookError, provenance, records
from specbook.fsutil import atomic_write
from specbook.verify import FAILED

PATH = Path(records.BASELINES) / "verified" / "verdicts.yaml"  # in a folder: baselines/*.yaml are record files
HEADER = ("# Written by `runbook verify --save`: the last verdict of each re-measured number (docs/runbooks/index.md)."
          "\n# Data, not a document: a save rewrites the file.\n")


def load(root: Path) -> dict[str, dict[str, Any]]:
    """Entries by key (runbook/profile/metric); none when the file is missing."""
    path = Path(root) / PATH
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise SpecbookError(f"{PATH}: malformed YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise SpecbookError(f"{PATH}: expected a mapping of runbook/profile/metric to its last verdict")
    return data


def save(root: Path, verdicts: list, date: str | None = None) -> list[str]:
    """Merge the verdicts of the numbers this verify re-measured (or tried to) into the file; returns their keys."""
    root = Path(root)
    commit, dirty = provenance._git_state(root)
    machine = provenance.machine()
    where = ", ".join(machine["gpu"]["names"]) or machine["cpu"]["model"]
    entries = load(root)
    saved = []
    for v in verdicts:
        if not v.here or (v.measured is None and v.state != FAILED):
            continue  # not re-measured here: its record's state is status's, not a verify's
        entries[v.key] = {"state": v.state, "date": date or provenance.now_iso(), "profile": v.profile,
                          "machine": where, "commit": (commit or "")[:10], "dirty": dirty,
                          "measured": v.measured, "record_run": _record_run(root, v)}
        saved.append(v.key)
    recorded = _recorded_keys(root)
    entries = {k: entries[k] for k in sorted(entries) if k in recorded}
    (root / PATH).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(root / PATH, (HEADER + yaml.safe_dump(entries, sort_keys=False, width=120)).encode())
    return saved


def _record_run(root: Path, v) -> str | None:
    """The record run a verdict was judged against: a later record makes the verdict one of the record before."""
    try:
        prof = records.load(records.path_for(root, v.runbook)).data["profiles"].get(v.profile, {})
    except SpecbookError:
        return None
    return (prof.get("metrics", {}).get(v.metric) or {}).get("run")


def _recorded_keys(root: Path) -> set[str]:
    return {f"{name}/{p}/{m}" for name, rf in records.load_all(root, skip_broken=True).items()
            for p, prof in rf.data["profiles"].items() for m in prof["metrics"]}


def describe(entry: dict[str, Any] | None, record_run: str | None) -> str:
    """An entry in one cell: `fresh 2026-12-05, cpu on AMD EPYC, commit 1a2b3c4d5e` (and when it judged an older
    record or a tree with changes); `-` when never verified."""
    if not entry:
        return "-"
    text = (f"{entry.get('state')} {str(entry.get('date', ''))[:10]}, {entry.get('profile')} on "
            f"{entry.get('machine')}, commit `{entry.get('commit') or '-'}`")
    if entry.get("dirty"):
        text += " with changes"
    if record_run and entry.get("record_run") and entry["record_run"] != record_run:
        text += " (of the record before)"
    return text
