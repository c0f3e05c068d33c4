"""baselines/*.yaml: schema, malformed files, and nothing lost (atomic replace, lock, hand edits, SIGKILL)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from click.testing import CliRunner

from specbook import SpecbookError, records
from specbook.cli import main
from specbook.record import Metric, make_metric, read_metrics, record
from specbook_testing import make_repo


def _run(i: int, source: str = "measured") -> dict:
    date = f"2026-11-29T14:{i // 60:02d}:{i % 60:02d}Z"
    return {"id": records.new_run_id(date), "date": date, "source": source, "inputs_hash": "h",
            "parameters": {"i": i}, "provenance": {"git_commit": "c0ffee0"}}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_repo(tmp_path)


def test_add_run_appends_runs_and_history(root):
    records.add_run(root, "b", "cpu", _run(1), [Metric("x", 1.0, "ms", "lower", 0.1, 0.0, [1.0, 1.1])])
    run2 = _run(2)
    records.add_run(root, "b", "cpu", run2, [Metric("x", 2.0, "ms", "lower", 0.1, 0.0)])
    data = yaml.safe_load((root / "baselines" / "b.yaml").read_text())
    prof = data["profiles"]["cpu"]
    assert [r["parameters"]["i"] for r in prof["runs"]] == [1, 2]
    x = prof["metrics"]["x"]
    assert (x["value"], x["run"], x["tolerance"]) == (2.0, run2["id"], {"rel": 0.1, "abs": 0.0})
    assert [h["value"] for h in x["history"]] == [1.0, 2.0] and "samples" not in x


def test_loading_again_sees_the_file_as_it_is_now_and_nothing_a_caller_changed(root):
    records.add_run(root, "b", "cpu", _run(1), [Metric("x", 1.0, "ms", "lower", 0.1, 0.0)])
    path = records.path_for(root, "b")
    first = records.load(path)
    first.data["profiles"]["cpu"]["metrics"]["x"]["value"] = 99.0  # a caller's change to its copy
    assert records.load(path).data["profiles"]["cpu"]["metrics"]["x"]["value"] == 1.0
    path.write_text(path.read_text().replace("value: 1.0", "value: 7.0"))  # the same size, at once
    again = records.load(path)
    assert again.data["profiles"]["cpu"]["metrics"]["x"]["value"] == 7.0 and again.digest != first.digest


def test_malformed_yaml_names_file_and_line(root):
    (root / "baselines" / "b.yaml").write_text("runbook: b\nprofiles:\n  cpu: {}\n  h200: a: b\n")
    with pytest.raises(SpecbookError, match=r"b\.yaml:4: malformed YAML: mapping values are not allowed"):
        records.load(root / "baselines" / "b.yaml")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(extra=1), "exactly the keys runbook and profiles"),
    (lambda d: d.update(runbook="other"), "file is named for 'b'"),
    (lambda d: d["profiles"]["cpu"]["metrics"]["x"].update(direction="up"), "direction must be one of"),
    (lambda d: d["profiles"]["cpu"]["metrics"]["x"].update(value="fast"), "needs a numeric value"),
    (lambda d: d["profiles"]["cpu"]["metrics"]["x"].update(run="nope"), "not among this profile's runs"),
    (lambda d: d["profiles"]["cpu"]["metrics"]["x"].update(tolerance={"rel": -1}), "tolerance must be"),
    (lambda d: d["profiles"]["cpu"]["runs"][0].update(source="guessed"), "source must be one of"),
    (lambda d: d["profiles"]["cpu"]["runs"][0].pop("inputs_hash"), "a measured run needs inputs_hash"),
    (lambda d: d["profiles"]["cpu"]["runs"][0].update(date="yesterday"), "'yesterday' is not an ISO date"),
    (lambda d: d["profiles"]["cpu"]["runs"][0].pop("date"), "None is not an ISO date"),
    (lambda d: d["profiles"]["cpu"]["runs"][0].update(seconds=-3), "seconds must be a number of seconds"),
    (lambda d: d["profiles"]["cpu"]["runs"][0].update(seconds="long"), "seconds must be a number of seconds"),
])
def test_schema_errors_are_one_line(root, edit, message):
    records.add_run(root, "b", "cpu", _run(1), [Metric("x", 1.0, "ms", "lower")])
    path = root / "baselines" / "b.yaml"
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecbookError, match=message) as e:
        records.load(path)
    assert "\n" not in str(e.value) and "b.yaml" in str(e.value)


def test_reported_runs_need_no_inputs(root):
    path = root / "baselines" / "k.yaml"
    path.write_text(textwrap.dedent("""\
        runbook: k
        profiles:
          8x-rtx-pro-6000:
            runs:
              - {id: r1, date: 2026-11-01T10:00:00Z, source: reported, provenance: {reported_by: game plan}}
            metrics:
              tok_s: {value: 82.5, unit: tok/s, direction: higher, tolerance: {rel: 0.05}, run: r1}
        """))
    assert records.load(path).data["profiles"]["8x-rtx-pro-6000"]["metrics"]["tok_s"]["value"] == 82.5


def test_hand_edit_between_read_and_write_is_not_overwritten(root):
    records.add_run(root, "b", "cpu", _run(1), [Metric("x", 1.0, "ms", "lower")])
    path = root / "baselines" / "b.yaml"
    rf = records.load(path)
    rf.data["profiles"]["cpu"]["metrics"]["x"]["value"] = 5.0
    edited = path.read_text().replace("value: 1.0", "value: 1.5", 1)
    path.write_text(edited)  # someone's editor saves in between
    with pytest.raises(SpecbookError, match="changed since it was read"):
        records.save(rf)
    assert path.read_text() == edited


def test_hand_edit_inside_add_run_is_not_overwritten(root, monkeypatch):
    records.add_run(root, "b", "cpu", _run(1), [Metric("x", 1.0, "ms", "lower")])
    path = root / "baselines" / "b.yaml"
    edited = path.read_text().replace("value: 1.0", "value: 1.5", 1)
    real_load = records.load

    def load_then_edit(p):
        rf = real_load(p)
        p.write_text(edited)  # the hand edit lands after the read, before the replace
        return rf

    monkeypatch.setattr(records, "load", load_then_edit)
    with pytest.raises(SpecbookError, match="not overwritten"):
        records.add_run(root, "b", "cpu", _run(2), [Metric("x", 2.0, "ms", "lower")])
    assert path.read_text() == edited


def test_hand_edit_before_a_run_is_kept(root):
    records.add_run(root, "b", "cpu", _run(1), [Metric("x", 1.0, "ms", "lower")])
    records.add_run(root, "b", "gpu", _run(2), [Metric("x", 5.0, "ms", "lower")])
    path = root / "baselines" / "b.yaml"
    path.write_text(path.read_text().replace("tolerance: {rel: 0.0, abs: 0.0}", "tolerance: {rel: 0.3, abs: 0.0}"))
    records.add_run(root, "b", "cpu", _run(3), [Metric("x", 2.0, "ms", "lower")])
    profiles = yaml.safe_load(path.read_text())["profiles"]
    assert profiles["gpu"]["metrics"]["x"]["tolerance"]["rel"] == 0.3 and profiles["cpu"]["metrics"]["x"]["value"] == 2.0


def test_a_run_drops_what_it_no_longer_records_in_its_profile_only(root):
    records.add_run(root, "b", "cpu", _run(1), [Metric("x", 1.0, "ms", "lower"), Metric("old", 3.0, "ms", "lower")])
    records.add_run(root, "b", "gpu", _run(2), [Metric("old", 4.0, "ms", "lower")])
    assert records.add_run(root, "b", "cpu", _run(3), [Metric("x", 2.0, "ms", "lower")]) == ["old"]
    profiles = yaml.safe_load((root / "baselines" / "b.yaml").read_text())["profiles"]
    assert set(profiles["cpu"]["metrics"]) == {"x"} and profiles["cpu"]["metrics"]["x"]["value"] == 2.0
    assert profiles["gpu"]["metrics"]["old"]["value"] == 4.0


WRITER = """
import sys
from pathlib import Path
from specbook import records
from specbook.record import Metric
root, tag, n, pad = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for i in range(n):
    date = "2026-11-29T14:00:00Z"
    run = {"id": f"{tag}-{i}", "date": date, "source": "measured", "inputs_hash": "h", "parameters": {},
           "provenance": {"pad": "x" * pad}}
    records.add_run(root, "b", "cpu", run, [Metric(f"m{i % 7}", float(i), "ms", "lower", samples=[1.0] * 200)])
    print(i, flush=True)
