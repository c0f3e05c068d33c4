"""Docs checks and claim refresh: each bad input fails with file and line."""
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from specbook import SpecbookError, claims, provenance, site
from specbook.cli import main
from specbook.execute import target
from specbook.claims import DocsError, check_docs, plan_refresh, apply_edits, refresh_docs

ROOT = Path(__file__).resolve().parents[1]
HERE = provenance.detect_profile()  # this machine's profile: its numbers can be fresh or stale
OTHER = "h200" if HERE != "h200" else "cpu"  # another machine's: not verifiable here
FRONT = "---\ntitle: T\nstatus: current\nupdated: 2026-11-29\nrunbooks: []\nrecords: []\n---\n"


RUNBOOK = """# %% [markdown]
# # Bench
#
# ```yaml
# title: Bench
# reproduces: [tok_s]
# feeds: []
# depends: []
# profiles:
#   HERE: {}
#   OTHER: {}
# ```

# %% tags=["parameters"]
n = 1

# %%
from specbook import record

record("tok_s", 82.5, unit="tok/s", direction="higher")
"""


def write_record(root: Path, value: float = 82.5, samples=(82.0, 83.0), source: str = "reported",
                 profile: str = "cpu") -> None:
    """A bench record; a measured one gets the inputs hash of runbooks/bench.py as it is now (fresh)."""
    run = {"id": "r1", "date": "2026-11-29T14:40:00Z", "source": source, "provenance": {}}
    if source == "measured":
        (root / "runbooks").mkdir(exist_ok=True)
        (root / "runbooks" / "bench.py").write_text(RUNBOOK.replace("HERE", HERE).replace("OTHER", OTHER))
        t = target(root, "bench", profile)
        run |= {"parameters": {"n": 1}, "inputs_hash": t.inputs_hash,
                "provenance": {"runbook_hash": provenance.sha(t.rb.hashed_source),
                               "params_hash": provenance.sha(provenance.canonical(t.params)), "engine_hash": t.engine,
                               **{f"{i}_manifest": h for i, h in t.all_inputs().items()}}}
    data = {"runbook": "bench", "profiles": {profile: {
        "runs": [run],
        "metrics": {"tok_s": {"value": value, "unit": "tok/s", "direction": "higher",
                              "tolerance": {"rel": 0.1, "abs": 0.0}, "run": "r1", "samples": list(samples),
                              "history": [{"value": value, "run": "r1"}]}}}}}
    (root / "baselines").mkdir(exist_ok=True)
    (root / "baselines" / "bench.yaml").write_text(yaml.safe_dump(data))


def page(root: Path, body: str, name: str = "p.md", front: str = FRONT) -> Path:
    (root / "docs").mkdir(exist_ok=True)
    path = root / "docs" / name
    path.write_text(front + body)
    return path


def messages(root: Path) -> list[str]:
    return [str(p) for p in check_docs(root)]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_record(tmp_path)
    return tmp_path


@pytest.mark.content
def test_repository_docs_are_clean():
    assert messages(ROOT) == []


def test_true_claims_pass(root):
    page(root, "Decode runs at <!-- claim: bench/cpu/tok_s fmt=.1f -->82.5<!-- /claim --> tok/s, "
               "range <!-- claim: bench/cpu/tok_s fmt=range:.0f -->82-83<!-- /claim --> tok/s.\n")
    assert messages(root) == []


def test_claim_to_missing_record(root):
    page(root, "line\n<!-- claim: bench/h200/tok_s fmt=.1f -->82.5<!-- /claim --> tok/s\n")
    assert messages(root) == ["docs/p.md:9: claim bench/h200/tok_s: no such record in baselines/"]


def test_literal_differs_from_record(root):
    page(root, "<!-- claim: bench/cpu/tok_s fmt=.1f -->89.0<!-- /claim --> tok/s\n")
    [msg] = messages(root)
    assert msg.startswith("docs/p.md:8: claim bench/cpu/tok_s: literal '89.0' != record '82.5'")


@pytest.mark.parametrize("marker", [
    "<!-- claim: bench/cpu/tok_s fmt=.1f -->82.5 no closing marker",
    "<!-- claim: bench/tok_s -->82.5<!-- /claim -->",
    "82.5<!-- /claim -->",
])
def test_malformed_marker(root, marker):
    page(root, f"ok\n\n{marker}\n")
    [msg] = [m for m in messages(root) if "malformed" in m]
    assert msg.startswith("docs/p.md:10: malformed marker")


