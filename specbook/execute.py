"""Running runbooks: papermill execution (kernel of this interpreter, per-cell and whole-run timeouts, one-line errors
naming the failing cell and the partly executed notebook), and targets - a runbook on a profile with its
dependencies, whose outputs are cached under a hash of their inputs.

Concurrent runs: a target runs under a file lock on its outputs directory, so a dependency two runs both need is
built once (the other run waits, then finds it DONE); outputs are built in place (a killed training run resumes from
its checkpoints there) and count only once DONE is written. A run reads its dependencies' outputs under a shared
lock and a build holds its own exclusively, so a dependency is never rebuilt under a run that reads it. Kernels listen on Unix sockets in a private directory,
not on TCP ports that concurrent starts could race for. Each run works in a directory of its own under
.specbook/runs/ that names its process; a later run removes those of killed processes at once, and a failed run's
(its error message names its notebook) after a day. A kernel whose run was killed with SIGKILL kills its own process
group (PARENT_WATCH); SIGTERM and Ctrl-C stop it on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import filelock
import jupytext
import papermill
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from papermill.exceptions import PapermillExecutionError
from traitlets.config import Config

from specbook import RunFailed, SpecbookError, Terminated, cpuload, gpumem, parallel, records
from specbook.fsutil import atomic_write
from specbook.provenance import engine_hash, fingerprint, gpus, input_fingerprint, inputs_hash, kernel_environ, now_iso
from specbook.record import RECORD_FILE_ENV, Metric, read_metrics
from specbook.runbooks import Runbook, load

KERNEL = "python3"
OWN_KERNEL = "specbook-python"  # installed into this venv when python3 would start another interpreter
DONE = "DONE"  # marker in an outputs dir: the run that produced it finished
EXECUTED = Path("docs") / "runbooks" / "executed"  # the site renders the notebook behind each record
LOCAL_EXECUTED = Path(".specbook") / "executed"  # the notebook of a run that recorded nothing (untracked)
RUNS = Path(".specbook") / "runs"  # one working directory per run: its notebook and records file
OWNER = "owner.json"  # in a run directory: the process that made it
STALE_RUN_S = 86400.0  # a failed run's notebook stays this long for the error message that named it
LOCK_GRACE_S = 600.0  # waiting for another run's build: its runbooks' whole-run timeouts, and this much more


@dataclass
class Execution:
    metrics: list[Metric]
    notebook: Path
    seconds: float


def _runs_here(argv: list[str]) -> bool:
    # jupyter_client swaps a bare "python"/"python3"/"python3.X" for the current interpreter
    major, minor = sys.version_info[:2]
    return argv[0] in ("python", f"python{major}", f"python{major}.{minor}") or \
        os.path.realpath(argv[0]) == os.path.realpath(sys.executable)


def ensure_kernel() -> str:
    """A kernel name whose spec runs this interpreter; installs one into sys.prefix once if needed."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    ksm = KernelSpecManager()
    for name in (KERNEL, OWN_KERNEL):
        try:
            if _runs_here(ksm.get_kernel_spec(name).argv):
                return name
        except NoSuchKernel:
            pass
    from ipykernel.kernelspec import install

    install(kernel_name=OWN_KERNEL, prefix=sys.prefix, display_name="Python (specbook)")
    if not _runs_here(KernelSpecManager().get_kernel_spec(OWN_KERNEL).argv):
        raise RunFailed(f"kernel {OWN_KERNEL} does not start {sys.executable}; check JUPYTER_PATH")
    return OWN_KERNEL


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    # the kernel inherits os.environ; restore it so in-process callers (tests) see no leak
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cell(rb: Runbook, nb, source: str) -> str:
    """The failing cell as the author sees it: its index in the runbook and the line of its `# %%` marker."""
    index = next((i for i, c in enumerate(nb.cells) if c.source == source), None)
    if index is None:
        return "a cell"
    markers = [n for n, line in enumerate(rb.source.splitlines(), 1) if line.startswith("# %%")]
    return f"cell {index} (line {markers[index]} of {rb.path.name})" if len(markers) == len(nb.cells) else \
        f"cell {index}"


