"""`runbook verify` catches a real slowdown and stays green when nothing changed, with two CPU-burning processes
beside it: on a clone of this repository, the recorded baseline-decode numbers are re-measured as they are, then
with every forward of the engine's model computed twice."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNBOOK = [sys.executable, "-m", "specbook.cli"]
SLOWDOWN = '''

# planted by tests/test_verify_planted.py: every forward of the model is computed twice (the same cache writes, the
# same logits): a real 2x slowdown of the engine's work, whatever the shape spends its time on
_forward = Transformer.forward


def _twice(self, *args, **kwargs):
    _forward(self, *args, **kwargs)
    return _forward(self, *args, **kwargs)


Transformer.forward = _twice
'''
pytestmark = [pytest.mark.slow, pytest.mark.content]  # verifies the committed baseline-decode record


@pytest.fixture()
def clone(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    return repo


@pytest.fixture()
def two_hogs():
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for h in hogs:
        h.kill()
        h.wait(timeout=10)


def verify(repo: Path) -> tuple[int, dict]:
    env = {**os.environ, "SPECBOOK_ROOT": str(repo), "PYTHONPATH": str(repo)}
    r = subprocess.run([*RUNBOOK, "verify", "baseline-decode", "--profile", "cpu", "--json"], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=1500)
    assert r.stdout, r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout)


def states(out: dict) -> dict[str, tuple[str, str | None]]:
    return {v["metric"]: (v["state"], v["change"]) for v in out["verdicts"] if v["profile"] == "cpu"}


def test_unchanged_green_and_planted_slowdown_caught_under_load(clone: Path, two_hogs) -> None:
    code, out = verify(clone)
    got = states(out)
    assert code == 0, {m: s for m, s in got.items() if s[0] != "fresh"}
    # the code is as recorded: a timing may have moved with this machine (shown), it cannot have drifted
    assert got["decode_tok_s"][0] in ("fresh", "moved") and got["weight_gb"][0] == "fresh"
    assert not {m for m, s in got.items() if s[0] not in ("fresh", "moved")}

    model = clone / "engine" / "model.py"
    model.write_text(model.read_text() + SLOWDOWN)
    code, out = verify(clone)
    got = states(out)
    assert code == 1, got
    for metric in ("decode_tok_s", "eager_decode_tok_s", "ms_per_token"):
        assert got[metric] == ("drifted", "regression"), (metric, got[metric])
    assert got["weight_gb"] == ("fresh", None)  # the weights did not change, and an exact number says so
