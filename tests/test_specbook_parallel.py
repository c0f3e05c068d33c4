"""Spreading `runbook verify` over GPUs: the scheduler's order, and verdicts merged from child processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from specbook.parallel import Job, chain_lengths, estimate, schedule
from specbook.verify import FRESH, verify
from specbook_testing import cli, make_repo, runbook_text, write_runbook


def _job(name: str, *after: str) -> Job:
    return Job(name, "h200", frozenset(f"{a}/h200" for a in after))


def test_chain_lengths_count_the_longest_chain_of_dependents():
    jobs = [_job("target"), _job("drafter", "target"), _job("eagle", "drafter"), _job("probe", "drafter"),
            _job("decode")]
    assert chain_lengths(jobs) == {"target/h200": 3, "drafter/h200": 2, "eagle/h200": 1, "probe/h200": 1,
                                   "decode/h200": 1}


def test_schedule_runs_dependencies_first_and_one_job_per_slot(tmp_path):
    log = tmp_path / "events"
    jobs = [_job("decode"), _job("eagle", "drafter"), _job("drafter", "target"), _job("target"), _job("cost")]

    def start(job: Job, slot: str) -> subprocess.Popen:
        code = ("import sys, time; f = open(sys.argv[1], 'a'); f.write(f'start {sys.argv[2]} {sys.argv[3]} "
                "{time.monotonic()}\\n'); f.flush(); time.sleep(0.4); f.write(f'end {sys.argv[2]} {sys.argv[3]} "
                "{time.monotonic()}\\n')")
        return subprocess.Popen([sys.executable, "-c", code, str(log), job.name, slot])

    t0 = time.monotonic()
    done = schedule(jobs, ["0", "1"], start, log=lambda m: None, poll_s=0.02)
    wall = time.monotonic() - t0
    assert sorted(f.job.name for f in done) == ["cost", "decode", "drafter", "eagle", "target"]
    assert all(f.returncode == 0 for f in done)
    events = [line.split() for line in log.read_text().splitlines()]
    at = {(kind, name): float(t) for kind, name, _, t in events}
    assert at[("start", "drafter")] >= at[("end", "target")]
    assert at[("start", "eagle")] >= at[("end", "drafter")]
    by_slot: dict[str, list[tuple[float, float]]] = {}
    for kind, name, slot, _ in events:
        if kind == "start":
            by_slot.setdefault(slot, []).append((at[("start", name)], at[("end", name)]))
    for spans in by_slot.values():  # a slot never runs two jobs at once
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert set(by_slot) == {"0", "1"}
    assert wall < 5 * 0.4  # five jobs of 0.4 s on two slots overlap: the chain of three bounds it


def test_verify_on_several_gpus_merges_the_children_verdicts(tmp_path):
    root = make_repo(tmp_path, up=runbook_text(), down=runbook_text(extra_header="depends: [up]"),
                     other=runbook_text(body='record("y", 3, unit="n", direction="none", kind="exact")'))
    for name in ("down", "other"):
        assert cli(root, "run", name, "--record").exit_code == 0
    lines: list[str] = []
    vs = verify(root, "cpu", progress=False, log=lines.append, gpus=["0", "1"])
    assert {(v.runbook, v.metric): v.state for v in vs} == {("up", "x"): FRESH, ("down", "x"): FRESH,
                                                            ("other", "y"): FRESH}
    assert all(v.measured is not None for v in vs)
    assert any("re-measuring 3 runbooks on 2 GPU(s)" in line for line in lines)
    starts = [line for line in lines if line.endswith(": started")]
    assert starts[0].endswith("up/cpu: started") or starts[1].endswith("up/cpu: started")
    assert not any(line.endswith("down/cpu: started") for line in starts[:2])  # down waits for up


def test_gpus_beyond_the_visible_ones_are_bad_input(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    root = make_repo(tmp_path, a=runbook_text())
    r = cli(root, "verify", "--gpus", "3")
    assert r.exit_code == 2 and "--gpus 3: this machine has 2 visible GPU(s)" in r.stderr
    r = cli(root, "verify", "--gpus", "0,7")
    assert r.exit_code == 2 and "not among the visible GPUs (0,1)" in r.stderr


def test_exact_only_jobs_share_a_slot_and_a_timing_job_has_its_slot_to_itself(tmp_path):
    """On one GPU: three jobs whose numbers are exact run together; a timing job never overlaps another job."""
    log = tmp_path / "events"
    jobs = [Job("t1", "h200", frozenset()), Job("t2", "h200", frozenset()),
            Job("a", "h200", frozenset(), exclusive=False), Job("b", "h200", frozenset(), exclusive=False),
            Job("c", "h200", frozenset(), exclusive=False), Job("d", "h200", frozenset(), exclusive=False)]

    def start(job: Job, slot: str) -> subprocess.Popen:
        code = ("import sys, time; f = open(sys.argv[1], 'a'); f.write(f'start {sys.argv[2]} {time.monotonic()}\\n');"
                " f.flush(); time.sleep(0.3); f.write(f'end {sys.argv[2]} {time.monotonic()}\\n')")
        return subprocess.Popen([sys.executable, "-c", code, str(log), job.name])

    done = schedule(jobs, ["0"], start, log=lambda m: None, poll_s=0.01, share=3)
    assert sorted(f.job.name for f in done) == ["a", "b", "c", "d", "t1", "t2"]
    at = {(kind, name): float(t) for kind, name, t in (line.split() for line in log.read_text().splitlines())}
    span = {n: (at["start", n], at["end", n]) for n in ("a", "b", "c", "d", "t1", "t2")}

    def overlap(x: str, y: str) -> bool:
        return span[x][0] < span[y][1] and span[y][0] < span[x][1]

    for t in ("t1", "t2"):
        assert not any(overlap(t, o) for o in span if o != t)
    at_once = [sum(span[n][0] <= span[x][0] < span[n][1] for n in "abcd") for x in "abcd"]
    assert max(at_once) == 3  # shared, and SHARE caps it at three


def test_one_gpu_shares_itself_among_runbooks_whose_numbers_are_exact(tmp_path):
    exact = 'record("y", 3, unit="n", direction="none", kind="exact")'
    root = make_repo(tmp_path, one=runbook_text(body=exact), two=runbook_text(body=exact))
    for name in ("one", "two"):
        assert cli(root, "run", name, "--record").exit_code == 0
    lines: list[str] = []
    vs = verify(root, "cpu", progress=False, log=lines.append, gpus=["0"])
    assert [v.state for v in vs] == [FRESH, FRESH]
    assert any("re-measuring 2 runbooks on 1 GPU(s)" in line for line in lines)
    lines.clear()
    timing = make_repo(tmp_path / "timing", one=runbook_text(), two=runbook_text())  # noisy numbers: one at a time
    for name in ("one", "two"):
        assert cli(timing, "run", name, "--record").exit_code == 0
    verify(timing, "cpu", progress=False, log=lines.append, gpus=["0"])
    assert not any("re-measuring" in line for line in lines)


def test_estimate_simulates_the_schedule():
    """Hand-computed: one GPU, two timing jobs of 10 s, a training chain target (4 s) -> drafter (6 s), and two
    exact jobs of 5 s after the drafter. The chain goes first (longest), the exact jobs overlap, the timing jobs
    run alone: 4 + 6 + 5 + 10 + 10 = 35 s. On two GPUs the timing jobs run beside the chain: max(4 + 6 + 5, 20)."""
    e = lambda *a: frozenset(f"{x}/h200" for x in a)  # noqa: E731
    jobs = [Job("t1", "h200", e()), Job("t2", "h200", e()), Job("target", "h200", e(), exclusive=False),
            Job("drafter", "h200", e("target"), exclusive=False), Job("a", "h200", e("drafter"), exclusive=False),
            Job("b", "h200", e("drafter"), exclusive=False)]
    secs = {"t1/h200": 10, "t2/h200": 10, "target/h200": 4, "drafter/h200": 6, "a/h200": 5, "b/h200": 5}
    assert estimate(jobs, ["0"], secs, share=3) == 35
    assert estimate(jobs, ["0"], secs, share=1) == 40  # nothing shares: a and b one after the other
    assert estimate(jobs, ["0", "1"], secs, share=3) == 20
    assert estimate(jobs, ["0"], {}, share=3) == 0  # unknown durations count as nothing


def test_verify_plan_lists_what_would_run_and_runs_nothing(tmp_path):
    exact = 'record("y", 3, unit="n", direction="none", kind="exact")'
    root = make_repo(tmp_path, up=runbook_text(body=exact), down=runbook_text(extra_header="depends: [up]"))
    assert cli(root, "run", "down", "--record").exit_code == 0
    runs_before = sorted((root / ".specbook").rglob("*"))
    r = cli(root, "verify", "--plan", "--gpus", "2", "--json")
    assert r.exit_code == 0, r.output
    import json

    d = json.loads(r.stdout)
    by_name = {x["runbook"]: x for x in d["plan"]}
    assert set(by_name) == {"up", "down"} and by_name["down"]["after"] == ["up"]
    assert by_name["up"]["shares_gpu"] and not by_name["down"]["shares_gpu"]
    assert all(x["seconds"] is not None and x["seconds"] >= 0 for x in d["plan"])
    assert d["sum_s"] == sum(x["seconds"] for x in d["plan"]) and d["gpus"] == ["0", "1"]
    assert sorted((root / ".specbook").rglob("*")) == runs_before  # nothing ran
    assert cli(root, "verify", "--plan", "--gpus", ",").exit_code == 2
    # the records keep each run's wall time, which is what the plan adds up; an older record without it falls
    # back to its executed notebook's cell time, and says so
    rec = yaml.safe_load((root / "baselines" / "up.yaml").read_text())
    run = rec["profiles"]["cpu"]["runs"][-1]
    assert by_name["up"]["timed"] == "run" and by_name["up"]["seconds"] == run["seconds"] > 0
    del run["seconds"]
    (root / "baselines" / "up.yaml").write_text(yaml.safe_dump(rec))
    r = cli(root, "verify", "--plan")
    assert r.exit_code == 0 and "(cells)" in r.stdout and "up" in r.stdout.split("(cells):")[1]
    assert "(stale)" not in r.stdout and not any(x["stale"] for x in d["plan"])
    # a record made with other code: its time is that run's, which the plan says beside it (down, downstream of
    # up, is stale with it)
    write_runbook(root, "up", runbook_text(body=exact.replace("3", "4")))
    d = json.loads(cli(root, "verify", "--plan", "--json").stdout)
    assert {x["runbook"]: x["stale"] for x in d["plan"]} == {"up": True, "down": True}
    assert "(stale)" in cli(root, "verify", "--plan").stdout


def test_verify_plan_of_a_variant_profile_plans_for_its_machine(tmp_path):
    """`--plan --profile cpu.v` plans what a verify of the variant would re-run on a cpu machine (the variant's
    records run there); it used to compare the variant's name with itself as the machine and plan nothing."""
    root = make_repo(tmp_path, one=runbook_text(profiles="{cpu: {}, cpu.v: {value: 2.0}}"))
    assert cli(root, "run", "one", "--record", "--profile", "cpu.v").exit_code == 0
    import json

    r = cli(root, "verify", "--plan", "--profile", "cpu.v", "--json")
    assert r.exit_code == 0, r.output
    assert [(x["runbook"], x["profile"]) for x in json.loads(r.stdout)["plan"]] == [("one", "cpu.v")]