@contextlib.contextmanager
def _ipc_kernel() -> Iterator[Config]:
    """Kernel-manager config for a kernel on Unix sockets in a fresh private directory. jupyter_client's default
    picks free TCP ports, closes them and hands them to the kernel, so concurrent starts can take each other's ports
    ("Address already in use", or a kernel that dies before replying to kernel_info). The directory is short
    (tempfile's, not the run's) because a socket path may not exceed about 100 bytes."""
    sockets = tempfile.mkdtemp(prefix="specbook-kernel-")
    try:
        yield Config({"KernelManager": {"transport": "ipc", "ip": os.path.join(sockets, "k")}})
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


@contextlib.contextmanager
def _signals_noted() -> Iterator[list[type[KeyboardInterrupt]]]:
    """Ctrl-C raises KeyboardInterrupt as usual, SIGTERM Terminated (a KeyboardInterrupt: the same clean-up), and
    each is remembered: nbclient's clean-up of the kernel (it kills the kernel's process group on either signal) may
    replace it with another error (DeadKernelError) that must still read as what it was."""
    seen: list[type[KeyboardInterrupt]] = []
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread only
        yield seen
        return

    def note(signum, frame) -> None:
        seen.append(Terminated if signum == signal.SIGTERM else KeyboardInterrupt)
        raise seen[-1]

    old = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield seen
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


# Run in the kernel as it starts (IPKernelApp.exec_lines, in a namespace of its own): when the process that started
# it is gone - killed with SIGKILL, which it cannot catch - the kernel kills its process group, itself and what the
# runbook's code started (jupyter_client starts a kernel as the leader of a new session). ipykernel's own parent
# poller ends the kernel alone and leaves its children.
PARENT_WATCH = """
import os, signal, threading, time
def watch(parent=int(os.environ.get("JPY_PARENT_PID") or os.getppid())):
    while os.getppid() == parent:
        time.sleep(0.5)
    os.killpg(os.getpgrp(), signal.SIGKILL) if os.getpgrp() == os.getpid() else os._exit(1)
threading.Thread(target=watch, name="specbook-parent-watch", daemon=True).start()
"""


def _forget_abandoned_cell() -> None:
    """After Ctrl-C nobody waits for nbclient's tasks of the running cell any more; the kernel's shutdown makes them
    fail (DeadKernelError), and asyncio reports such a task when it is collected, often at exit, as a traceback
    ("Task exception was never retrieved"). Drop those reports of nbclient's tasks on the loop papermill ran on."""
    from jupyter_core.utils import ensure_event_loop  # the loop nbclient's synchronous calls run on

    loop = ensure_event_loop()
    previous = loop.get_exception_handler()

    def handler(loop, context: dict) -> None:
        task = context.get("future") or context.get("task")
        coro = task.get_coro() if isinstance(task, asyncio.Task) else None
        if getattr(coro, "__qualname__", "").startswith("NotebookClient."):
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


class _KnownParameters(logging.Filter):
    """papermill's parser misses annotated parameters (`steps: int | None = None`) and calls them unknown; the
    parameters were already checked against the parameters cell (runbooks.parse_cli), so the warning is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Passed unknown parameter")


def _live(rb: Runbook, nb) -> dict[str, Any]:
    """Progress as the run goes: a line as each section starts (the markdown heading above its cells), and the
    kernel's stderr - where long work such as training draws its own progress bar - streamed to ours."""
    sections: dict[int, str] = {}
    for i, cell in enumerate(nb.cells):
        m = re.match(r"#+\s*(.+)", cell.source.strip()) if cell.cell_type == "markdown" else None
        if m and i + 1 < len(nb.cells):
            sections[i + 1] = m.group(1).strip()
    start = time.monotonic()

    def on_cell_start(cell, cell_index: int) -> None:
        if cell_index in sections:
            print(f"  [{rb.name} {time.monotonic() - start:5.0f}s] {sections[cell_index]}", file=sys.stderr,
                  flush=True)

    return {"stderr_file": sys.stderr, "on_cell_start": on_cell_start}