def test_bad_fmt(root):
    page(root, "<!-- claim: bench/cpu/tok_s fmt=.1q -->82.5<!-- /claim -->\n")
    assert messages(root) == ["docs/p.md:8: claim bench/cpu/tok_s: bad fmt='.1q'"]


def test_page_without_front_matter(root):
    page(root, "# Title\n\nNo front matter.\n", front="")
    assert messages(root) == ["docs/p.md:1: no YAML front matter (--- title, status, updated, runbooks, records ---)"]


def test_front_matter_missing_keys(root):
    page(root, "# T\n", front="---\ntitle: T\nstatus: draft\n---\n")
    assert messages(root) == ["docs/p.md:2: front matter lacks updated, runbooks, records"]


def test_broken_link(root):
    page(root, "[ok](other.md) [anchor](#x) [web](https://example.com) [dash](dashboard.md)\n\n"
               "[gone](missing.md#part)\n")
    page(root, "", name="other.md")
    assert messages(root) == ["docs/p.md:10: broken link: missing.md#part"]


@pytest.mark.parametrize("text", ["runs at 82.5 tok/s", "a 4.4x speedup", "verify costs ~30 ms",
                                  "accept length of 2.0", "27% of the cycle",
                                  "about 10 minutes", "0.78 GB each"])
def test_measured_number_outside_marker(root, text):
    page(root, f"It {text}.\n")
    [msg] = messages(root)
    assert msg.startswith("docs/p.md:8: ") and "outside a claim marker" in msg


@pytest.mark.parametrize("text", [
    "hidden 7168, intermediate 18432, 61 layers, 8x RTX PRO 6000, EAGLE-3 tok/s",
    "the paper reports <!-- cite: EAGLE-3 paper -->4.40x<!-- /cite --> speedup",
    "`--budget 30 ms` in code",
    "```\nbench: 82.5 tok/s\n```",
])
def test_numbers_that_are_not_measured(root, text):
    page(root, text + "\n")
    assert messages(root) == []


def test_range_without_samples_is_the_value(root):
    write_record(root, samples=())
    page(root, "<!-- claim: bench/cpu/tok_s fmt=range:.0f -->82-83<!-- /claim --> tok/s\n")
    assert messages(root) == ["docs/p.md:8: claim bench/cpu/tok_s: literal '82-83' != record '82' (run `runbook run`)"]


def test_refresh_rewrites_only_literals(root):
    path = page(root, "A <!-- claim: bench/cpu/tok_s fmt=.1f -->1.0<!-- /claim --> tok/s and "
                      "<!-- claim: bench/cpu/tok_s fmt=range:.0f -->1-2<!-- /claim --> tok/s.\n"
                      "Missing <!-- claim: nope/cpu/x fmt=.1f -->7.0<!-- /claim --> tok/s stays.\n")
    assert refresh_docs(root) == [path]
    text = path.read_text()
    assert "-->82.5<!--" in text and "-->82-83<!--" in text and "-->7.0<!--" in text
    assert refresh_docs(root) == []  # idempotent


def test_refresh_limited_to_runbooks(root):
    path = page(root, "<!-- claim: bench/cpu/tok_s fmt=.1f -->1.0<!-- /claim --> tok/s\n")
    assert refresh_docs(root, runbooks=["other"]) == []
    assert "-->1.0<!--" in path.read_text()


def test_refresh_refuses_file_changed_underneath(root):
    path = page(root, "<!-- claim: bench/cpu/tok_s fmt=.1f -->1.0<!-- /claim --> tok/s\n")
    edits = plan_refresh(root)
    path.write_text(path.read_text() + "An edit by hand.\n")
    with pytest.raises(DocsError, match="changed since it was read"):
        apply_edits(edits)
    assert "-->1.0<!--" in path.read_text() and path.read_text().endswith("An edit by hand.\n")


def test_reported_claims_are_not_verifiable_here(root):
    page(root, "<!-- claim: bench/cpu/tok_s fmt=.1f -->82.5<!-- /claim --> tok/s\n")
    assert claims.record_verdict(root, "bench", "cpu", "tok_s", {}) == "reported"
    assert messages(root) == []