def _spans(jobs: list[Job], lock: bool, share: int = 3) -> dict[str, tuple[float, float]]:
    """When each job ran under `schedule` on one slot (each job a 0.3 s sleep), from its own log lines."""
    import tempfile

    log = Path(tempfile.mkdtemp()) / "events"

    def start(job: Job, slot: str) -> subprocess.Popen:
        code = ("import sys, time; f = open(sys.argv[1], 'a'); t0 = time.monotonic(); time.sleep(0.3); "
                "f.write(f'{sys.argv[2]} {t0} {time.monotonic()}\\n')")
        return subprocess.Popen([sys.executable, "-c", code, str(log), job.name])

    done = schedule(jobs, ["0"], start, log=lambda m: None, poll_s=0.02, share=share, lock=lock)
    assert all(f.returncode == 0 for f in done)
    return {name: (float(a), float(b)) for name, a, b in (line.split() for line in log.read_text().splitlines())}


def test_with_the_timing_lock_jobs_share_a_gpu_and_without_it_timing_jobs_have_it_to_themselves():
    jobs = [Job("t1", "h200", frozenset()), Job("t2", "h200", frozenset()),
            Job("target", "h200", frozenset(), exclusive=False),
            Job("drafter", "h200", frozenset({"target/h200"}), exclusive=False)]

    def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return a[0] < b[1] and b[0] < a[1]

    locked = _spans(jobs, lock=True)
    assert overlap(locked["t1"], locked["t2"])  # their timed sections take turns (engine.quiet)
    assert any(overlap(locked[t], locked[e]) for t in ("t1", "t2") for e in ("target", "drafter"))
    unlocked = _spans(jobs, lock=False)
    assert not any(overlap(unlocked[a], unlocked[b]) for a in ("t1", "t2") for b in unlocked if b != a)