def execute(root: Path, rb: Runbook, params: dict[str, Any], notebook: Path, progress: bool = True) -> Execution:
    """Run the runbook with `params` injected; the executed notebook is written to `notebook` as it goes."""
    nb = jupytext.read(rb.path, fmt="py:percent")
    notebook.parent.mkdir(parents=True, exist_ok=True)
    records_file = notebook.with_suffix(".records.jsonl")
    records_file.unlink(missing_ok=True)
    start = time.monotonic()
    deadline = start + rb.timeout

    def cell_timeout(cell) -> float:
        return max(0.01, min(rb.cell_timeout, deadline - time.monotonic()))

    where = f"(partly executed notebook: {notebook})"
    pm_log = logging.getLogger("papermill")
    pm_log.setLevel(logging.WARNING)  # its INFO lines repeat the progress bar
    if not any(isinstance(f, _KnownParameters) for f in pm_log.filters):
        pm_log.addFilter(_KnownParameters())
    quiet_kernel = ["--IPKernelApp.log_level=CRITICAL",  # its shutdown noise is not about the runbook
                    f"--IPKernelApp.exec_lines=exec({PARENT_WATCH!r}, {{}})"]
    try:
        # the kernel imports this repository's engine first, also where PYTHONPATH names another checkout (a verify
        # runs the recorded commit's tree beside this one)
        path = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
        with _environ({**kernel_environ(root), RECORD_FILE_ENV: str(records_file), "PYTHONPATH": path,
                       **parallel.kernel_env()}), \
                _ipc_kernel() as config, \
                _signals_noted() as signalled:
            try:
                papermill.execute_notebook(nb, str(notebook), parameters=params, kernel_name=ensure_kernel(),
                                           language="python", cwd=str(root), progress_bar=False,
                                           execution_timeout=rb.cell_timeout, timeout_func=cell_timeout,
                                           extra_arguments=quiet_kernel, config=config,
                                           **(_live(rb, nb) if progress else {}))
            except BaseException:
                if signalled:  # Ctrl-C or SIGTERM, maybe surfaced as a clean-up error (a dead kernel, a closed channel)
                    _forget_abandoned_cell()
                    raise signalled[0]() from None
                raise
    except PapermillExecutionError as e:
        raise RunFailed(f"runbook {rb.name}: {_cell(rb, nb, e.source)} raised {e.ename}: {e.evalue} {where}") from None
    except CellTimeoutError:
        limit = f"whole-run timeout {rb.timeout:g}s" if time.monotonic() >= deadline else \
            f"cell timeout {rb.cell_timeout:g}s"
        raise RunFailed(f"runbook {rb.name}: {limit} exceeded {where}") from None
    except DeadKernelError as e:
        raise RunFailed(f"runbook {rb.name}: the kernel died ({e}) {where}") from None
    try:
        metrics = read_metrics(records_file)
    except ValueError as e:
        raise RunFailed(f"runbook {rb.name}: {e}") from None
    return Execution(metrics, notebook, time.monotonic() - start)


# ------------------------------------------------------------------------------------------- targets and runs


@dataclass
class Target:
    """A runbook on one profile with its effective parameters; outputs are cached under its inputs hash."""

    rb: Runbook
    profile: str
    params: dict[str, Any]
    inputs: dict[str, str]  # declared input fingerprints
    engine: str  # engine source hash
    upstream: dict[str, "Target"]
    inputs_hash: str
    outputs_dir: Path

    def all_inputs(self) -> dict[str, str]:
        """Declared input fingerprints of this runbook and everything upstream (a trained model carries its corpus)."""
        out: dict[str, str] = {}
        for t in self.upstream.values():
            out.update(t.all_inputs())
        return {**out, **self.inputs}

    @property
    def done(self) -> bool:
        return (self.outputs_dir / DONE).exists()

    def injected(self) -> dict[str, Any]:
        declared = self.rb.parameters
        extra: dict[str, Any] = {}
        if "outputs_dir" in declared:
            extra["outputs_dir"] = str(self.outputs_dir)
        if "upstream" in declared:
            extra["upstream"] = {d: str(t.outputs_dir) for d, t in self.upstream.items()}
        return {**self.params, **extra}


