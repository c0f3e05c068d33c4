"""scripts/lease.sh off a GPU: the card picks the chain, a job outlives the call, and every call packs what the job
recorded so far (a lent machine can be taken back before the next call)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SHA = "0123456789abcdef0123456789abcdef01234567"

# scripts/gpu-runbooks.sh CHAIN: a stand-in that records one file per chain, logs to $OUT, then waits on a flag file
FAKE_RUNBOOKS = """#!/usr/bin/env bash
mkdir -p logs "$OUT"
echo "commit $SPECBOOK_GIT_COMMIT fresh $FRESH chain $1" | tee logs/gpu0.log > "$OUT/gpu0.log"
echo recorded > "baselines/$(echo "$1" | tr -c 'a-z0-9.\\n' _).yaml"
while [ ! -e "$RELEASE" ]; do sleep 0.2; done
exit 5
"""


@pytest.fixture
def lease(tmp_path):
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / "baselines").mkdir()
    (root / "docs" / "runbooks" / "executed").mkdir(parents=True)
    for name in ("lease.sh", "device-job.sh"):
        shutil.copy(SCRIPTS / name, root / "scripts")
    (root / "scripts" / "gpu-runbooks.sh").write_text(FAKE_RUNBOOKS)
    (root / "scripts" / "gpu-runbooks.sh").chmod(0o755)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text('#!/bin/sh\n[ -n "$CARD" ] && echo "$CARD"\n')
    (bin_ / "nvidia-smi").chmod(0o755)
    job = f"test-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "OUT": str(out), "JOB": job, "WAIT": "1",
           "RELEASE": str(tmp_path / "release")}

    def call(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(root / "scripts" / "lease.sh"), *args], cwd=root, env={**env, **extra},
                              capture_output=True, text=True, timeout=60)

    yield call, out, tmp_path / "release"
    for path in Path("/tmp").glob(f"job-{job}*"):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()


def packed(out: Path) -> set[str]:
    with tarfile.open(out / "partial.tgz") as tar:
        return {m.name for m in tar.getmembers() if m.isfile()}


@pytest.mark.parametrize("card, chain", [("NVIDIA H200", "record --profile h200"),
                                         ("NVIDIA H100 80GB HBM3", "record drift-dial --profile h100.dsv3")])
def test_the_card_picks_the_chain_and_each_call_packs_what_was_recorded(lease, card, chain):
    call, out, release = lease
    r = call("first", SHA, "record --profile h200", "record drift-dial --profile h100.dsv3", CARD=card,
             FRESH="1")
    assert r.returncode == 124, r.stdout + r.stderr  # the job outlives the call
    assert f"chain: {chain}" in r.stdout
    assert (out / "gpu0.log").read_text().strip() == f"commit {SHA} fresh 1 chain {chain}"
    assert any(name.startswith("baselines/record") for name in packed(out))  # a cut lease keeps what was recorded
    (out / "partial.tgz").unlink()
    release.touch()
    r = call("next", WAIT="30")
    assert r.returncode == 5, r.stdout + r.stderr  # the job's own exit code once it ended
    assert "logs/gpu0.log" in packed(out)


def test_more_runs_another_chain_in_the_first_ones_tree_once_it_ended(lease):
    """Device time left after the chain: `more` records further runbooks where the first chain's outputs are, and
    each call packs what every chain recorded so far."""
    call, out, release = lease
    r = call("first", SHA, "record train-drafter --profile h200", CARD="NVIDIA H200")
    assert r.returncode == 124, r.stdout + r.stderr
    r = call("more", "record baseline-eagle3 --profile h200")
    assert r.returncode == 2 and "still runs" in r.stderr  # one chain at a time
    release.touch()
    assert call("next", WAIT="30").returncode == 5
    r = call("more", "record baseline-eagle3 --profile h200", WAIT="30")
    assert r.returncode == 5, r.stdout + r.stderr
    assert (out / "gpu0.log").read_text().strip() == f"commit {SHA} fresh 0 chain record baseline-eagle3 --profile h200"
    assert {"baselines/record_train_drafter___profile_h200.yaml",  # the stand-in's file per chain, both chains'
            "baselines/record_baseline_eagle3___profile_h200.yaml"} <= packed(out)
    r = call("next", WAIT="30")  # next waits for the chain `more` started
    assert r.returncode == 5 and "chain record baseline-eagle3" in (out / "gpu0.log").read_text()
    assert call("more", "record 'x' --profile h200").returncode == 2


def test_no_chain_for_the_card_and_bad_input_exit_without_starting_a_job(lease):
    call, out, _ = lease
    for card in ("", "NVIDIA A100-SXM4-80GB"):
        r = call("first", SHA, "record --profile h200", "record --profile h100", CARD=card)
        assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = call("first", SHA, "record --profile h200", CARD="NVIDIA H100 80GB HBM3")  # no H100 chain given
    assert r.returncode == 3 and "no chain for this card" in r.stderr
    r = call("first", SHA, "record 'x' --profile h200", CARD="NVIDIA H200")
    assert r.returncode == 2 and "single quotes" in r.stderr
    r = call("first", SHA[:7], "record --profile h200", CARD="NVIDIA H200")  # records need the full id
    assert r.returncode == 2 and "full 40-digit commit id" in r.stderr
    for args in ([], ["first", SHA], ["next", "extra"], ["start"], ["more"], ["more", "a", "b"]):
        r = call(*args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    assert call("next").returncode == 2  # no job was started
    r = call("more", "record --profile h200")
    assert r.returncode == 2 and "no lease job here" in r.stderr
    assert not list(out.iterdir())
    r = call("next", OUT="")
    assert r.returncode == 2 and "set OUT" in r.stderr
