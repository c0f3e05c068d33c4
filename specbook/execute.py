"""Papermill execution of a jupytext runbook: kernel of this interpreter, per-cell and whole-run timeouts, one-line
errors naming the failing cell and the partly executed notebook."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import jupytext
import papermill
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from papermill.exceptions import PapermillExecutionError

from specbook import RunFailed
from specbook.record import RECORD_FILE_ENV, Metric, read_metrics
from specbook.runbooks import Runbook

KERNEL = "python3"
OWN_KERNEL = "specbook-python"  # installed into this venv when python3 would start another interpreter


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
    logging.getLogger("papermill").setLevel(logging.WARNING)  # its INFO lines repeat the progress bar
    try:
        with _environ({RECORD_FILE_ENV: str(records)}):
            papermill.execute_notebook(nb, str(notebook), parameters=params, kernel_name=ensure_kernel(),
                                       language="python", cwd=str(root), progress_bar=progress,
                                       execution_timeout=rb.cell_timeout, timeout_func=cell_timeout,
                                       # the kernel's own log (TCP warning, shutdown noise) says nothing about the runbook
                                       extra_arguments=["--IPKernelApp.log_level=CRITICAL"])
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