def test_estimate_with_the_timing_lock():
    """Hand-computed, one GPU: the chain target (4 s) -> drafter (6 s) -> a, b (6 s each) and two timing jobs of
    10 s. With the lock t1 and t2 run beside the chain from the start (target 0-4, drafter 4-10), a and b after it
    (10-16): 16 s; with one exact job at a time b waits for a: 22 s. Without it the chain goes first, then t1, t2,
    and a and b last: 4 + 6 + 10 + 10 + 6 = 36 s. Three timing jobs with the lock: the third waits for a slot (20)."""
    e = lambda *a: frozenset(f"{x}/h200" for x in a)  # noqa: E731
    jobs = [Job("t1", "h200", e()), Job("t2", "h200", e()), Job("target", "h200", e(), exclusive=False),
            Job("drafter", "h200", e("target"), exclusive=False), Job("a", "h200", e("drafter"), exclusive=False),
            Job("b", "h200", e("drafter"), exclusive=False)]
    secs = {"t1/h200": 10, "t2/h200": 10, "target/h200": 4, "drafter/h200": 6, "a/h200": 6, "b/h200": 6}
    assert estimate(jobs, ["0"], secs, share=3, lock=True) == 16
    assert estimate([*jobs, Job("t3", "h200", e())], ["0"], {**secs, "t3/h200": 10}, share=3, lock=True) == 20
    assert estimate(jobs, ["0"], secs, share=1, lock=True) == 22
    assert estimate(jobs, ["0"], secs, share=3, lock=False) == 36


