"""`runbook record`: every runbook of a profile re-recorded, dependencies first, in this process or through children
pinned to GPUs (run here on the CPU with pretend GPU ids), then docs refreshed once."""

import json
import re
from pathlib import Path

import pytest

from specbook import provenance, records
from specbook.record import Metric
from specbook.rerecord import jobs, record_all
from specbook_testing import baseline, cli, make_repo, runbook_text

LOG = Path("order.log")  # runbooks run with the repository root as working directory


def _logged(name: str, value: str = "1.0", kind: str = "exact") -> str:
    return runbook_text(body=f"""
        open("{LOG}", "a").write("{name}\\n")
        record("x", {value}, unit="u", direction="higher", kind="{kind}", rel_tol=0.0)
    """)


@pytest.fixture(autouse=True)
def cpu_machine(monkeypatch):
    monkeypatch.setattr(provenance, "detect_profile", lambda: "cpu")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """down depends on up; gpu_only declares no cpu profile; a doc claims down's number."""
    root = make_repo(tmp_path, up=_logged("up"),
                     down=_logged("down", "2.0").replace("title: T", "title: T\ndepends: [up]"),
                     gpu_only=runbook_text(profiles="{h200: {}}"))
    (root / "docs").mkdir()
    (root / "docs" / "p.md").write_text("down: <!-- claim: down/cpu/x fmt=.1f -->9.9<!-- /claim -->\n")
    return root


def test_jobs_put_dependencies_first_and_keep_timed_runbooks_alone(repo):
    run = {"id": records.new_run_id("2026-11-29T14:00:00Z"), "date": "2026-11-29T14:00:00Z", "source": "measured",
           "inputs_hash": "h", "parameters": {}, "provenance": {}}
    records.add_run(repo, "up", "cpu", run, [Metric("x", 1.0, "u", "higher", kind="exact")])
    got = jobs(repo, "cpu", ["down", "up"])
    assert [(j.name, sorted(j.after), j.exclusive) for j in got] == [("up", [], False), ("down", ["up/cpu"], True)]
    assert [j.name for j in jobs(repo, "cpu")] == ["down", "up"][::-1]  # every runbook declaring cpu, up first


def test_a_runbook_without_the_profile_is_refused_before_anything_runs(repo):
    r = cli(repo, "record", "gpu_only".replace("_", "-"), "up")
    assert r.exit_code == 3 and "cannot run on profile cpu" in r.stderr
    assert not (repo / LOG).exists()


def test_record_runs_in_order_records_each_once_and_refreshes_docs(repo):
    r = cli(repo, "record", "--json")
    assert r.exit_code == 0, r.stderr
    done = json.loads(r.stdout)
    assert [d["runbook"] for d in done] == ["up", "down"] and all(d["run_id"] for d in done)
    assert [m.group(1) for m in re.finditer(DONE.format(r"(\w+)"), r.stderr)] == ["up", "down"]
    assert (repo / LOG).read_text().split() == ["up", "down"]  # down found up recorded and did not run it again
    assert baseline(repo, "down")["profiles"]["cpu"]["metrics"]["x"]["run"] == done[1]["run_id"]
    assert "2.0<!-- /claim -->" in (repo / "docs" / "p.md").read_text()


DONE = r"done {}/cpu in \d+ s \(kernel start \d+ s, cells \d+ s\)"  # a run's wall time and where it went


def test_children_on_gpus_record_every_runbook(repo):
    lines: list[str] = []
    got = record_all(repo, jobs(repo, "cpu"), ["0", "1"], log=lines.append)
    assert sorted(r.runbook for r in got if r.run_id) == ["down", "up"]
    for name in ("up", "down"):  # each child's line, relayed with its GPU as it finished
        assert sum(bool(re.fullmatch(r"\[gpu \d\] " + DONE.format(name), line)) for line in lines) == 1, lines
    ids = {r.runbook: r.run_id for r in got}
    assert {n: baseline(repo, n)["profiles"]["cpu"]["metrics"]["x"]["run"] for n in ids} == ids
    assert (repo / LOG).read_text().split() == ["up", "down"]
    # the children leave docs/ to `record`, which brings it up to date once after all of them (below): a dependent
    # does not wait for its dependency's docs refresh
    assert "9.9<!-- /claim -->" in (repo / "docs" / "p.md").read_text()
    assert not any("updated docs" in line for line in lines)


def test_record_on_gpus_refreshes_docs_once_after_the_children(repo, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # pretend GPUs: the children run on the CPU
    r = cli(repo, "record", "--gpus", "0,1", "--json")
    assert r.exit_code == 0, r.stderr
    assert "2.0<!-- /claim -->" in (repo / "docs" / "p.md").read_text()
    assert r.stderr.count("updated docs/p.md") == 1


def test_a_failing_runbook_exits_3_and_the_others_are_recorded(repo):
    (repo / "runbooks" / "up.py").write_text(runbook_text(body='raise RuntimeError("broken on purpose")'))
    r = cli(repo, "record", "--json")
    assert r.exit_code == 3
    done = {d["runbook"]: d for d in json.loads(r.stdout)}
    assert done["up"]["run_id"] is None and "broken on purpose" in done["up"]["error"]
    assert done["down"]["run_id"] is None  # its dependency failed: it cannot run either
    assert not (repo / "baselines" / "up.yaml").exists()


def test_two_profiles_are_scheduled_together(tmp_path):
    root = make_repo(tmp_path, up=runbook_text(profiles="{cpu: {}, cpu.alt: {value: 2.0}}"))
    r = cli(root, "record", "--profile", "cpu", "--profile", "cpu.alt", "--json")
    assert r.exit_code == 0, r.stderr
    assert sorted(d["profile"] for d in json.loads(r.stdout)) == ["cpu", "cpu.alt"]
    assert {p: m["metrics"]["x"]["value"] for p, m in baseline(root, "up")["profiles"].items()} == \
        {"cpu": 1.0, "cpu.alt": 2.0}
