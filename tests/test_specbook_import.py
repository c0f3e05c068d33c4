"""`runbook import`: records made on another machine come in profile by profile, only as a fast-forward."""

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest
import yaml

from specbook import records
from specbook.record import Metric
from specbook_testing import baseline, cli, make_repo, runbook_text


def _run(i: int, commit: str = "c0ffee0") -> dict:
    date = f"2026-12-07T01:{i // 60:02d}:{i % 60:02d}Z"
    return {"id": records.new_run_id(date), "date": date, "source": "measured", "inputs_hash": "h",
            "parameters": {"i": i}, "provenance": {"git_commit": commit}}


def _add(root: Path, profile: str, i: int, value: float, name: str = "a") -> str:
    run = _run(i)
    records.add_run(root, name, profile, run, [Metric("x", value, "tok/s", "higher", 0.1)])
    return run["id"]


@pytest.fixture
def here(tmp_path: Path) -> Path:
    root = make_repo(tmp_path / "here", a=runbook_text(profiles="{cpu: {}, h200: {}}"))
    (root / "docs").mkdir()  # where `runbook site` writes status.md and the agents' files
    _add(root, "cpu", 1, 1.0)
    _add(root, "h200", 2, 100.0)
    return root


def _machine(here: Path, tmp_path: Path) -> Path:
    """A copy of the tree, as a lent machine gets it."""
    there = tmp_path / "there"
    shutil.copytree(here, there)
    return there


