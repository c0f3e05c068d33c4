"""How busy the machine was, apart from this process and its children, while a run took place.

A timing recorded while other processes shared the CPU measures the load as well as the engine, and a record that is
off hides a real slowdown inside its tolerance (docs/findings.md, section 17). `Others` reads the kernel's CPU counters
(/proc/stat: every core's busy time) and this process's own and reaped children's CPU time (os.times) before and
after; the difference is what the rest of the machine used, as a share of the cores over the wall time. Linux only;
elsewhere it reports nothing.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

BUSY_SHARE = 0.10  # above this share of the cores taken by others, a run's timings are not recorded
ALLOW_BUSY_ENV = "SPECBOOK_ALLOW_BUSY"  # "1": record anyway (a machine that is never quiet; the share is kept)
_STAT = Path("/proc/stat")


def _busy_s() -> float | None:
    """Seconds every core of the machine spent busy since boot; None without /proc/stat."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal ...: the processes of this machine are user to softirq less idle
    # and iowait; steal (a hypervisor's other guests) is left out, and guest time is already counted in user
    ticks = [int(x) for x in fields[1:8]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class Others:
    """Started when the run starts; `share()` once its children have been reaped."""
    busy0: float | None
    own0: float
    wall0: float

    @classmethod
    def start(cls) -> Others:
        return cls(_busy_s(), _own_s(), time.monotonic())

    def share(self) -> float | None:
        """Share of the machine's cores that other processes used since start (0..1), or None where unknown."""
        busy = _busy_s()
        wall = time.monotonic() - self.wall0
        if busy is None or self.busy0 is None or wall <= 0:
            return None
        others = (busy - self.busy0) - (_own_s() - self.own0)
        return min(1.0, max(0.0, others / (wall * (os.cpu_count() or 1))))


def allowed() -> bool:
    return os.environ.get(ALLOW_BUSY_ENV) == "1"
