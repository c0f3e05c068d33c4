"""Headlines (specbook/headlines.py): a re-record that leaves a headline below its best is flagged by `run --record`,
the status page and the docs check (CI) until the docs say why; one inside its noise, or at its best, is not."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from specbook import headlines, site
from specbook.claims import check_docs, doc_texts
from specbook_testing import baseline, cli, make_repo, runbook_text

ROOT = Path(__file__).resolve().parents[1]

RUNBOOK = runbook_text(body="""
    import os
    record("speedup", float(os.environ.get("SPEEDUP", "2.0")), unit="x", direction="higher", rel_tol=0.1)
    record("accept", float(os.environ.get("ACCEPT", "5.0")), unit="tokens", direction="none", kind="exact")
""")


def repo(tmp: Path) -> Path:
    root = make_repo(tmp / "repo", pair=RUNBOOK)
    text = (root / "pyproject.toml").read_text().replace("[tool.specbook]", '[tool.specbook]\nheadlines = "h.yaml"')
    (root / "pyproject.toml").write_text(text)
    (root / "h.yaml").write_text(yaml.safe_dump({"headlines": [
        {"key": "pair/cpu/speedup", "what": "the speedup", "goal": 3.0},
        {"key": "pair/cpu/accept", "what": "accept length", "better": "higher"}]}))
    (root / "docs").mkdir()
    (root / "docs" / "index.md").write_text("---\ntitle: I\nstatus: current\nupdated: 2026-12-05\nruns: []\n"
                                            "runbooks: []\nrecords: []\n---\n\n# I\n")
    return root


def record(root: Path, monkeypatch, speedup: float, accept: float = 5.0) -> str:
    monkeypatch.setenv("SPEEDUP", str(speedup))
    monkeypatch.setenv("ACCEPT", str(accept))
    monkeypatch.setenv("SPECBOOK_ALLOW_BUSY", "1")
    r = cli(root, "run", "pair", "--record")
    assert r.exit_code == 0, r.output
    return r.output


def problems(root: Path) -> list[str]:
    return [p.message for p in check_docs(root) if "headline" in p.message or "regression" in p.message]


def test_a_planted_drop_in_a_re_record_is_flagged_until_the_docs_say_why(tmp_path, monkeypatch):
    root = repo(tmp_path)
    record(root, monkeypatch, 2.0)
    out = record(root, monkeypatch, 2.1)  # better: the new best
    assert "HEADLINE DOWN" not in out and not problems(root)
    out = record(root, monkeypatch, 1.2)  # the planted drop: 43% below the best, beyond a 10% noise
    assert "HEADLINE DOWN: pair/cpu/speedup" in out and "down 43% from its best (2.1" in out
    [msg] = problems(root)
    assert msg.startswith("headline pair/cpu/speedup is down from 2.1 x")
    page = site.status_page(root)
    assert "## Headlines" in page and "**UNEXPLAINED**" in page and "below goal" in page
    assert cli(root, "site", "--check").exit_code == 1

    last = baseline(root, "pair")["profiles"]["cpu"]["metrics"]["speedup"]["run"]
    index = root / "docs" / "index.md"
    index.write_text(index.read_text() + f"\nIt fell: <!-- regression: pair/cpu/speedup@{last} -->the cache was "
                                         "dropped<!-- /regression -->.\n")
    assert not problems(root)
    assert "explained at docs/index.md:" in site.status_page(root)
    assert "headline" not in cli(root, "site", "--check").output

    out = record(root, monkeypatch, 0.6)  # a further drop after the explained one needs a word of its own
    assert "HEADLINE DOWN" in out and len(problems(root)) == 1


def test_a_drop_inside_the_noise_is_not_flagged_but_an_exact_number_has_none(tmp_path, monkeypatch):
    root = repo(tmp_path)
    record(root, monkeypatch, 2.0, accept=5.0)
    out = record(root, monkeypatch, 1.9, accept=4.9)  # 5% within a 10% tolerance; an exact accept length is not
    assert "HEADLINE DOWN: pair/cpu/speedup" not in out and "HEADLINE DOWN: pair/cpu/accept" in out
    assert [m.split(" is down")[0] for m in problems(root)] == ["headline pair/cpu/accept"]


def test_a_marker_naming_no_run_of_the_history_is_a_problem(tmp_path, monkeypatch):
    root = repo(tmp_path)
    record(root, monkeypatch, 2.0)
    index = root / "docs" / "index.md"
    index.write_text(index.read_text() + "\n<!-- regression: pair/cpu/speedup@20990101T000000Z-0000 -->why"
                                         "<!-- /regression -->\n")
    assert problems(root) == ["regression marker names pair/cpu/speedup@20990101T000000Z-0000, which is no run of "
                              "that metric's history"]


@pytest.mark.parametrize("text,message", [
    ("headlines: 3\n", "must hold `headlines:`"),
    ("headlines: [{key: a/b}]\n", "`key` must be RUNBOOK/PROFILE/METRIC"),
    ("headlines: [{key: a/b/c, goal: fast}]\n", "`goal` must be a number"),
    ("headlines: [{key: a/b/c, better: up}]\n", "`better` must be higher or lower"),
    ("headlines: [{key: a/b/c, gaol: 1}]\n", "unknown field(s) gaol"),
])
def test_a_malformed_headlines_file_is_one_line(tmp_path, text, message):
    root = repo(tmp_path)
    (root / "h.yaml").write_text(text)
    r = cli(root, "site", "--check")
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1


def test_a_headline_of_direction_none_must_say_which_way_is_better(tmp_path, monkeypatch):
    root = repo(tmp_path)
    record(root, monkeypatch, 2.0)
    (root / "h.yaml").write_text("headlines: [{key: pair/cpu/accept}]\n")
    assert any("say `better: higher` or `lower`" in m for m in problems(root))


@pytest.mark.content
def test_every_headline_of_the_project_names_a_recorded_metric():
    texts = doc_texts(ROOT)
    for s in headlines.standings(ROOT, texts):
        assert not s.problem, s.problem


def test_a_re_record_that_lowers_an_explained_headline_no_further_is_not_loud(tmp_path, monkeypatch):
    root = repo(tmp_path)
    record(root, monkeypatch, 2.0)
    record(root, monkeypatch, 1.2)
    last = baseline(root, "pair")["profiles"]["cpu"]["metrics"]["speedup"]["run"]
    index = root / "docs" / "index.md"
    index.write_text(index.read_text() + f"\n<!-- regression: pair/cpu/speedup@{last} -->why<!-- /regression -->\n")
    out = record(root, monkeypatch, 1.19)  # within the noise of the explained drop
    assert "HEADLINE DOWN" not in out and "headline still below its best: pair/cpu/speedup" in out
    assert not problems(root)


def test_a_drop_in_records_imported_from_another_machine_is_flagged(tmp_path, monkeypatch):
    import shutil
    import tarfile

    root = repo(tmp_path)
    record(root, monkeypatch, 2.0)
    there = tmp_path / "there"  # the lent machine's copy of the tree, which records the drop
    shutil.copytree(root, there)
    record(there, monkeypatch, 1.2)
    archive = tmp_path / "results.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(there / "baselines", arcname="baselines")
    r = cli(root, "import", str(archive))
    assert r.exit_code == 0, r.output
    assert "HEADLINE DOWN: pair/cpu/speedup" in r.output and "down 40% from its best (2" in r.output
    assert [m for m in problems(root) if m.startswith("headline pair/cpu/speedup is down")]
    assert baseline(root, "pair")["profiles"]["cpu"]["metrics"]["speedup"]["value"] == 1.2