def target(root: Path, name: str, profile: str, overrides: dict[str, Any] | None = None,
           _chain: tuple[str, ...] = ()) -> Target:
    """Resolve a runbook and, recursively, its dependencies on a profile (no execution, no torch import)."""
    if name in _chain:
        raise SpecbookError(f"dependency cycle: {' -> '.join((*_chain, name))}")
    rb = load(root, name)
    params = rb.params_for(profile, overrides)
    # A dependency that does not declare this profile is not run on it: there the runbook takes what upstream would
    # give it from its parameters (a real-server profile points at real checkpoints instead of trained miniatures).
    upstream = {d: target(root, d, profile, None, (*_chain, name)) for d in rb.depends
                if d in (*_chain, name) or profile in load(root, d).profiles}
    inputs = {i: input_fingerprint(root, i) for i in rb.inputs}
    engine = engine_hash(root, rb.source, params)
    h = inputs_hash(rb.hashed_source, params, engine, {d: t.inputs_hash for d, t in upstream.items()}, inputs)
    return Target(rb, profile, params, inputs, engine, upstream, h, root / ".specbook" / "outputs" / name / profile / h)


@dataclass
class Outcome:
    target: Target
    execution: Execution
    run_id: str | None  # None when nothing was recorded (verify, or no metrics)
    notebook: Path  # the executed notebook: docs/runbooks/executed/ for a run that records, else .specbook/executed/
    seconds: float = 0.0  # the run's wall time, as recorded (_lap)


def notebook_seconds(path: Path) -> float | None:
    """Seconds the cells of an executed notebook ran (papermill's per-cell durations); None without the notebook.
    The kernel's start is not in it: a few seconds more per run."""
    try:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError):
        return None
    return sum(c.get("metadata", {}).get("papermill", {}).get("duration") or 0.0 for c in cells)


def kernel_start_seconds(path: Path) -> float | None:
    """Seconds from the notebook's start to its first cell's (papermill's timestamps): the kernel's start, which
    the cells' durations leave out. None without the notebook or the timestamps."""
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
        start = nb["metadata"]["papermill"]["start_time"]
        first = min(c["metadata"]["papermill"]["start_time"] for c in nb["cells"]
                    if c.get("metadata", {}).get("papermill", {}).get("start_time"))
        return (dt.datetime.fromisoformat(first) - dt.datetime.fromisoformat(start)).total_seconds()
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run(root: Path, t: Target, *, record: bool, force: bool = False, fresh: bool = False, progress: bool = True,
        log=print) -> list[Outcome]:
    """Run missing or stale dependencies (all of them with force), then `t`; record each run when `record`.
    `fresh`: `t`'s cached outputs are removed first, so that it measures from nothing (verify): a runbook may reuse
    what its outputs directory holds, e.g. a finished training run, which would be read back, not re-measured.
    Each target runs under its outputs directory's lock (see the module docstring)."""
    clean_stale_runs(root / RUNS)
    with _building(t, log):
        if fresh:
            with _writing(t, log):
                shutil.rmtree(t.outputs_dir, ignore_errors=True)
        return _run_locked(root, t, record=record, force=force, progress=progress, log=log, ran=set())


def _run_locked(root: Path, t: Target, *, record: bool, force: bool, progress: bool, log,
                ran: set[str]) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for dep in t.upstream.values():
        if dep.rb.name in ran or not force and dep.done:
            continue
        with _building(dep, log):
            if not force and dep.done:  # DONE again under the lock: another run built it while this one waited
                log(f"{dep.rb.name} on {dep.profile}: built by another run (inputs {dep.inputs_hash})")
                continue
            outcomes += _run_locked(root, dep, record=record, force=force, progress=progress, log=log, ran=ran)
    log(f"running {t.rb.name} on {t.profile} (inputs {t.inputs_hash})")
    with _writing(t, log), _reading(_closure(t), log):
        return [*outcomes, _execute_target(root, t, record=record, progress=progress, log=log, ran=ran)]


