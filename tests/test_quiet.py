"""engine.quiet, the engine's side of the timing lock: timed sections have the device to themselves while background
processes (training, accept lengths) share it the rest of the time. Processes on the CPU stand in for a GPU's users:
the protocol is the same, only the device sync is empty."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine import quiet
from engine.errors import EngineError
from specbook.verify import FRESH, verify
from specbook_testing import cli, make_repo, runbook_text

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock(2) is POSIX")

SPANS = """
import json, sys, time
from engine import quiet

def span(kind, seconds):
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:  # busy, as device work keeps its process busy
        pass
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps([kind, t0, time.monotonic()]) + "\\n")
"""


def start(script: str, log: Path, lock: Path | None, role: str, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(quiet.ROLE_ENV) and k != quiet.LOCK_ENV}
    if lock is not None:
        env.update({quiet.LOCK_ENV: str(lock), quiet.ROLE_ENV: role})
    code = SPANS + textwrap.dedent(script)
    return subprocess.Popen([sys.executable, "-c", code, str(log), *args], env=env)


BACKGROUND = """
for _ in range(int(sys.argv[2])):
    quiet.yield_point()
    span("work", 0.02)
"""
TIMER = """
for _ in range(int(sys.argv[2])):
    span("untimed", 0.05)
    with quiet.timed():
        span("timed", 0.06)
"""


def spans(log: Path) -> dict[str, list[tuple[float, float]]]:
    import json

    out: dict[str, list[tuple[float, float]]] = {}
    for line in log.read_text().splitlines():
        kind, a, b = json.loads(line)
        out.setdefault(kind, []).append((a, b))
    return out


def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def lock_files(tmp_path: Path) -> Path:
    lock = tmp_path / "gpu-0.timing.lock"
    lock.touch()
    for suffix in (".turn", ".timers", ".queue"):
        lock.with_name(lock.name + suffix).touch()
    return lock


def test_timed_sections_exclude_background_work_which_runs_the_rest_of_the_time(tmp_path):
    lock, log = lock_files(tmp_path), tmp_path / "spans"
    procs = [start(BACKGROUND, log, lock, "background", "60") for _ in range(2)]
    procs.append(start(TIMER, log, lock, "timer", "6"))
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    s = spans(log)
    assert len(s["timed"]) == 6 and len(s["work"]) == 120  # nobody starved
    assert not [(t, w) for t in s["timed"] for w in s["work"] if overlaps(t, w)]
    # and the background worked while the timer did its untimed part: the overlap the lock is for
    assert any(overlaps(u, w) for u in s["untimed"] for w in s["work"])


NAMED_TIMER = """
me = sys.argv[3]
for _ in range(int(sys.argv[2])):
    span("untimed " + me, 0.05)
    with quiet.timed():
        span("timed " + me, 0.04)