"""


def _writer(root: Path, tag: str, n: int, pad: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(root), tag, str(n), str(pad)],
                            stdout=subprocess.PIPE, text=True)


def test_concurrent_writers_both_land(root):
    procs = [_writer(root, tag, 15) for tag in ("a", "b")]
    for p in procs:
        assert p.wait(timeout=120) == 0
    runs = records.load(root / "baselines" / "b.yaml").data["profiles"]["cpu"]["runs"]
    assert sorted(r["id"] for r in runs) == sorted(f"{t}-{i}" for t in "ab" for i in range(15))


def test_sigkill_mid_write_leaves_a_whole_record(root):
    path = root / "baselines" / "b.yaml"
    for attempt in range(3):  # kill at a few different moments
        proc = _writer(root, f"k{attempt}", 10_000, pad=20_000)  # big writes: a kill lands mid-write
        for _ in range(3 + 4 * attempt):
            proc.stdout.readline()  # wait until it has written a few times, then kill it mid-stream
        time.sleep(0.01 * attempt)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        rf = records.load(path)  # parses and validates: never half-written
        assert any(r["id"].startswith(f"k{attempt}-") for r in rf.data["profiles"]["cpu"]["runs"])
    records.add_run(root, "b", "cpu", _run(1), [])  # the lock died with the killed process


def test_record_api(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SPECBOOK_RECORD_FILE", raising=False)
    record("tok_s", 12, unit="tok/s")
    assert capsys.readouterr().out == "tok_s = 12 tok/s\n"
    out = tmp_path / "r.jsonl"
    monkeypatch.setenv("SPECBOOK_RECORD_FILE", str(out))
    record("tok_s", 12, unit="tok/s", samples=[11, 13], rel_tol=0.1)
    # a noisy number's tolerance: twice the samples' relative spread (2/12), capped at 25%
    assert read_metrics(out) == [Metric("tok_s", 12.0, "tok/s", "higher", 0.25, 0.0, [11.0, 13.0])]
    record("tok_s", 13, unit="tok/s")
    with pytest.raises(ValueError, match="recorded twice"):
        read_metrics(out)


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="a b", value=1), "must match"),
    (dict(name="x", value="fast"), "must be a number"),
    (dict(name="x", value=True), "must be a number"),
    (dict(name="x", value=float("nan")), "must be finite"),
    (dict(name="x", value=1, direction="up"), "direction of x"),
    (dict(name="x", value=1, rel_tol=-0.1), "must be >= 0"),
    (dict(name="x", value=1, samples=[1, "a"]), "sample of x"),
    (dict(name="x", value=1, rel_tol=0.3), "at most 0.25"),  # a noisy tolerance that would pass a slowdown
    (dict(name="x", value=1, abs_tol=0.5), "must be relative"),
    (dict(name="x", value=1, direction="none", rel_tol=0.01), "exact x must be at most"),
    (dict(name="x", value=100, kind="exact", abs_tol=1), "exact x must be at most"),
    (dict(name="x", value=1, kind="fuzzy"), "kind of x"),
])
def test_record_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_metric(unit="u", **kwargs)


def test_a_sent_copy_is_named_by_its_sender_not_by_the_git_that_came_along(tmp_path, tmp_path_factory, monkeypatch):
    """A lent GPU machine may receive a .git at an older commit plus the sent files as changes; the records must
    name the commit that was sent (SPECBOOK_GIT_COMMIT), not that HEAD marked dirty. Without it: git itself."""
    from specbook.provenance import _git_state

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "f").write_text("old\n")
    git("add", "f")
    git("commit", "-qm", "old")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    (tmp_path / "f").write_text("sent\n")
    monkeypatch.delenv("SPECBOOK_GIT_COMMIT", raising=False)
    monkeypatch.delenv("SPECBOOK_GIT_DIRTY", raising=False)
    assert _git_state(tmp_path) == (head, True)
    monkeypatch.setenv("SPECBOOK_GIT_COMMIT", head)
    monkeypatch.setenv("SPECBOOK_GIT_DIRTY", "0")
    assert _git_state(tmp_path) == (head, False)
    monkeypatch.setenv("SPECBOOK_GIT_DIRTY", "1")
    assert _git_state(tmp_path) == (head, True)
    monkeypatch.delenv("SPECBOOK_GIT_COMMIT")
    monkeypatch.delenv("SPECBOOK_GIT_DIRTY")
    git("add", "f")
    git("commit", "-qm", "sent")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    for written in ("baselines/one.yaml", "docs/status.md", "docs/runbooks/executed/one-cpu.ipynb"):
        (tmp_path / written).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / written).write_text("what specbook writes\n")
    assert _git_state(tmp_path) == (head, False)  # records and docs written by an earlier run of one record
    (tmp_path / "f").write_text("code changed\n")
    assert _git_state(tmp_path) == (head, True)
    copy = tmp_path_factory.mktemp("sent")  # the lent machine's copy has no .git: only the id's form can be checked
    monkeypatch.setenv("SPECBOOK_GIT_COMMIT", "f" * 40)
    monkeypatch.setenv("SPECBOOK_GIT_DIRTY", "1")
    assert _git_state(copy) == ("f" * 40, True)


@pytest.mark.parametrize("sent", ["0123abc", "--output=x", "../../x", "HEAD", "f" * 40])
def test_a_sent_commit_is_a_full_commit_id_of_this_repository(tmp_path, monkeypatch, sent):
    """SPECBOOK_GIT_COMMIT goes into every record's provenance, and verify hands a record's commit to git: only a
    full id that this repository resolves (the last one it does not) is written; anything else is one line, exit 2,
    before anything runs."""
    root = make_repo(tmp_path)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"],
                   cwd=root, check=True)
    monkeypatch.setenv("SPECBOOK_GIT_COMMIT", sent)
    r = CliRunner().invoke(main, ["--root", str(root), "env"])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert f"SPECBOOK_GIT_COMMIT={sent!r}" in r.stderr, r.stderr


def test_site_waits_for_the_docs_lock(root):
    """Rewriting docs/ from the records takes the project's docs lock (concurrent `run --record`s take turns):
    `runbook site` started while another process holds it finishes only after that one lets go."""
    (root / "docs").mkdir()
    records.add_run(root, "b", "cpu", _run(1), [Metric("x", 1.0, "ms", "lower")])
    (root / "docs" / "p.md").write_text("x is <!-- claim: b/cpu/x fmt=.1f -->9.9<!-- /claim --> ms\n")
    with records.docs_lock(root):
        proc = subprocess.Popen([sys.executable, "-m", "specbook.cli", "--root", str(root), "site"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3)
        assert proc.poll() is None, proc.communicate()
        assert "9.9" in (root / "docs" / "p.md").read_text()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "1.0<!-- /claim -->" in (root / "docs" / "p.md").read_text() and "wrote docs/p.md" in out