def _execute_target(root: Path, t: Target, *, record: bool, progress: bool, log, ran: set[str]) -> Outcome:
    """Build `t` in its outputs directory, its dependencies built: under the write lock of its outputs and the read
    locks of theirs (see _reading)."""
    t.outputs_dir.mkdir(parents=True, exist_ok=True)
    (t.outputs_dir / DONE).unlink(missing_ok=True)
    work = _new_run_dir(root / RUNS, t)
    notebook = work / f"{t.rb.name}-{t.profile}.ipynb"
    others, peak = cpuload.Others.start(), gpumem.Peak.start()
    try:
        try:
            ex = execute(root, t.rb, t.injected(), notebook, progress)
        finally:
            gib = peak.stop()
        if gib is not None and t.rb.gpu_memory_gib and gib > t.rb.gpu_memory_gib:
            log(f"{t.rb.name}/{t.profile} took {gib:.1f} GiB of GPU memory; its header declares gpu_memory_gib "
                f"{t.rb.gpu_memory_gib:g}: raise it, or a record may put it beside runbooks the card cannot hold")
        if missing := [m for m in t.rb.reproduces if m not in {x.name for x in ex.metrics}]:
            raise RunFailed(f"runbook {t.rb.name} declares reproduces {missing} but did not record them "
                            f"(notebook: {notebook})")
        seconds, share = _lap(), others.share()
        if record and ex.metrics:
            _refuse_busy(t, ex, share, notebook)
        run_id = _record_run(root, t, ex, seconds, share, log, gib) if record and ex.metrics else None
        kept = _publish(notebook, root / (EXECUTED if record else LOCAL_EXECUTED) / f"{t.rb.name}-{t.profile}.ipynb")
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM
        shutil.rmtree(work, ignore_errors=True)  # no message names it
        raise
    except BaseException:
        _keep(work)  # a failed run's error message points into its directory
        raise
    atomic_write(t.outputs_dir / DONE, (json.dumps({"run": run_id, "date": now_iso()}) + "\n").encode())
    shutil.rmtree(work)
    ran.add(t.rb.name)
    log(done_line(f"{t.rb.name}/{t.profile}", seconds, kept))
    return Outcome(t, ex, run_id, kept, seconds)


def done_line(key: str, seconds: float, notebook: Path) -> str:
    """One line as a run ends, where its wall time went (scripts/gpu-runbooks.sh tabulates these): `done KEY in S s
    (kernel start K s, cells C s)`; the rest of S is the process start, the hashes and the record."""
    kernel, cells = kernel_start_seconds(notebook), notebook_seconds(notebook)
    split = f" (kernel start {kernel:.0f} s, cells {cells:.0f} s)" if kernel is not None and cells is not None else ""
    return f"done {key} in {seconds:.0f} s{split}"


_locks: dict[Path, filelock.FileLock] = {}
_lap_start = time.monotonic()  # this process's start, near enough: the CLI imports this module first


def _lap() -> float:
    """Seconds since the previous run of this process ended (the first: since the process started), so that a
    run's wall time includes what a verify pays for it beyond its cells: the process and kernel starts, the
    dependency checks, the recording."""
    global _lap_start
    now = time.monotonic()
    took, _lap_start = now - _lap_start, now
    return took


def _wait_s(t: Target) -> float:
    """How long another run may hold `t`'s lock: its build and its dependencies' builds, each within its timeout."""
    return t.rb.timeout + sum(_wait_s(d) for d in t.upstream.values())


