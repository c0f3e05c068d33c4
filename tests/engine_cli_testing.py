"""Helpers for the tests of `python -m engine`: run it in process, and check a bad-input answer."""
from __future__ import annotations

from click.testing import CliRunner

from engine.__main__ import cli


def run(*args: str):
    """`python -m engine ARGS...` in process; click's Result (exit_code, output, stderr)."""
    return CliRunner().invoke(cli, list(args))


def assert_bad_input(result, *words: str) -> None:
    """Exit 2 and exactly one `error: ...` line on stderr naming every word: no traceback, no internal failure."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and "internal failure" not in lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
