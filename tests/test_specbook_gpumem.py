"""specbook.gpumem: the most GPU memory a run's process family took, kept with its record."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from specbook import execute, gpumem
from specbook_testing import cli, make_repo, runbook_text


def test_descendants_follow_the_parent_links():
    tree = {1: 0, 10: 1, 11: 10, 12: 11, 20: 1, 21: 20}
    assert gpumem.descendants(10, tree) == {10, 11, 12}
    assert gpumem.descendants(12, tree) == {12}


def test_the_peak_sums_the_family_and_keeps_the_most_seen():
    """Two polls: the family's processes summed (a stranger on the same GPU left out), the larger sum kept."""
    tree = {100: 1, 101: 100, 102: 101, 200: 1}
    seen = iter([{101: 1024.0, 200: 9000.0}, {101: 2048.0, 102: 1024.0, 200: 9000.0}, {101: 512.0}])
    peak = gpumem.Peak(sample=lambda: next(seen), tree=lambda: tree, pid=100)
    for _ in range(3):
        peak.poll()
    assert peak.stop() == 3.0  # (2048 + 1024) MiB, never the stranger's 9000


def test_without_nvidia_smi_nothing_is_sampled(monkeypatch):
    monkeypatch.setattr(gpumem.shutil, "which", lambda name: None)
    peak = gpumem.Peak.start()
    assert peak._thread is None and peak.stop() is None

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")
    monkeypatch.setattr(gpumem.subprocess, "run", missing)
    assert gpumem.used_mib() == {}


def test_used_mib_reads_nvidia_smi_rows(monkeypatch):
    out = "4242, 1000\n4243, [N/A]\n4242, 24\n"
    monkeypatch.setattr(gpumem.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=out, stderr=""))
    assert gpumem.used_mib() == {4242: 1024.0}


def test_parents_reads_this_process_from_proc():
    import os

    assert gpumem.parents().get(os.getpid()) == os.getppid()


def test_a_recorded_run_keeps_its_peak_and_a_run_over_its_declaration_says_so(tmp_path, monkeypatch):
    """A fake sampler that sees 5 GiB: the record keeps gpu_peak_gib 5.0, and the log says the header's 4 is short."""
    class Fake(gpumem.Peak):
        @classmethod
        def start(cls, **kw):
            p = cls(sample=lambda: {}, tree=dict)
            p.mib = 5 * 1024.0
            return p
    monkeypatch.setattr(execute.gpumem, "Peak", Fake)
    root = make_repo(tmp_path, one=runbook_text(extra_header="gpu_memory_gib: 4"))
    r = cli(root, "run", "one", "--record")
    assert r.exit_code == 0, r.output
    assert "took 5.0 GiB of GPU memory; its header declares gpu_memory_gib 4" in r.output
    run = yaml.safe_load((root / "baselines" / "one.yaml").read_text())["profiles"]["cpu"]["runs"][-1]
    assert run["provenance"]["gpu_peak_gib"] == 5.0
