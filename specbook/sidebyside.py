"""Two trees' runs of one runbook side by side: how `verify` compares this tree with the recorded commit on a machine
without GPUs.

A shared CPU's pace moves by more than a timing's tolerance within a minute (other tenants of the host, its memory
traffic), so runs made one after another - A, then B - compare two moments as well as two engines. Here each tree
gets one child process that runs the runbook `runs` times, and the two children start each run together (a barrier
in this process: a notebook's start takes seconds more or less under load, and the streams would drift apart run by
run), so whatever the machine does meanwhile falls on both alike. Pair k is the two streams' k-th runs. Where the project's
engine keeps the timing lock (`[tool.specbook] timing_lock`, specbook.parallel) both streams' kernels are timers on
one lock: a timed section starts once the other stream waits to time too, and the two take turns, so A's and B's
measurements of one thing follow each other within seconds, and neither times while the other works. Without the
lock the streams run free. (On a GPU verify keeps to one run at a time: the recorded commit's engine may not keep
the lock there, and two runs on one GPU would time each other's kernels.)

`python -m specbook.sidebyside ROOT NAME PROFILE RUNS TAG` is one stream: before each run it writes `{"ready": k}`
and waits for a line on stdin; after it, one JSON line `{"metrics": {name: value}}` or `{"error": "..."}`; its log
on stderr.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

from specbook import SpecbookError, parallel, project

Metrics = dict[str, float]


def pairs(trees: tuple[Path, Path], name: str, profile: str, runs: int,
          log: Callable[[str], None]) -> list[tuple[Metrics | None, Metrics | None]]:
    """`runs` pairs (A's k-th run, B's k-th run) of runbook `name` on `profile`, A = trees[0]; None for a run that
    failed (its reason logged)."""
    results: dict[str, list[Metrics | None]] = {"A": [], "B": []}
    env = dict(os.environ)
    if project.settings(trees[1]).timing_lock:  # the engine keeps the timing lock: timed sections take turns
        lock = trees[1] / ".specbook" / "sidebyside.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        env.update({parallel.TIMING_LOCK_ENV: str(lock), parallel.TIMING_ROLE_ENV: "timer"})
    children = {tag: subprocess.Popen([sys.executable, "-m", "specbook.sidebyside", str(tree), name, profile,
                                       str(runs), tag], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env=env)
                for tag, tree in zip("AB", trees)}
    start_together = threading.Barrier(len(children))

    def go(tag: str) -> None:
        """Let a stream start its next run once the other is ready for its own (at once when the other has ended)."""
        try:
            start_together.wait()
        except threading.BrokenBarrierError:
            pass
        try:
            children[tag].stdin.write("go\n")
            children[tag].stdin.flush()
        except OSError:  # the child is gone: its reader sees the end of its output
            pass

    def read(tag: str) -> None:
        for line in children[tag].stdout:
            try:
                got = json.loads(line)
            except ValueError:
                continue  # not a result line (a stray print of the run's own code)
            if not isinstance(got, dict):
                continue
            if "ready" in got:
                go(tag)
                continue
            results[tag].append(got.get("metrics"))
            k = len(results[tag])
            log(f"{name} ({profile}): {tag} run {k} of {runs} " +
                ("done" if got.get("metrics") is not None else f"failed: {got.get('error')}"))
        start_together.abort()  # this stream has ended: the other runs on alone rather than wait for it

    readers = [threading.Thread(target=read, args=(tag,), daemon=True) for tag in children]
    try:
        for r in readers:
            r.start()
        for tag, child in children.items():
            if child.wait() != 0 and len(results[tag]) < runs:
                log(f"{name} ({profile}): the {tag} stream exited {child.returncode} after "
                    f"{len(results[tag])} of {runs} runs")
        for r in readers:
            r.join()
    finally:
        for child in children.values():  # an interrupt of verify: the children got it too (same process group)
            if child.poll() is None:
                child.kill()
    a, b = ([*results[t], *[None] * runs][:runs] for t in "AB")
    return list(zip(a, b))


def main(argv: list[str]) -> int:
    from specbook.execute import run, target  # imports the notebook machinery: only the child needs it

    root, name, profile, runs, tag = Path(argv[0]), argv[1], argv[2], int(argv[3]), argv[4]
    parallel.adopt_timing_lock()  # for the runbooks' kernels, as a child of verify on a GPU

    def log(msg: str) -> None:
        print(f"[{tag}] {msg}", file=sys.stderr, flush=True)

    try:
        t = target(root, name, profile)
    except SpecbookError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return e.exit_code
    for k in range(1, runs + 1):
        print(json.dumps({"ready": k}), flush=True)
        if not sys.stdin.readline():  # verify has gone
            return 1
        try:
            outcome = run(root, t, record=False, fresh=True, progress=False, log=log)[-1]
            line = {"metrics": {m.name: m.value for m in outcome.execution.metrics}}
        except SpecbookError as e:  # RunFailed, or the run could not start (its outputs, a dependency)
            line = {"error": str(e)}
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