def test_measured_claim_fresh_then_stale(root):
    write_record(root, source="measured", profile=HERE)
    page(root, f"<!-- claim: bench/{HERE}/tok_s fmt=.1f -->82.5<!-- /claim --> tok/s\n")
    assert messages(root) == []
    rb = root / "runbooks" / "bench.py"
    rb.write_text(rb.read_text().replace("n = 1", "n = 2"))
    assert messages(root) == [f"docs/p.md:8: claim bench/{HERE}/tok_s: record is stale (`runbook verify bench`)"]


def test_stale_record_of_another_profile_is_a_docs_problem(root):
    """A number of hardware this machine lacks cannot be re-measured here, but its inputs hash the same everywhere:
    code changed since it was recorded means the documented number is stale, whoever reads it."""
    write_record(root, source="measured", profile=OTHER)
    page(root, f"<!-- claim: bench/{OTHER}/tok_s fmt=.1f -->82.5<!-- /claim --> tok/s\n")
    assert claims.record_verdict(root, "bench", OTHER, "tok_s", {}) == "current" and messages(root) == []
    rb = root / "runbooks" / "bench.py"
    rb.write_text(rb.read_text().replace("n = 1", "n = 2"))
    assert claims.record_verdict(root, "bench", OTHER, "tok_s", {}) == "stale"
    assert messages(root) == [f"docs/p.md:8: claim bench/{OTHER}/tok_s: record is stale (`runbook verify bench`)"]
    text, _ = site.dashboard(root)
    assert "verdict-stale" in text and f"verdict-{OTHER}-only" in text and f"--profile {OTHER}" in text
    assert 'title="runbook, parameters changed"' in text


@pytest.mark.parametrize("expr, ok", [
    ("bench/cpu/tok_s > 80", True), ("bench/cpu/tok_s < 80", False),
    ("bench/cpu/tok_s * 2 > 160 and abs(bench/cpu/tok_s - 82.5) < 0.1", True),
])
def test_check_markers_hold_comparisons_to_the_records(root, expr, ok):
    write_record(root, source="reported")
    page(root, f"Decoding is <!-- check: {expr} -->faster than before<!-- /check -->.\n")
    got = messages(root)
    assert got == [] if ok else (len(got) == 1 and "is false for the records" in got[0])


@pytest.mark.parametrize("text, problem", [
    ("Decoding got faster than before.", "compares in words"),
    ("<!-- check: __import__('os') -->x<!-- /check -->", "only record keys"),
    ("<!-- check: nope/cpu/x > 1 -->x<!-- /check -->", "no record nope/cpu/x"),
])
def test_unchecked_or_unsafe_comparisons_are_problems(root, text, problem):
    write_record(root, source="reported")
    page(root, text + "\n")
    assert any(problem in m for m in messages(root)), messages(root)


def test_measured_claim_whose_runbook_is_gone(root):
    write_record(root, source="measured", profile=HERE)
    (root / "runbooks" / "bench.py").unlink()
    page(root, f"<!-- claim: bench/{HERE}/tok_s fmt=.1f -->82.5<!-- /claim --> tok/s\n")
    [msg] = messages(root)
    assert msg.startswith(f"docs/p.md:8: claim bench/{HERE}/tok_s: record is failed (`runbook verify bench`)")


def test_malformed_record_is_reported_at_the_claim(root):
    (root / "baselines" / "bench.yaml").write_text("runbook: bench\nprofiles: [\n")
    page(root, "<!-- claim: bench/cpu/tok_s fmt=.1f -->82.5<!-- /claim --> tok/s\n")
    [msg] = messages(root)
    assert msg.startswith("docs/p.md:8: ") and "bench.yaml:" in msg and "malformed YAML" in msg


def test_runbook_verify_docs_fails_with_file_and_line(root):
    from click.testing import CliRunner

    from specbook.cli import main

    (root / "runbooks").mkdir()
    page(root, "[gone](missing.md)\n")
    r = CliRunner().invoke(main, ["--root", str(root), "verify", "--docs", "bench"])
    assert r.exit_code == 1 and "docs: docs/p.md:8: broken link: missing.md" in r.stdout


