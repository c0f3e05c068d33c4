"""The most GPU memory a run took: nvidia-smi's per-process memory, summed over this process and its descendants (the
runbook's kernel), sampled in a thread while the run goes on. Kept with the run's record, it is what a runbook's
header `gpu_memory_gib` (which the scheduler packs GPUs by, specbook.parallel) should say. Without nvidia-smi
nothing is sampled and the peak is None."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]


def used_mib() -> dict[int, float]:
    """MiB of GPU memory per process id, as nvidia-smi lists them ({} where it cannot)."""
    try:
        r = subprocess.run(QUERY, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {}
    out: dict[int, float] = {}
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        pid, _, mib = line.partition(",")
        try:
            out[int(pid)] = out.get(int(pid), 0.0) + float(mib)
        except ValueError:
            continue  # "[N/A]" and the like
    return out


def parents(proc: Path = Path("/proc")) -> dict[int, int]:
    """Each live process id's parent id, from /proc ({} without it)."""
    out = {}
    for d in proc.glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            out[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        except (OSError, ValueError, IndexError):
            continue
    return out


def descendants(root: int, parent_of: dict[int, int]) -> set[int]:
    """`root` and every process below it."""
    family, grew = {root}, True
    while grew:
        new = {p for p, pp in parent_of.items() if pp in family and p not in family}
        family |= new
        grew = bool(new)
    return family


class Peak:
    """Samples the GPU memory of this process's family every `every` seconds until stop(); `gib` is the most seen."""

    def __init__(self, every: float = 1.0, sample: Callable[[], dict[int, float]] = used_mib,
                 tree: Callable[[], dict[int, int]] = parents, pid: int | None = None):
        self.every, self.sample, self.tree, self.pid = every, sample, tree, pid or os.getpid()
        self.mib: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, **kw) -> Peak:
        """A running sampler where nvidia-smi exists and a GPU is visible; otherwise one that never samples."""
        peak = cls(**kw)
        if "sample" in kw or shutil.which("nvidia-smi") and os.environ.get("CUDA_VISIBLE_DEVICES", "0") != "":
            peak._thread = threading.Thread(target=peak._loop, daemon=True)
            peak._thread.start()
        return peak

    def poll(self) -> None:
        used = self.sample()
        if not used:
            return
        family = descendants(self.pid, self.tree())
        total = sum(m for p, m in used.items() if p in family)
        if total > 0:
            self.mib = max(self.mib or 0.0, total)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.poll()

    def stop(self) -> float | None:
        """Stop sampling; the peak in GiB (None: nothing seen)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        return None if self.mib is None else self.mib / 1024