@contextlib.contextmanager
def _building(t: Target, log) -> Iterator[None]:
    """Hold the lock of `t`'s outputs directory (beside it) while `t` and what it needs are built."""
    path = t.outputs_dir.with_name(t.outputs_dir.name + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    # one object per file: it is reentrant, where a second FileLock on the same file would deadlock this process
    lock = _locks.setdefault(path, filelock.FileLock(path))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        log(f"waiting for another run building {t.rb.name} on {t.profile} (lock {path})")
        try:
            lock.acquire(timeout=_wait_s(t) + LOCK_GRACE_S)
        except filelock.Timeout:
            raise RunFailed(f"{t.rb.name} on {t.profile}: another run has held {path} for longer than its "
                            "timeouts allow; if no runbook is running, delete the lock file") from None
    try:
        yield
    finally:
        lock.release()


def _closure(t: Target) -> dict[Path, Target]:
    """Everything `t` reads: its dependencies and theirs (an output may name an output of its own upstream)."""
    out: dict[Path, Target] = {}
    for d in t.upstream.values():
        out.update({d.outputs_dir: d, **_closure(d)})
    return out


def _use_lock(t: Target) -> filelock.ReadWriteLock:
    """The reader/writer lock of `t`'s outputs: shared by the runs that read them, exclusive while they are built."""
    path = t.outputs_dir.with_name(t.outputs_dir.name + ".use")
    path.parent.mkdir(parents=True, exist_ok=True)
    return filelock.ReadWriteLock(path)  # one per file and process (filelock keeps the instance)


def _acquire(acquire: Callable[..., object], log, waiting: str) -> None:
    """Take a lock, saying `waiting` first when another run holds it (a silent wait looks like a hang)."""
    try:
        acquire(blocking=False)
    except filelock.Timeout:
        log(waiting)
        acquire()


@contextlib.contextmanager
def _writing(t: Target, log) -> Iterator[None]:
    """Hold `t`'s outputs exclusively while they are rebuilt or removed: never under a run that reads them (a
    dependency rebuilt in place under its reader handed it half of the old outputs and half of the new)."""
    lock = _use_lock(t)
    _acquire(lock.acquire_write, log, f"waiting for the runs that read {t.rb.name} on {t.profile} to finish "
             "before rebuilding it")
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def _reading(deps: dict[Path, Target], log) -> Iterator[None]:
    """Hold the read locks of `deps`' outputs while a run reads them, and check that they are still built: a run
    that rebuilt one meanwhile has finished it (its write lock is gone), or failed and left it unbuilt."""
    with contextlib.ExitStack() as held:
        for d in sorted(deps.values(), key=lambda d: d.outputs_dir):  # one order: no two runs wait on each other
            lock = _use_lock(d)
            _acquire(lock.acquire_read, log, f"waiting for another run rebuilding {d.rb.name} on {d.profile}")
            held.callback(lock.release)
            if not d.done:
                raise RunFailed(f"{d.rb.name} on {d.profile}: another run rebuilt it meanwhile and did not finish "
                                f"({d.outputs_dir} has no {DONE}); run again")
        yield


def _new_run_dir(runs: Path, t: Target) -> Path:
    """A directory of this run's own (concurrent runs of one runbook must not share the notebook or the records
    file), naming the process that owns it so that a later run can tell a live run from a dead one."""
    runs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{t.rb.name}-{t.profile}-", dir=runs))
    (work / OWNER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "date": now_iso()}))
    return work