"""


def test_two_timers_take_turns_at_timing_and_share_the_rest(tmp_path):
    """Two timing runbooks on one device: neither times while the other works, timed or not, or the background
    does; their untimed parts (compiles, captures) overlap each other's and the background's."""
    lock, log = lock_files(tmp_path), tmp_path / "spans"
    procs = [start(NAMED_TIMER, log, lock, "timer", "8", me) for me in "ab"]
    procs.append(start(BACKGROUND, log, lock, "background", "60"))
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    s = spans(log)
    assert [len(s[f"timed {me}"]) for me in "ab"] == [8, 8] and len(s["work"]) == 60
    for me, other in ("ab", "ba"):
        busy = s[f"timed {other}"] + s[f"untimed {other}"] + s["work"]
        assert not [(t, w) for t in s[f"timed {me}"] for w in busy if overlaps(t, w)]
    assert any(overlaps(u, v) for u in s["untimed a"] for v in s["untimed b"])


def compiling_timer(ready: Path, seconds: float) -> str:
    """Timer b: holds, says so in `ready`, works untimed for `seconds` (a compile), then times a section."""
    return f"""
    quiet.hold()
    open({str(ready)!r}, "w").close()
    span("untimed b", {seconds})
    with quiet.timed():
        span("timed b", 0.05)
    """


def asking_timer(ready: Path, me: str) -> str:
    """Timer `me`: holds, waits until b holds, then asks to time a section."""
    return f"""
    import os
    quiet.hold()
    while not os.path.exists({str(ready)!r}):
        time.sleep(0.01)
    span("asks {me}", 0.0)
    with quiet.timed():
        span("timed {me}", 0.05)
    """


def test_a_timer_waiting_for_another_ones_untimed_work_does_not_stop_the_background(tmp_path):
    """Timer b compiles (untimed, no yield points: a torch.compile or a capture) when timer a asks to time. a waits
    for b to finish that work, and the background goes on meanwhile: a waiting timer does not hold the turnstile, or
    every training step beside it would stop for as long as b's compile lasts."""
    lock, log, ready = lock_files(tmp_path), tmp_path / "spans", tmp_path / "b-holds"
    procs = [start(compiling_timer(ready, 1.5), log, lock, "timer"),
             start(asking_timer(ready, "a"), log, lock, "timer"),
             start(BACKGROUND, log, lock, "background", "120")]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    s = spans(log)
    (asked, _), (_, compiled) = s["asks a"][0], s["untimed b"][0]
    assert s["timed a"][0][0] >= compiled  # a timed only once b's untimed work was done
    assert [w for w in s["work"] if asked + 0.1 < w[0] and w[1] < compiled]  # ... and the background went on