def test_children_get_their_gpus_lock_and_role(tmp_path, monkeypatch):
    from specbook import parallel

    seen: list[dict] = []

    class Proc:
        stderr = iter(())

        def __init__(self, argv, env, **kw):
            seen.append(env)

    monkeypatch.setattr(parallel.subprocess, "Popen", Proc)
    start = parallel.verify_child(tmp_path, tmp_path / "scratch", log=lambda m: None, lock=True)
    start(Job("t", "h200", frozenset()), "1")
    start(Job("e", "h200", frozenset(), exclusive=False), "1")
    lock = tmp_path / "scratch" / "gpu-1.timing.lock"
    assert [(env[parallel.TIMING_LOCK_ENV], env[parallel.TIMING_ROLE_ENV], env["CUDA_VISIBLE_DEVICES"])
            for env in seen] == [(str(lock), "timer", "1"), (str(lock), "background", "1")]
    assert lock.exists() and lock.with_name(lock.name + ".turn").exists()  # made before the children open them
    seen.clear()
    parallel.record_child(tmp_path, tmp_path / "scratch", log=lambda m: None)(Job("t", "h200", frozenset()), "0")
    assert parallel.TIMING_LOCK_ENV not in seen[0] and parallel.TIMING_ROLE_ENV not in seen[0]  # no lock: no variables