def record_another_run(root: Path, value: float, run_id: str = "r2") -> None:
    """A newer run of the bench record: its value becomes the recorded one, the old one stays in the history."""
    path = root / "baselines" / "bench.yaml"
    data = yaml.safe_load(path.read_text())
    [(profile, prof)] = data["profiles"].items()
    prof["runs"].append({**prof["runs"][0], "id": run_id, "date": "2026-12-01T10:00:00Z",
                         "provenance": {**prof["runs"][0]["provenance"], "git_commit": "abcdef1234567"}})
    m = prof["metrics"]["tok_s"]
    m["history"].append({"value": value, "run": run_id})
    m.update(value=value, run=run_id, samples=[value])
    path.write_text(yaml.safe_dump(data))


def test_pinned_claim_quotes_its_run_while_the_record_moves_on(root):
    """Prose about one run pins its number with @RUN: the history entry, not the newest value, on every refresh."""
    record_another_run(root, 91.25)
    path = page(root, "Before: <!-- claim: bench/cpu/tok_s@r1 fmt=.1f -->0<!-- /claim --> tok/s; now "
                      "<!-- claim: bench/cpu/tok_s fmt=.1f -->0<!-- /claim --> tok/s; <!-- check: "
                      "bench/cpu/tok_s > bench/cpu/tok_s@r1 + 8 -->it got faster<!-- /check -->.\n")
    assert refresh_docs(root) == [path]
    assert "tok_s@r1 fmt=.1f -->82.5<!--" in path.read_text() and "tok_s fmt=.1f -->91.2<!--" in path.read_text()
    assert messages(root) == []
    record_another_run(root, 70.0, "r3")
    refresh_docs(root)
    assert "tok_s@r1 fmt=.1f -->82.5<!--" in path.read_text() and "tok_s fmt=.1f -->70.0<!--" in path.read_text()
    assert [m for m in messages(root) if "is false" in m]  # the check now says the text no longer holds


def test_pinned_claim_to_a_run_not_in_the_history(root):
    page(root, "<!-- claim: bench/cpu/tok_s@r9 fmt=.1f -->82.5<!-- /claim --> tok/s\n")
    assert messages(root) == ["docs/p.md:8: claim bench/cpu/tok_s@r9: no run r9 in the history of bench/cpu/tok_s"]
    page(root, "<!-- check: bench/cpu/tok_s@r9 > 1 -->x<!-- /check -->\n")
    assert any("no record bench/cpu/tok_s@r9" in m for m in messages(root))


def test_pinned_claim_stays_true_when_its_record_goes_stale(root):
    write_record(root, source="measured", profile=HERE)
    page(root, f"Then <!-- claim: bench/{HERE}/tok_s@r1 fmt=.1f -->82.5<!-- /claim --> tok/s; now "
               f"<!-- claim: bench/{HERE}/tok_s fmt=.1f -->82.5<!-- /claim --> tok/s.\n")
    rb = root / "runbooks" / "bench.py"
    rb.write_text(rb.read_text().replace("n = 1", "n = 2"))
    assert messages(root) == [f"docs/p.md:8: claim bench/{HERE}/tok_s: record is stale (`runbook verify bench`)"]


def test_status_page_names_a_pinned_claims_run(root):
    record_another_run(root, 91.25)
    page(root, "Before <!-- claim: bench/cpu/tok_s@r1 fmt=.1f -->82.5<!-- /claim --> tok/s, after "
               "<!-- claim: bench/cpu/tok_s@r2 fmt=.2f -->91.25<!-- /claim --> tok/s.\n")
    text = site.status_page(root)
    rows = [r for r in text.split("## bench\n", 1)[1].splitlines() if r.startswith("| `cpu/")]
    assert rows[0].startswith("| `cpu/tok_s@r1` |") and "| 82.5 tok/s |" in rows[0]
    assert "**pinned**" in rows[0] and "2026-11-29" in rows[0] and "2026-12-01" not in rows[0]
    assert "| 91.25 tok/s |" in rows[1] and "2026-12-01" in rows[1] and "`abcdef1234`" in rows[1]
    assert "(2 quotes): 2 pinned." in text


