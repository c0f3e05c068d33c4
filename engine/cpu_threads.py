"""How many torch threads a CPU run of the engine takes: one per physical core that other processes leave free.

Intra-op threads on cores that other processes keep busy wait for each other: a small model's decode then runs many
times slower than on one thread (each step's threads meet at a barrier every op, and a descheduled one stalls the
rest). So, as llama.cpp takes one thread per physical core, the engine takes one per physical core of its affinity
mask, less the cores other processes used over a short look at the kernel's counters (/proc/stat), at least one.
`--threads N` (generate, bench) or OMP_NUM_THREADS decide instead. Linux reads the load; elsewhere the physical
cores decide. No torch at import time; only engine/__main__.py imports it (no runbook hashes it).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

SAMPLE_S = 0.2  # how long to watch the other processes before choosing
_STAT = Path("/proc/stat")
_CPUS = Path("/sys/devices/system/cpu")


def allowed_cpus() -> set[int]:
    """The cores this process may run on (its affinity mask; all of them where the OS has none)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: Iterable[int], topology: Path = _CPUS) -> int:
    """Physical cores among `cpus` (hyperthread siblings count once); the CPU count where sysfs does not say."""
    cpus = list(cpus)
    cores = set()
    for c in cpus:
        try:
            cores.add((topology / f"cpu{c}" / "topology" / "core_cpus_list").read_text().strip())
        except OSError:
            try:
                cores.add((topology / f"cpu{c}" / "topology" / "thread_siblings_list").read_text().strip())
            except OSError:
                return len(cpus)
    return len(cores) or len(cpus)


def _busy_ticks(cpus: set[int], stat: Path) -> tuple[int, int] | None:
    """(busy, total) ticks of `cpus` since boot from the per-core lines of /proc/stat; None without them."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy = total = seen = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal: idle and iowait are free time
        ticks = [int(x) for x in fields[:8]]
        busy += sum(ticks) - ticks[3] - ticks[4]
        total += sum(ticks)
        seen += 1
    return (busy, total) if seen else None


def busy_cores(cpus: set[int], sample_s: float = SAMPLE_S, stat: Path = _STAT,
               sleep: Callable[[float], None] = time.sleep) -> float | None:
    """How many of `cpus` other processes keep busy, over `sample_s` (this process sleeps meanwhile, so all the
    busy time is theirs); None where the kernel's counters cannot be read."""
    before = _busy_ticks(cpus, stat)
    sleep(sample_s)
    after = _busy_ticks(cpus, stat)
    if before is None or after is None or after[1] <= before[1]:
        return None
    return len(cpus) * (after[0] - before[0]) / (after[1] - before[1])


def choose(n_cpus: int, physical: int, busy: float | None) -> int:
    """One thread per physical core, less the cores others keep busy (a core counts as taken from half busy on),
    at least one."""
    free = physical if busy is None else min(physical, n_cpus - busy)
    return max(1, min(physical, int(free + 0.5)))


def auto_threads() -> int:
    """The thread count for this machine as it is now."""
    cpus = allowed_cpus()
    return choose(len(cpus), physical_cores(cpus), busy_cores(cpus))


def set_threads(requested: int | None, device: str) -> tuple[int, str]:
    """Set torch's intra-op threads for a run on `device` and say where the count came from: `requested` (the
    --threads option), else OMP_NUM_THREADS (torch read it at start), else on a CPU the free physical cores; on a
    GPU the host threads matter little and torch's default stays."""
    import torch

    if requested:
        torch.set_num_threads(requested)
        return requested, "--threads"
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), "OMP_NUM_THREADS"
    if not device.startswith("cpu"):
        return torch.get_num_threads(), "torch's default"
    n = auto_threads()
    torch.set_num_threads(n)
    return n, "free cores"
