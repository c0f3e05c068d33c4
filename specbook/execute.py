"""Running runbooks: papermill execution (kernel of this interpreter, per-cell and whole-run timeouts, one-line errors
naming the failing cell and the partly executed notebook), and targets - a runbook on a profile with its
dependencies, whose outputs are cached under a hash of their inputs."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import jupytext
import papermill
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from papermill.exceptions import PapermillExecutionError

from specbook import RunFailed, SpecbookError, records
from specbook.provenance import engine_hash, fingerprint, input_fingerprint, inputs_hash, now_iso
from specbook.record import RECORD_FILE_ENV, Metric, read_metrics
from specbook.runbooks import Runbook, load

KERNEL = "python3"
OWN_KERNEL = "specbook-python"  # installed into this venv when python3 would start another interpreter
DONE = "DONE"  # marker in an outputs dir: the run that produced it finished
EXECUTED = Path("docs") / "runbooks" / "executed"  # the site renders the notebook behind each record
LOCAL_EXECUTED = Path(".specbook") / "executed"  # the notebook of a run that recorded nothing (untracked)


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
    records = notebook.with_suffix(".records.jsonl")
    records.unlink(missing_ok=True)
    start = time.monotonic()
    deadline = start + rb.timeout

    def cell_timeout(cell) -> float:
        return max(0.01, min(rb.cell_timeout, deadline - time.monotonic()))

    where = f"(partly executed notebook: {notebook})"
    pm_log = logging.getLogger("papermill")
    pm_log.setLevel(logging.WARNING)  # its INFO lines repeat the progress bar
    if not any(isinstance(f, _KnownParameters) for f in pm_log.filters):
        pm_log.addFilter(_KnownParameters())
    quiet_kernel = ["--IPKernelApp.log_level=CRITICAL"]  # its TCP warning and shutdown noise are not about the runbook
    try:
        with _environ({RECORD_FILE_ENV: str(records)}):
            papermill.execute_notebook(nb, str(notebook), parameters=params, kernel_name=ensure_kernel(),
                                       language="python", cwd=str(root), progress_bar=False,
                                       execution_timeout=rb.cell_timeout, timeout_func=cell_timeout,
                                       extra_arguments=quiet_kernel, **(_live(rb, nb) if progress else {}))
    except PapermillExecutionError as e:
        raise RunFailed(f"runbook {rb.name}: {_cell(rb, nb, e.source)} raised {e.ename}: {e.evalue} {where}") from None
    except CellTimeoutError:
        limit = f"whole-run timeout {rb.timeout:g}s" if time.monotonic() >= deadline else \
            f"cell timeout {rb.cell_timeout:g}s"
        raise RunFailed(f"runbook {rb.name}: {limit} exceeded {where}") from None
    except DeadKernelError as e:
        raise RunFailed(f"runbook {rb.name}: the kernel died ({e}) {where}") from None
    try:
        metrics = read_metrics(records)
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
    engine = engine_hash(root, rb.source)
    h = inputs_hash(rb.hashed_source, params, engine, {d: t.inputs_hash for d, t in upstream.items()}, inputs)
    return Target(rb, profile, params, inputs, engine, upstream, h, root / ".specbook" / "outputs" / name / profile / h)


@dataclass
class Outcome:
    target: Target
    execution: Execution
    run_id: str | None  # None when nothing was recorded (verify, or no metrics)
    notebook: Path  # the executed notebook: docs/runbooks/executed/ for a run that records, else .specbook/executed/


def run(root: Path, t: Target, *, record: bool, force: bool = False, progress: bool = True,
        log=print, _ran: set[str] | None = None) -> list[Outcome]:
    """Run missing or stale dependencies (all of them with force), then `t`; record each run when `record`."""
    ran = set() if _ran is None else _ran
    outcomes: list[Outcome] = []
    for dep in t.upstream.values():
        if dep.rb.name not in ran and (force or not dep.done):
            outcomes += run(root, dep, record=record, force=force, progress=progress, log=log, _ran=ran)
    log(f"running {t.rb.name} on {t.profile} (inputs {t.inputs_hash})")
    t.outputs_dir.mkdir(parents=True, exist_ok=True)
    (t.outputs_dir / DONE).unlink(missing_ok=True)
    runs = root / ".specbook" / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    # one directory per run: concurrent runs of one runbook must not share the notebook or the records file
    work = Path(tempfile.mkdtemp(prefix=f"{t.rb.name}-{t.profile}-", dir=runs))
    notebook = work / f"{t.rb.name}-{t.profile}.ipynb"
    ex = execute(root, t.rb, t.injected(), notebook, progress)
    if missing := [m for m in t.rb.reproduces if m not in {x.name for x in ex.metrics}]:
        raise RunFailed(f"runbook {t.rb.name} declares reproduces {missing} but did not record them "
                        f"(notebook: {notebook})")
    run_id = _record(root, t, ex) if record and ex.metrics else None
    kept = _publish(notebook, root / (EXECUTED if record else LOCAL_EXECUTED) / f"{t.rb.name}-{t.profile}.ipynb")
    (t.outputs_dir / DONE).write_text(json.dumps({"run": run_id, "date": now_iso()}) + "\n")
    shutil.rmtree(work)  # only after success: a failed run's error message points into its directory
    ran.add(t.rb.name)
    return [*outcomes, Outcome(t, ex, run_id, kept)]


def _record(root: Path, t: Target, ex: Execution) -> str:
    date = now_iso()
    params = _plain(t.params)
    run = {"id": records.new_run_id(date), "date": date, "source": "measured", "inputs_hash": t.inputs_hash,
           "parameters": params,
           "provenance": _plain(fingerprint(root, t.rb.hashed_source, params, t.all_inputs()))}
    records.add_run(root, t.rb.name, t.profile, run, ex.metrics)
    return run["id"]


def _plain(obj: Any) -> Any:
    """Only plain YAML types (no tuples, no str subclasses such as torch's version)."""
    return json.loads(json.dumps(obj, default=str))


def _publish(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.")
    os.close(fd)
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
    return dst
