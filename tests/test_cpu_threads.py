"""engine.cpu_threads: a CPU run takes the physical cores other processes leave free; generate and bench take
--threads and say how many threads ran."""
import json

import pytest
import torch

from engine import cpu_threads
from engine_cli_testing import run

pytestmark = pytest.mark.usefixtures("one_thread")  # restores torch's thread count after the CLI set it


@pytest.mark.parametrize("n_cpus, physical, busy, expect", [
    (2, 2, 0.0, 2),    # a quiet 2-core machine: both
    (2, 2, 1.9, 1),    # two other processes busy: one thread, never zero
    (2, 2, 2.0, 1),
    (2, 2, 0.9, 1),    # one core taken
    (8, 4, 0.0, 4),    # hyperthreads: one per physical core
    (8, 4, 6.0, 2),
    (4, 4, None, 4),   # load unknown: the physical cores
])
def test_threads_are_the_free_physical_cores(n_cpus, physical, busy, expect):
    assert cpu_threads.choose(n_cpus, physical, busy) == expect


def _stat(cpus: dict[int, tuple[int, int]]) -> str:
    """A /proc/stat with per-core (busy user ticks, idle ticks)."""
    total = [sum(b for b, _ in cpus.values()), sum(i for _, i in cpus.values())]
    lines = [f"cpu {total[0]} 0 0 {total[1]} 0 0 0 0 0 0"]
    lines += [f"cpu{c} {b} 0 0 {i} 0 0 0 0 0 0" for c, (b, i) in cpus.items()]
    return "\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n"


def test_busy_cores_counts_only_the_allowed_cores_over_the_sample(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(_stat({0: (100, 100), 1: (100, 100), 2: (0, 0)}))

    def later(_s: float) -> None:  # core 0 fully busy, core 1 idle, core 2 (not ours) busy
        stat.write_text(_stat({0: (200, 100), 1: (100, 200), 2: (100, 0)}))

    assert cpu_threads.busy_cores({0, 1}, stat=stat, sleep=later) == pytest.approx(1.0)
    assert cpu_threads.busy_cores({0, 1}, stat=tmp_path / "missing", sleep=lambda s: None) is None


def test_physical_cores_counts_hyperthread_siblings_once(tmp_path):
    for cpu, core in ((0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3")):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "core_cpus_list").write_text(core + "\n")
    assert cpu_threads.physical_cores({0, 1, 2, 3}, tmp_path) == 2
    assert cpu_threads.physical_cores({0, 1}, tmp_path / "none") == 2  # no sysfs: the CPU count


def test_generate_takes_threads_and_says_how_many_ran():
    r = run("generate", "--shape", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "2", "--threads", "1")
    assert r.exit_code == 0, r.stderr
    assert "1 thread (--threads)" in r.stderr.splitlines()[-1]
    r = run("generate", "--shape", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "2", "--threads", "1", "--json")
    out = json.loads(r.stdout)
    assert out["threads"] == 1 and out["threads_from"] == "--threads"


def test_generate_on_a_busy_cpu_takes_one_thread(monkeypatch):
    """Both cores kept busy by others: one thread, where torch's default would take both and stall."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: {0, 1})
    monkeypatch.setattr(cpu_threads, "physical_cores", lambda cpus: 2)
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda cpus: 1.9)
    torch.set_num_threads(2)
    r = run("generate", "--shape", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "2", "--device", "cpu",
            "--json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["threads"], out["threads_from"]) == (1, "free cores") and torch.get_num_threads() == 1


def test_bench_says_how_many_threads_ran():
    args = ["bench", "--shape", "tiny", "--prompt-len", "4", "--new-tokens", "4", "--repeats", "1", "--sizes", "1",
            "--no-peer", "--no-eager", "--max-seq-len", "32", "--threads", "1"]
    r = run(*args, "--json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["threads"] == 1 and out["threads_from"] == "--threads"
    assert "1 thread (--threads)" in run(*args).stdout.splitlines()[0]


def test_threads_below_one_is_bad_input():
    r = run("generate", "--shape", "tiny", "--prompt-ids", "1", "--threads", "0")
    assert r.exit_code == 2 and "--threads" in r.stderr