def test_a_child_keeps_the_lock_for_its_kernels_and_can_hold_the_gpu_itself(tmp_path, monkeypatch):
    """adopt_timing_lock takes the variables out of the child's own environment (it does no device work) and hands
    them to its kernels; inside exclusive() a timer holds the GPU itself - a background holder is let in only
    after it - and its kernels get no variables (they would wait for the lock their parent holds)."""
    from specbook import parallel

    lock = parallel.lock_file(tmp_path, "0")
    monkeypatch.setenv(parallel.TIMING_LOCK_ENV, str(lock))
    monkeypatch.setenv(parallel.TIMING_ROLE_ENV, "timer")
    monkeypatch.setattr(parallel, "_timing", None)
    parallel.adopt_timing_lock()
    assert parallel.TIMING_LOCK_ENV not in os.environ and parallel.TIMING_ROLE_ENV not in os.environ
    assert parallel.kernel_env() == {parallel.TIMING_LOCK_ENV: str(lock), parallel.TIMING_ROLE_ENV: "timer"}
    # a background process as the protocol has it: pass the turnstile, then hold the device shared
    holder = ("import fcntl, sys, time; turn = open(sys.argv[1] + '.turn', 'a'); dev = open(sys.argv[1], 'a'); "
              "fcntl.flock(turn, fcntl.LOCK_SH); fcntl.flock(turn, fcntl.LOCK_UN); fcntl.flock(dev, fcntl.LOCK_SH); "
              "print(time.monotonic(), flush=True)")
    with parallel.exclusive():
        assert parallel.kernel_env() == {}
        proc = subprocess.Popen([sys.executable, "-c", holder, str(lock)], stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        assert proc.poll() is None  # still waiting at the turnstile
        released = time.monotonic()
    assert float(proc.communicate(timeout=10)[0]) >= released
    assert parallel.kernel_env() != {}
    monkeypatch.setattr(parallel, "_timing", None)
    with parallel.exclusive():  # no lock: nothing to hold
        assert parallel.kernel_env() == {}


def test_the_runbook_kernel_gets_the_lock_its_runner_process_gave_up(tmp_path, monkeypatch):
    from specbook import parallel

    body = ('import os\nrecord("has_lock", float(os.environ.get("SPECBOOK_TIMING_ROLE") == "background"), unit="n", '
            'direction="none", kind="exact")')
    root = make_repo(tmp_path, one=runbook_text(body=body))
    monkeypatch.setattr(parallel, "_timing", None)  # restored after the test: no other test's kernel gets it
    monkeypatch.setenv(parallel.TIMING_LOCK_ENV, str(parallel.lock_file(tmp_path, "0")))
    monkeypatch.setenv(parallel.TIMING_ROLE_ENV, "background")
    assert cli(root, "run", "one", "--record").exit_code == 0
    assert parallel.TIMING_ROLE_ENV not in os.environ  # the runner process gave it up ...
    assert yaml.safe_load((root / "baselines" / "one.yaml").read_text())["profiles"]["cpu"]["metrics"]["has_lock"][
        "value"] == 1.0  # ... and its runbook's kernel got it


def test_one_gpu_spreads_an_exact_and_a_timing_runbook_only_with_the_timing_lock(tmp_path):
    exact = 'record("y", 3, unit="n", direction="none", kind="exact")'
    root = make_repo(tmp_path, one=runbook_text(), two=runbook_text(body=exact))
    for name in ("one", "two"):
        assert cli(root, "run", name, "--record").exit_code == 0
    lines: list[str] = []
    verify(root, "cpu", progress=False, log=lines.append, gpus=["0"])
    assert not any("re-measuring" in line for line in lines)  # nothing could share the one GPU
    pyproject = root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + "timing_lock = true\n")
    lines.clear()
    vs = verify(root, "cpu", progress=False, log=lines.append, gpus=["0"])
    assert [v.state for v in vs] == [FRESH, FRESH]
    assert any("re-measuring 2 runbooks on 1 GPU(s)" in line for line in lines)