def test_timers_time_in_the_order_they_asked(tmp_path):
    """Timer d asks while timer b compiles (untimed); then b asks too. d times first: it was first in the queue. d is
    stopped from just after it asked until after b asked, so that d cannot win by being quick when b's compile
    ends: the order must come from the lock, or d would wait out b's section and b's next compile too."""
    lock, log, b_holds = lock_files(tmp_path), tmp_path / "spans", tmp_path / "b-holds"
    b = start(compiling_timer(b_holds, 1.0), log, lock, "timer")
    d = start(asking_timer(b_holds, "d"), log, lock, "timer")
    deadline = time.monotonic() + 30
    while not (log.exists() and "asks d" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # d waits for b's compile to end
    os.kill(d.pid, signal.SIGSTOP)
    while "untimed b" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # b has asked
    os.kill(d.pid, signal.SIGCONT)
    assert [b.wait(timeout=30), d.wait(timeout=30)] == [0, 0]
    s = spans(log)
    assert s["timed d"][0][1] <= s["timed b"][0][0], "b timed first, though d asked first"


def test_without_the_lock_the_same_processes_overlap(tmp_path):
    """The check above can fail: with the variables unset nothing is exclusive, and timed sections meet work."""
    log = tmp_path / "spans"
    procs = [start(BACKGROUND, log, None, "background", "60"), start(TIMER, log, None, "timer", "6")]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    s = spans(log)
    assert any(overlaps(t, w) for t in s["timed"] for w in s["work"])


def test_a_background_process_that_starts_during_a_timed_section_waits_for_its_end(tmp_path):
    lock, log = lock_files(tmp_path), tmp_path / "spans"
    timer = start("with quiet.timed():\n    span('timed', 1.0)\n", log, lock, "timer")
    time.sleep(0.3)  # the timer is inside its section
    late = start("import engine\nspan('work', 0.01)\n", log, lock, "background")  # holds from its import on
    assert [timer.wait(timeout=30), late.wait(timeout=30)] == [0, 0]
    s = spans(log)
    assert s["work"][0][0] >= s["timed"][0][1]


def test_nested_timed_sections_hold_until_the_outermost_ends(tmp_path):
    lock, log = lock_files(tmp_path), tmp_path / "spans"
    script = """
    with quiet.timed():
        with quiet.timed():
            span("inner", 0.05)
        span("timed", 0.5)  # still held: the inner section's end let nothing go
    """
    timer = start(script, log, lock, "timer")
    time.sleep(0.1)
    bg = start(BACKGROUND, log, lock, "background", "5")
    assert [timer.wait(timeout=30), bg.wait(timeout=30)] == [0, 0]
    s = spans(log)
    assert min(w[0] for w in s["work"]) >= s["timed"][0][1]


def test_a_timer_that_dies_in_its_section_blocks_no_one(tmp_path):
    lock, log = lock_files(tmp_path), tmp_path / "spans"
    timer = start("import os\nwith quiet.timed():\n    os._exit(9)\n", log, lock, "timer")
    assert timer.wait(timeout=30) == 9
    bg = start(BACKGROUND, log, lock, "background", "3")
    assert bg.wait(timeout=30) == 0 and len(spans(log)["work"]) == 3


def test_processes_a_background_process_starts_take_no_lock_of_their_own(tmp_path):
    """A child started by a background process is part of its work: were it to hold the device too, it would hold
    it until it ended, never yielding. It runs while its parent holds the device, so it needs no lock."""
    lock, log = lock_files(tmp_path), tmp_path / "spans"
    script = """
    import subprocess
    quiet.hold()
    child = "import sys; from engine import quiet; print(quiet._mine() is None)"
    print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip())
    """
    env_out = subprocess.run([sys.executable, "-c", SPANS + textwrap.dedent(script), str(log)], capture_output=True,
                             text=True, timeout=60, env={**os.environ, quiet.LOCK_ENV: str(lock),
                                                         quiet.ROLE_ENV: "background"})
    assert env_out.returncode == 0, env_out.stderr
    assert env_out.stdout.strip() == "True"


def test_without_the_variables_nothing_happens(monkeypatch):
    monkeypatch.delenv(quiet.LOCK_ENV, raising=False)
    monkeypatch.setattr(quiet, "_locks", None)
    with quiet.timed():
        quiet.yield_point()
    assert quiet._locks is None


@pytest.mark.parametrize("role, path, message", [
    ("referee", None, "the timing role is one of timer, background"),
    ("timer", "/nonexistent/dir/gpu.lock", "cannot open the timing lock"),
])
def test_a_bad_role_or_path_is_one_clear_error(tmp_path, monkeypatch, role, path, message):
    monkeypatch.setenv(quiet.LOCK_ENV, path or str(lock_files(tmp_path)))
    monkeypatch.setenv(quiet.ROLE_ENV, role)
    monkeypatch.delenv(quiet.OWNER_ENV, raising=False)
    monkeypatch.setattr(quiet, "_locks", None)
    with pytest.raises(EngineError, match=message):
        quiet.yield_point()


def test_verify_runs_exact_runbooks_beside_a_timing_one_and_its_timings_stay_quiet(tmp_path):
    """End to end on one (pretend) GPU: a verify with the timing lock starts the exact runbook beside the timing
    one; the exact one's steps go on while the timing one does its untimed work and never inside its timed
    sections, and both verify fresh."""
    log = tmp_path / "spans"
    spans_code = SPANS.replace("sys.argv[1]", "log")
    timing = runbook_text(params=f"log = {str(log)!r}", body=spans_code + textwrap.dedent("""
        for _ in range(4):
            span("untimed", 0.3)
            with quiet.timed():
                span("timed", 0.2)
        record("x", 1.0, unit="u", direction="higher", rel_tol=0.1)
    """))
    exact = runbook_text(params=f"log = {str(log)!r}", body=spans_code + textwrap.dedent("""
        for _ in range(150):
            quiet.yield_point()
            span("work", 0.02)
        record("y", 3, unit="n", direction="none", kind="exact")
    """))
    root = make_repo(tmp_path / "repo", timing=timing, exact=exact)
    for name in ("timing", "exact"):
        assert cli(root, "run", name, "--record").exit_code == 0
    pyproject = root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + "timing_lock = true\n")
    log.unlink()
    lines: list[str] = []
    vs = verify(root, "cpu", progress=False, log=lines.append, gpus=["0"])
    assert [v.state for v in vs] == [FRESH, FRESH], lines
    assert any("while it times (the timing lock)" in line for line in lines), lines
    s = spans(log)
    assert len(s["timed"]) == 4 and len(s["work"]) == 150
    assert not [(t, w) for t in s["timed"] for w in s["work"] if overlaps(t, w)]
    assert any(overlaps(u, w) for u in s["untimed"] for w in s["work"])