def test_status_page_has_a_narrow_table_per_runbook_and_says_what_it_counts(root):
    """A section per runbook (anchor: its name, for links that work on GitHub and the site), one row per number
    however often it is quoted, short first cells; the counts say how they differ from `runbook status`'s."""
    write_record(root, source="measured", profile="cpu")
    page(root, "Decode at <!-- claim: bench/cpu/tok_s fmt=.1f -->82.5<!-- /claim --> tok/s, or "
               "<!-- claim: bench/cpu/tok_s fmt=range:.0f -->82-83<!-- /claim --> tok/s.\n")
    page(root, "Again <!-- claim: bench/cpu/tok_s fmt=.1f -->82.5<!-- /claim --> tok/s.\n", name="q.md")
    text = site.status_page(root)
    section = text.split("\n## bench\n", 1)[1]
    rows = [r for r in section.splitlines() if r.startswith("| `")]
    assert rows == [rows[0]] and rows[0].startswith("| `cpu/tok_s` | 82.5 / 82-83 tok/s | **current** | ")
    assert "| [p.md:8](p.md), [q.md:8](q.md) |" in rows[0]
    assert "`runbook status` counts something else: every recorded metric (1)" in text
    assert "(3 quotes): 1 current." in text


FORGED = "tok/s | forged |\n| `bench/cpu/evil` | [x](x) | 1 | on `cpu` | **current** | unchanged | x |\n\x1b[2J"


def test_a_records_text_stays_in_its_cell_and_line(root):
    """A hand-edited unit (or GPU name) with `|` or a newline once forged rows of docs/status.md and lines of
    `runbook show`."""
    path = root / "baselines" / "bench.yaml"
    data = yaml.safe_load(path.read_text())
    data["profiles"]["cpu"]["metrics"]["tok_s"]["unit"] = FORGED
    data["profiles"]["cpu"]["runs"][0]["provenance"]["gpu"] = {"count": 1, "names": ["GPU\n| forged |"]}
    path.write_text(yaml.safe_dump(data))
    page(root, "x <!-- claim: bench/cpu/tok_s fmt=.1f -->82.5<!-- /claim --> tok/s\n")
    (root / "runbooks").mkdir(exist_ok=True)
    table = [r for r in site.status_page(root).split("\n## bench\n", 1)[1].splitlines() if r.startswith("|")]
    assert len(table) == 3, table  # the header, its rule, one row
    cells = {len(re.findall(r"(?<!\\)\|", r)) for r in table}
    assert len(cells) == 1, table  # every row as many cells as the header
    shown = CliRunner().invoke(main, ["--root", str(root), "show", "bench"])
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert len(lines) == 5 and "\x1b" not in shown.stdout, lines  # name, header, rule, one metric, one run
    assert lines[3].split()[:2] == ["cpu", "tok_s"] and "\\n" in lines[3]


def test_a_re_record_owed_for_another_machine_keeps_it_stale_but_is_no_docs_problem(root):
    """An engine change lands before a lease re-records the GPU's numbers: baselines/pending/records.yaml says the
    re-record is owed; the number stays stale on the status page (which says so), and the entry must go once nothing
    of that machine is stale."""
    write_record(root, source="measured", profile=OTHER)
    page(root, f"<!-- claim: bench/{OTHER}/tok_s fmt=.1f -->82.5<!-- /claim --> tok/s\n")
    owed = root / "baselines" / "pending" / "records.yaml"
    owed.parent.mkdir(parents=True)
    owed.write_text(f"pending:\n  - machine: {OTHER}\n    since: abcdef1\n    why: no lease came\n")
    assert messages(root) == [f"baselines/pending/records.yaml:0: nothing of {OTHER} is stale any more: remove its "
                              "entry"]
    rb = root / "runbooks" / "bench.py"
    rb.write_text(rb.read_text().replace("n = 1", "n = 2"))
    assert claims.record_verdict(root, "bench", OTHER, "tok_s", {}) == "stale" and messages(root) == []
    assert "re-record owed since abcdef1: no lease came" in site.status_page(root)
    owed.write_text(f"pending:\n  - machine: {HERE}\n    since: abcdef1\n    why: lazy\n")  # this machine could
    assert f"records are owed, and this machine is a {HERE}: re-record them here" in " ".join(messages(root))
    owed.write_text("pending:\n  - machine: h200\n")
    with pytest.raises(SpecbookError, match=r"pending\[0\] must be"):
        check_docs(root)