def test_verify_plan_of_two_profiles_schedules_them_together(tmp_path):
    """`--plan --profile cpu --profile cpu.v` plans one verify of both variants on one GPU, as `runbook record
    --profile cpu --profile cpu.v` runs them (profile by profile): two runbooks that time something take their turns,
    so the estimate is both wall times, where each profile planned alone shows one; a machine's profiles only."""
    import json

    two = "{cpu: {}, cpu.v: {value: 2.0}}"
    root = make_repo(tmp_path, one=runbook_text(profiles=two), two=runbook_text(profiles=two),
                     gpu=runbook_text(profiles="{h200: {}}"))
    for name in ("one", "two"):
        for p in ("cpu", "cpu.v"):
            assert cli(root, "run", name, "--record", "--profile", p).exit_code == 0
    r = cli(root, "verify", "--plan", "--profile", "cpu.v", "--profile", "cpu", "--gpus", "1", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [(x["runbook"], x["profile"]) for x in d["plan"]] == [("one", "cpu.v"), ("two", "cpu.v"), ("one", "cpu"),
                                                                  ("two", "cpu")]
    assert d["estimate_s"] == pytest.approx(d["sum_s"]) and d["sum_s"] == sum(x["seconds"] for x in d["plan"])
    alone = json.loads(cli(root, "verify", "--plan", "--profile", "cpu", "--gpus", "1", "--json").stdout)
    assert d["estimate_s"] > alone["estimate_s"] > 0
    r = cli(root, "verify", "--plan", "--profile", "cpu", "--profile", "h200")
    assert r.exit_code == 2 and "cpu, h200" in r.stderr


def test_declared_gpu_memory_keeps_jobs_apart_that_would_not_fit_the_card_together():
    """Hand-computed, one GPU of 80 GiB with the timing lock: the 8B-shape timer (50 GiB) and the MLA + MoE timer
    (30 GiB) fit together (80); a drafter training (16 GiB) beside them would not, so it waits for the first to end
    (10 s), then runs 6 s: 16 s. Without memory declared or without the card's size, all three start at once: 10 s.
    A job bigger than the card still runs, alone."""
    e = frozenset()
    jobs = [Job("decode", "h200", e, memory_gib=50), Job("moe", "h200", e, memory_gib=30),
            Job("train", "h200", e, exclusive=False, memory_gib=16)]
    secs = {"decode/h200": 10, "moe/h200": 10, "train/h200": 6}
    assert estimate(jobs, ["0"], secs, share=3, lock=True, memory={"0": 80}) == 16
    assert estimate(jobs, ["0"], secs, share=3, lock=True) == 10
    assert estimate(jobs, ["0"], secs, share=3, lock=True, memory={"1": 80}) == 10  # another card's size
    undeclared = [Job(j.name, j.profile, j.after, j.exclusive) for j in jobs]
    assert estimate(undeclared, ["0"], secs, share=3, lock=True, memory={"0": 80}) == 10
    huge = [Job("big", "h200", e, memory_gib=200), Job("small", "h200", e, exclusive=False, memory_gib=1)]
    assert estimate(huge, ["0"], {"big/h200": 5, "small/h200": 5}, share=3, lock=True, memory={"0": 80}) == 10


def test_card_memory_reads_nvidia_smi_and_says_nothing_without_it(monkeypatch):
    from specbook import parallel

    def fake(out: str, rc: int = 0):
        return lambda *a, **k: subprocess.CompletedProcess(a, rc, stdout=out, stderr="")

    monkeypatch.setattr(parallel.subprocess, "run", fake("0, 81559\n1, 143771\n"))
    assert parallel.card_memory(["1"]) == {"1": pytest.approx(140.4, abs=0.1)}
    monkeypatch.setattr(parallel.subprocess, "run", fake("", rc=9))
    assert parallel.card_memory(["0"]) == {}

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")
    monkeypatch.setattr(parallel.subprocess, "run", missing)
    assert parallel.card_memory(["0"]) == {}


def test_verify_plan_for_another_machine_packs_its_card_by_the_memory_its_records_keep(tmp_path):
    """Two exact runbooks of 10 s each declaring 50 GiB: on the 80 GiB card their h200 records name, the plan runs
    them one after the other (20 s); with records that keep no card memory, side by side (10 s)."""
    import json

    exact = 'record("y", 3, unit="n", direction="none", kind="exact")'
    header = "gpu_memory_gib: 50"
    root = make_repo(tmp_path, one=runbook_text(profiles="{cpu: {}, h200: {}}", body=exact, extra_header=header),
                     two=runbook_text(profiles="{cpu: {}, h200: {}}", body=exact, extra_header=header))

    def as_h200(memory: list[float] | None) -> None:
        for name in ("one", "two"):
            path = root / "baselines" / f"{name}.yaml"
            rec = yaml.safe_load(path.read_text())
            prof = rec["profiles"].pop("cpu", None) or rec["profiles"]["h200"]
            for run in prof["runs"]:
                run["seconds"] = 10.0
                run["provenance"]["profile"] = "h200"
                run["provenance"]["gpu"] = {"count": 1, "names": ["NVIDIA H200"], "driver": "1", "uuids": [],
                                            **({"memory_gib": memory} if memory else {})}
            rec["profiles"]["h200"] = prof
            path.write_text(yaml.safe_dump(rec))

    for name in ("one", "two"):
        assert cli(root, "run", name, "--record").exit_code == 0
    as_h200([80.0])
    r = cli(root, "verify", "--plan", "--profile", "h200", "--gpus", "1", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [x["shares_gpu"] for x in d["plan"]] == [True, True] and d["estimate_s"] == 20
    as_h200(None)
    assert json.loads(cli(root, "verify", "--plan", "--profile", "h200", "--gpus", "1", "--json").stdout
                      )["estimate_s"] == 10
