"""`runbook` and `python -m engine` share their conventions: exit codes and their documented meanings, one-line usage
errors (exit 2), --debug before or after the command name, internal failures (exit 3), Ctrl-C (exit 130)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner, Result

from engine.__main__ import cli as engine_cli
from specbook.cli import main as runbook_cli
from specbook_testing import make_repo

ENGINE_BAD_INPUT = ["generate", "--shape", "tiny", "--prompt", "x", "--dtype", "int3"]  # an EngineError
CLIS = {"runbook": runbook_cli, "engine": engine_cli}


def invoke(which: str, *args: str) -> Result:
    return CliRunner().invoke(CLIS[which], list(args))


def exit_codes(help_text: str) -> dict[int, str]:
    """The epilog's exit codes: code -> the meaning's first phrase (up to ':' , ';' or '(')."""
    block = help_text.split("Exit codes", 1)[1]
    return {int(code): re.split(r"[:;(]", meaning, maxsplit=1)[0].strip()
            for code, meaning in re.findall(r"^\s+(\d+)\s+(\S.*)$", block, flags=re.M)}


def assert_one_line_error(r: Result, code: int, *words: str) -> None:
    assert r.exit_code == code, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Usage:" not in r.output and "Traceback" not in r.output
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_both_epilogs_document_the_same_exit_codes():
    meanings = {which: exit_codes(invoke(which, "--help").stdout) for which in CLIS}
    assert meanings["runbook"] == meanings["engine"] == {
        0: "ok", 1: "a check failed", 2: "bad input or usage", 3: "internal failure, could not run",
        130: "interrupted"}


@pytest.mark.parametrize("which,args,words", [
    ("runbook", ["--nope"], ["--nope"]),
    ("runbook", ["list", "--nope"], ["--nope"]),
    ("runbook", ["show"], ["NAME"]),
    ("runbook", ["nosuchcommand"], ["nosuchcommand"]),
    ("engine", ["--nope"], ["--nope"]),
    ("engine", ["generate", "--nope"], ["--nope"]),
    ("engine", ["bench", "--profile"], ["--profile"]),  # the kernel profiler is --torch-profile
    ("engine", ["train", "drafter"], ["OUT_DIR"]),
    ("engine", ["nosuchcommand"], ["nosuchcommand"]),
])
def test_usage_errors_are_one_line_and_exit_2(which, args, words):
    assert_one_line_error(invoke(which, *args), 2, *words)


@pytest.mark.parametrize("which", list(CLIS))
def test_no_command_shows_the_help_and_exits_2(which):
    r = invoke(which)
    assert r.exit_code == 2 and "Commands:" in r.output


def runbook_bad_input(tmp_path: Path, *debug: str, after: bool = False) -> list[str]:
    root = make_repo(tmp_path)
    return ["--root", str(root), *([] if after else debug), "show", "nosuch", *(debug if after else [])]


@pytest.mark.parametrize("position", ["before", "after"])
def test_debug_before_or_after_the_command_shows_the_traceback(tmp_path, position):
    after = position == "after"
    r = invoke("runbook", *runbook_bad_input(tmp_path, "--debug", after=after))
    assert type(r.exception).__name__ == "SpecbookError", r.output
    args = ["--debug", *ENGINE_BAD_INPUT] if not after else [*ENGINE_BAD_INPUT, "--debug"]
    r = invoke("engine", *args)
    assert type(r.exception).__name__ == "EngineError", r.output


def test_debug_reaches_nested_engine_commands():
    for args in (["--debug", "train", "corpus", "--help"], ["train", "--debug", "corpus", "--help"],
                 ["train", "corpus", "--debug", "--help"]):
        assert invoke("engine", *args).exit_code == 0, args


def test_without_debug_bad_input_is_one_line_and_exit_2(tmp_path):
    assert_one_line_error(invoke("runbook", *runbook_bad_input(tmp_path)), 2, "nosuch")
    assert_one_line_error(invoke("engine", *ENGINE_BAD_INPUT), 2, "int3")


def _raise(exc: BaseException):
    def boom(*args, **kwargs):
        raise exc
    return boom


@pytest.mark.parametrize("exc,code", [(RuntimeError("boom\nsecond line"), 3), (KeyboardInterrupt(), 130)])
def test_internal_failure_exits_3_and_ctrl_c_130_in_both(tmp_path, monkeypatch, exc, code):
    from engine import runtime
    from specbook import provenance

    monkeypatch.setattr(provenance, "fingerprint", _raise(exc))
    monkeypatch.setattr(runtime.Engine, "generate", _raise(exc))
    results = [invoke("runbook", "--root", str(make_repo(tmp_path)), "env"),
               invoke("engine", "generate", "--shape", "tiny", "--prompt", "x")]
    for r in results:
        assert r.exit_code == code and len(r.stderr.strip().splitlines()) == 1, (r.exit_code, r.stderr)
        assert ("RuntimeError: boom" in r.stderr and "--debug" in r.stderr) if code == 3 else \
            r.stderr.strip() == "interrupted"


def test_engine_help_texts_name_only_their_own_command():
    for command in ("generate", "serve"):
        text = invoke("engine", command, "--help").stdout
        assert "bench" not in text and "baseline row" not in text, command
    bench = invoke("engine", "bench", "--help").stdout
    assert "--torch-profile" in bench and "--profile " not in bench and "'compiled' baseline row" in bench


FRONT = "---\ntitle: T\nstatus: current\nupdated: 2026-11-29\nrunbooks: []\nrecords: []\n---\n"
DECISIONS = FRONT + ("# Decisions\n\n## D1: Do it\n\n- **Status:** open\n- **Date:** 2026-11-29\n"
                     "- **Decision:** do it.\n- **Why it is open:** nobody measured. More later.\n")


def reported_record(root: Path) -> None:
    run = {"id": "r1", "date": "2026-11-29T14:40:00Z", "source": "reported", "provenance": {}}
    metric = {"value": 82.5, "unit": "tok/s", "direction": "higher", "tolerance": {"rel": 0.1, "abs": 0.0},
              "run": "r1", "history": [{"value": 82.5, "run": "r1"}]}
    data = {"runbook": "bench", "profiles": {"h200": {"runs": [run], "metrics": {"tok_s": metric}}}}
    (root / "baselines" / "bench.yaml").write_text(yaml.safe_dump(data))


def test_context_json_lists_numbers_claims_and_decisions(tmp_path):
    root = make_repo(tmp_path)
    reported_record(root)
    (root / "docs").mkdir()
    (root / "docs" / "p.md").write_text(FRONT + "Runs at <!-- claim: bench/h200/tok_s fmt=.1f -->82.5<!-- /claim -->"
                                                " tok/s, as run r1 measured: <!-- claim: bench/h200/tok_s@r1 fmt=.0f -->"
                                                "82<!-- /claim --> tok/s.\n")
    (root / "docs" / "decisions.md").write_text(DECISIONS)
    r = invoke("runbook", "--root", str(root), "context", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [(n["runbook"], n["profile"], n["metric"], n["value"], n["state"]) for n in out["numbers"]] == [
        ("bench", "h200", "tok_s", 82.5, "reported")]
    assert out["claims"] == [
        {"claim": "bench/h200/tok_s", "run": None, "file": "docs/p.md", "line": 8, "literal": "82.5",
         "state": "reported", "unit": "tok/s"},
        {"claim": "bench/h200/tok_s", "run": "r1", "file": "docs/p.md", "line": 8, "literal": "82",
         "state": "pinned", "unit": "tok/s"}]
    assert out["decisions"][0]["title"] == "D1: Do it" and out["decisions"][0]["status"] == "open"
    assert out["problems"] == [] and out["next_steps"] == []