def _pack(tree: Path, out: Path, notebooks: dict[str, bytes] | None = None, extra: dict[str, bytes] | None = None) \
        -> Path:
    """A results.tgz as scripts/gpu-runbooks.sh packs it: baselines/ and docs/runbooks/executed/ (and `extra`)."""
    with tarfile.open(out, "w:gz") as tar:
        for p in sorted((tree / "baselines").glob("*.yaml")):
            tar.add(p, arcname=f"baselines/{p.name}")
        for name, data in {**(notebooks or {}), **(extra or {})}.items():
            info = tarfile.TarInfo(name if "/" in name else f"docs/runbooks/executed/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def test_new_runs_of_a_profile_come_in_and_the_other_profiles_stay(here, tmp_path):
    there = _machine(here, tmp_path)
    new = _add(there, "h200", 3, 120.0)
    _add(there, "cpu", 4, 9.0)  # the lent machine's copy of cpu: older than what this tree records meanwhile
    _add(here, "cpu", 5, 2.0)  # recorded here after the tree was sent
    archive = _pack(there, tmp_path / "results.tgz", {"a-h200.ipynb": b'{"cells": []}'})
    r = cli(here, "import", str(archive), "--json")
    assert r.exit_code == 1, r.output  # cpu diverged: this tree holds a run the archive lacks
    rows = {s["profile"]: s for s in json.loads(r.stdout)}
    assert rows["h200"]["state"] == "imported" and rows["h200"]["added"] == [new]
    assert rows["cpu"]["state"] == "diverged"
    data = baseline(here, "a")
    assert data["profiles"]["h200"]["metrics"]["x"]["value"] == 120.0
    assert [h["value"] for h in data["profiles"]["h200"]["metrics"]["x"]["history"]] == [100.0, 120.0]
    assert data["profiles"]["cpu"]["metrics"]["x"]["value"] == 2.0  # not replaced by the archive's 9.0
    assert (here / "docs/runbooks/executed/a-h200.ipynb").read_bytes() == b'{"cells": []}'


def test_an_older_archive_replaces_nothing_and_a_second_import_is_a_no_op(here, tmp_path):
    there = _machine(here, tmp_path)
    old = _pack(there, tmp_path / "old.tgz")
    _add(there, "h200", 3, 120.0)
    archive = _pack(there, tmp_path / "results.tgz")
    assert cli(here, "import", str(archive)).exit_code == 0
    after = (here / "baselines/a.yaml").read_bytes()
    again = cli(here, "import", str(archive))
    assert again.exit_code == 0 and "nothing new" in again.stdout
    older = cli(here, "import", str(old), "--json")
    assert older.exit_code == 0
    assert {s["profile"]: s["state"] for s in json.loads(older.stdout)} == {"cpu": "same", "h200": "older"}
    assert (here / "baselines/a.yaml").read_bytes() == after


def test_profile_filter_and_dry_run_write_nothing_they_leave_out(here, tmp_path):
    there = _machine(here, tmp_path)
    _add(there, "h200", 3, 120.0)
    _add(there, "cpu", 4, 3.0)
    archive = _pack(there, tmp_path / "results.tgz")
    before = (here / "baselines/a.yaml").read_bytes()
    dry = cli(here, "import", str(archive), "--dry-run")
    assert dry.exit_code == 0 and "imported (dry run)" in dry.stdout
    assert (here / "baselines/a.yaml").read_bytes() == before
    assert cli(here, "import", str(archive), "--profile", "h200").exit_code == 0
    data = baseline(here, "a")
    assert data["profiles"]["h200"]["metrics"]["x"]["value"] == 120.0
    assert data["profiles"]["cpu"]["metrics"]["x"]["value"] == 1.0


def test_a_new_runbook_and_a_new_profile_come_in_whole(here, tmp_path):
    there = _machine(here, tmp_path)
    (there / "runbooks/b.py").write_text(runbook_text(profiles="{cpu: {}, h200: {}}"))
    (here / "runbooks/b.py").write_text(runbook_text(profiles="{cpu: {}, h200: {}}"))
    _add(there, "h200", 3, 7.0, name="b")
    archive = _pack(there, tmp_path / "results.tgz")
    assert cli(here, "import", str(archive)).exit_code == 0
    assert baseline(here, "b")["profiles"]["h200"]["metrics"]["x"]["value"] == 7.0


@pytest.mark.parametrize("content, message", [
    (b"not a tar", "not a readable tar archive"),
    (None, "no record files"),
])
def test_bad_archives_are_one_line_errors_with_exit_2(here, tmp_path, content, message):
    path = tmp_path / "bad.tgz"
    if content is None:
        with tarfile.open(path, "w:gz"):
            pass
    else:
        path.write_bytes(content)
    before = (here / "baselines/a.yaml").read_bytes()
    r = cli(here, "import", str(path))
    assert r.exit_code == 2 and message in r.stderr and r.stderr.count("\n") == 1
    assert (here / "baselines/a.yaml").read_bytes() == before


def test_a_malformed_record_in_the_archive_is_refused_before_anything_is_written(here, tmp_path):
    there = _machine(here, tmp_path)
    _add(there, "h200", 3, 120.0)
    (there / "runbooks/b.py").write_text(runbook_text())
    (there / "baselines/b.yaml").write_text(yaml.safe_dump({"runbook": "b", "profiles": {"cpu": {"runs": "x"}}}))
    archive = _pack(there, tmp_path / "results.tgz")
    before = (here / "baselines/a.yaml").read_bytes()
    r = cli(here, "import", str(archive))
    assert r.exit_code == 2 and "b.yaml" in r.stderr
    assert (here / "baselines/a.yaml").read_bytes() == before


def test_members_outside_the_two_places_are_never_written(here, tmp_path):
    there = _machine(here, tmp_path)
    _add(there, "h200", 3, 120.0)
    archive = _pack(there, tmp_path / "results.tgz", extra={"../escape.ipynb": b"x", "logs/gpu0.log": b"x",
                                                            "docs/runbooks/executed/../../evil.ipynb": b"x"})
    assert cli(here, "import", str(archive)).exit_code == 0
    assert not (here.parent / "escape.ipynb").exists() and not (here / "evil.ipynb").exists()
    assert not (here / "logs").exists()


def test_an_unknown_profile_is_refused(here, tmp_path):
    archive = _pack(_machine(here, tmp_path), tmp_path / "results.tgz")
    r = cli(here, "import", str(archive), "--profile", "h900")
    assert r.exit_code == 2


def test_records_of_a_runbook_this_tree_lacks_are_refused(here, tmp_path):
    there = _machine(here, tmp_path)
    (there / "runbooks/b.py").write_text(runbook_text(profiles="{cpu: {}, h200: {}}"))
    _add(there, "h200", 3, 7.0, name="b")
    _add(there, "h200", 4, 120.0)
    r = cli(here, "import", str(_pack(there, tmp_path / "results.tgz")))
    assert r.exit_code == 2 and "does not have: b" in r.stderr
    assert baseline(here, "a")["profiles"]["h200"]["metrics"]["x"]["value"] == 100.0
    assert not (here / "baselines/b.yaml").exists()