def _keep(work: Path) -> None:
    """Mark a failed run's directory to be kept for STALE_RUN_S: the error message names its notebook. A directory
    whose process is gone without this mark was killed (SIGKILL) and goes at the next run."""
    try:
        owner = json.loads((work / OWNER).read_text())
        atomic_write(work / OWNER, json.dumps({**owner, "failed": now_iso()}).encode())
    except (OSError, ValueError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def clean_stale_runs(runs: Path, max_age_s: float = STALE_RUN_S) -> None:
    """Remove run directories left by killed or failed runs of this host: a killed run's (its process gone, the
    directory not marked failed: SIGKILL) at once, a failed run's or one naming no process once untouched for more
    than `max_age_s`. A live run's directory stays however old; a recent failure's stays for the message that names
    its notebook."""
    if not runs.is_dir():
        return
    now, host = time.time(), socket.gethostname()
    for d in runs.iterdir():
        try:
            owner = json.loads((d / OWNER).read_text())
            pid, its_host, failed = int(owner["pid"]), owner.get("host", host), "failed" in owner
        except (OSError, ValueError, KeyError, TypeError):
            pid, its_host, failed = None, host, True  # from before run directories named their owner, or half-written
        if its_host != host or pid is not None and _alive(pid):
            continue
        if not failed:
            shutil.rmtree(d, ignore_errors=True)
            continue
        try:
            touched = max([d.stat().st_mtime, *(p.stat().st_mtime for p in d.iterdir())])
        except OSError:
            continue  # removed meanwhile by a concurrent run's clean-up
        if now - touched > max_age_s:
            shutil.rmtree(d, ignore_errors=True)


def _refuse_busy(t: Target, ex: Execution, share: float | None, notebook: Path) -> None:
    """A run that times something on a machine without GPUs is not recorded when other processes took more than
    cpuload.BUSY_SHARE of its cores meanwhile: its timings would describe the load. (On a GPU machine the timing lock
    keeps other runbooks out of timed sections, and they share the host by design.)"""
    if share is None or share <= cpuload.BUSY_SHARE or cpuload.allowed() or gpus():
        return
    if all(m.kind != "noisy" for m in ex.metrics):  # exact numbers do not depend on the load
        return
    raise RunFailed(f"{t.rb.name} on {t.profile}: not recorded: other processes used {share:.0%} of this machine's "
                    f"CPU while it ran, so its timings would measure the load; run it again on a quiet machine, or "
                    f"set {cpuload.ALLOW_BUSY_ENV}=1 to record anyway (the share is kept with the run; notebook: "
                    f"{notebook})")


def _record_run(root: Path, t: Target, ex: Execution, seconds: float, share: float | None,
                log: Callable[[str], None], gpu_gib: float | None = None) -> str:
    date = now_iso()
    params = _plain_data(t.params)
    run = {"id": records.new_run_id(date), "date": date, "source": "measured", "inputs_hash": t.inputs_hash,
           "seconds": round(seconds, 1), "parameters": params,
           "provenance": _plain_data(fingerprint(root, t.rb.hashed_source, params, t.all_inputs()))}
    if share is not None:
        run["provenance"]["others_cpu_share"] = round(share, 3)  # what else ran on the machine meanwhile
    if gpu_gib is not None:
        run["provenance"]["gpu_peak_gib"] = round(gpu_gib, 1)  # what its header's gpu_memory_gib should cover
    if dropped := records.add_run(root, t.rb.name, t.profile, run, ex.metrics):
        log(f"dropped from the {t.profile} record, which this run no longer measures: {', '.join(dropped)}")
    return run["id"]


def _plain_data(obj: Any) -> Any:
    """Only plain YAML types (no tuples, no str subclasses such as torch's version)."""
    return json.loads(json.dumps(obj, default=str))


def _publish(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(dst, src.read_bytes())
    return dst


# ------------------------------------------------------------------------------------------- plots for people


def extract_plots(notebook: Path, dest: Path) -> list[Path]:
    """The notebook's plots (its image/png outputs) as files that open without Jupyter: NOTEBOOK.png, then
    NOTEBOOK-2.png, ... in `dest`, in the order the cells drew them; the files of an earlier run with more plots go."""
    import base64

    try:
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError):
        return []
    images = [out["data"]["image/png"] for c in cells for out in c.get("outputs", [])
              if isinstance(out.get("data"), dict) and "image/png" in out["data"]]
    stem = notebook.stem
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(f"{stem}*.png"):
        if re.fullmatch(re.escape(stem) + r"(-\d+)?\.png", old.name):
            old.unlink(missing_ok=True)
    paths = []
    for i, data in enumerate(images, 1):
        path = dest / (f"{stem}.png" if i == 1 else f"{stem}-{i}.png")
        atomic_write(path, base64.b64decode("".join(data) if isinstance(data, list) else data))
        paths.append(path)
    return paths
