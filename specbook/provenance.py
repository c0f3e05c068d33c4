"""Fingerprints: of this machine and run (provenance), of a run's inputs (the cache key), and the hardware profile."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from specbook import RunFailed, SpecbookError, codehash, project

# environment variables that change performance, or which code paths the CPU's math takes (and so its rounding)
ENV_PREFIXES = ("NCCL_", "CUDA_", "TORCH_", "OMP_", "PYTORCH_", "ATEN_", "MKL_", "ONEDNN_", "DNNL_", "OPENBLAS_")

# Named extra inputs a runbook may declare (`inputs: [corpus]`): the project's [tool.specbook.inputs]
# (specbook/project.py), and any registered here in code (e.g. by tests), which win over the configured ones.
# Each returns a hash of that input.
INPUTS: dict[str, Callable[[Path], str]] = {}


def register_input(name: str):
    def deco(fn: Callable[[Path], str]) -> Callable[[Path], str]:
        INPUTS[name] = fn
        return fn

    return deco


def known_inputs(root: Path) -> list[str]:
    return sorted(set(project.settings(root).inputs) | set(INPUTS))


def input_fingerprint(root: Path, name: str) -> str:
    try:
        if name in INPUTS:
            return str(INPUTS[name](root))
        target = project.settings(root).inputs.get(name)
        if target is None:
            raise KeyError(f"{name} is not in [tool.specbook.inputs] of {root / 'pyproject.toml'}")
        return str(project.input_function(target)())
    except Exception as e:  # a missing or broken input module must not crash status or list
        raise RunFailed(f"input {name} unavailable: {type(e).__name__}: {e}") from None


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def file_hash(path: str | os.PathLike) -> str:
    return sha(Path(path).read_bytes())


def engine_hash(root: Path, source: str | None = None, params: dict | None = None) -> str:
    """Hash of the engine code a runbook runs, by meaning (specbook.codehash): the top-level definitions of the
    configured engine package (tool.specbook.engine_package) that its source and the string values of its
    parameters reach, without docstrings or comments. Without a source, or when it does not parse, every definition
    of the package; without a configured package, no code."""
    units, mods = engine_units(root, source, params)
    return codehash.digest(units, mods)


def engine_units(root: Path, source: str | None = None, params: dict | None = None,
                 files: dict[str, str] | None = None) -> tuple[list[codehash.Unit], dict[str, codehash.Module]]:
    """The engine definitions a runbook reaches, and the package's modules; `files` ({path: source}, e.g. another
    commit's) instead of the working tree's."""
    package = project.settings(root).engine_package
    if package is None:
        return [], {}
    files = codehash.read_package(root, package) if files is None else files
    return _reached(package, tuple(sorted(files.items())), source, frozenset(codehash.strings(params or {})))


@functools.lru_cache(maxsize=512)  # keyed by content: status resolves every runbook on every profile
def _reached(package: str, files: tuple[tuple[str, str], ...], source: str | None, strings: frozenset[str]
             ) -> tuple[list[codehash.Unit], dict[str, codehash.Module]]:
    mods = codehash.modules(dict(files))
    units = codehash.reachable(mods, source, strings) if source is not None else None
    if units is None:
        return [u for m in mods.values() for u in m.units], mods
    return units, mods


def engine_files(root: Path, source: str, package: str | None = None) -> set[Path]:
    """The files of the engine package that hold code the source reaches."""
    units, mods = engine_units(root, source)
    return {root / mods[u.module].path for u in units}


def engine_changes(root: Path, commit: str, source: str | None, params: dict | None = None) -> dict[str, list[str]] | None:
    """What changed in the engine code a runbook reaches since `commit`: {path: [definitions added, removed or
    changed]}; None when the commit's files cannot be read (not in this clone, or no git)."""
    package = project.settings(root).engine_package
    if package is None or not re.fullmatch(r"[0-9a-f]{40}", commit or ""):
        return None
    then = _files_at(root, commit, package)
    if then is None:
        return None
    before = codehash.by_label(*engine_units(root, source, params, then))
    after = codehash.by_label(*engine_units(root, source, params))
    return codehash.changes(before, after)


@functools.lru_cache(maxsize=16)
def _files_at(root: Path, commit: str, package: str) -> dict[str, str] | None:
    """{path: source} of the package's .py files at a commit, from git; None when git cannot show them."""
    listing = _git(root, "ls-tree", "-r", "--name-only", "--end-of-options", commit, "--", package, f"{package}.py")
    if listing is None:
        return None
    paths = [p for p in listing.splitlines() if p.endswith(".py")]
    batch = "".join(f"{commit}:{p}\n" for p in paths)
    try:
        r = subprocess.run(["git", "cat-file", "--batch"], cwd=root, input=batch.encode(), capture_output=True,
                           timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    out, data = {}, r.stdout
    for p in paths:
        header, _, data = data.partition(b"\n")
        if header.endswith(b" missing"):
            return None
        size = int(header.split()[-1])
        out[p], data = data[:size].decode("utf-8", "replace"), data[size + 1:]
    return out


def inputs_hash(runbook_source: str, params: dict, engine: str, upstream: dict[str, str],
                inputs: dict[str, str]) -> str:
    return sha(canonical({"runbook": sha(runbook_source), "params": params, "engine": engine,
                          "upstream": upstream, "inputs": inputs}))


@functools.lru_cache(maxsize=1)
def gpus() -> tuple[str, ...]:
    """Names of the visible CUDA devices; empty without CUDA (torch is a dependency: a broken install fails here)."""
    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


@functools.lru_cache(maxsize=1)
def gpu_uuids() -> tuple[str, ...]:
    """The visible CUDA devices' UUIDs: which physical GPUs a run had, so that two runs can be told to have been on
    the same card or on another. Empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(torch.cuda.device_count()))


@functools.lru_cache(maxsize=1)
def gpu_memory_gib() -> tuple[float, ...]:
    """Each visible CUDA device's memory in GiB: what a record keeps so that `verify --plan` for its profile, from
    another machine, packs runbooks onto the card as the scheduler there will (specbook.parallel). Empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)
                 for i in range(torch.cuda.device_count()))


def profile_of(names: tuple[str, ...]) -> str:
    if not names:
        return "cpu"
    if all("H200" in n for n in names):
        return "h200"
    if all("H100" in n for n in names) and len(names) == 1:
        return "h100"
    if len(names) == 8 and all("RTX PRO 6000" in n for n in names):
        return "8x-rtx-pro-6000"
    slug = re.sub(r"[^a-z0-9]+", "-", names[0].lower().replace("nvidia", "")).strip("-")
    return f"gpu-{len(names)}x-{slug}" if len(names) > 1 else f"gpu-{slug}"


def detect_profile() -> str:
    return profile_of(gpus())


def hardware_of(profile: str) -> str:
    """The hardware a profile runs on. A profile is a machine (`cpu`, `h200`) or a variant of one, `MACHINE.VARIANT`
    (`cpu.dsv3`: the same runbooks on other parameters, recorded apart)."""
    return profile.split(".", 1)[0]


def runs_here(profile: str, here: str) -> bool:
    return hardware_of(profile) == here


def _git(root: Path, *args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


FULL_COMMIT = re.compile(r"[0-9a-f]{40}")  # a full SHA-1 object id, as `git rev-parse HEAD` prints it
SENT_COMMIT_ENV = "SPECBOOK_GIT_COMMIT"


def verified_commit(root: Path, value: Any) -> str | None:
    """`value` when it is a full commit id that names a commit of the repository at `root`, else None. A record's
    commit is an input like any other: nothing but 40 hex digits reaches git (never as an option: git's
    --end-of-options as well), and only what `git rev-parse --verify` resolves to that same commit is used."""
    if not isinstance(value, str) or not FULL_COMMIT.fullmatch(value):
        return None
    resolved = _git(root, "rev-parse", "--verify", "--quiet", "--end-of-options", value + "^{commit}")
    return value if resolved == value else None


def why_no_commit(root: Path, value: Any) -> str:
    """Why the commit a record names cannot be had here, in words (verified_commit gave None)."""
    if _git(root, "rev-parse", "--git-dir") is None:
        return "this checkout is not a git repository"
    if not isinstance(value, str) or not FULL_COMMIT.fullmatch(value):
        return f"the record names {value!r}, not a full commit id"
    if _git(root, "rev-parse", "--is-shallow-repository") == "true":
        return (f"the recorded commit {value[:10]} is missing from this shallow clone (`git fetch --unshallow` "
                "fetches the history)")
    return f"the recorded commit {value[:10]} is not in this repository (`git fetch` may bring it)"


# What specbook writes and no run computes from: the records and the docs (the executed notebooks and generated pages
# among them). Left out of a run's dirty flag, so that the second runbook of one `runbook record` is not called dirty
# for the first one's record.
UNCOMPUTED = (":(exclude)baselines", ":(exclude)docs")


def _git_state(root: Path) -> tuple[str | None, bool]:
    """Commit and dirty flag. A copy of the working tree sent to another machine (a lent GPU) names them in
    SPECBOOK_GIT_COMMIT / SPECBOOK_GIT_DIRTY: the sender knows what it sent, while a .git that came along may be of
    an older commit (its HEAD, with the sent files as uncommitted changes). Without them, git itself. A sent commit
    must be a full commit id, and one this repository knows where the copy is a repository (the lent machine's copy
    has no .git: there only its form can be checked)."""
    sent = os.environ.get(SENT_COMMIT_ENV)
    if sent:
        in_git = _git(root, "rev-parse", "--git-dir") is not None
        if not FULL_COMMIT.fullmatch(sent) or in_git and verified_commit(root, sent) is None:
            what = "is not a commit of this repository" if FULL_COMMIT.fullmatch(sent) else \
                "is not a full commit id (40 hex digits, as `git rev-parse HEAD` prints it)"
            raise SpecbookError(f"{SENT_COMMIT_ENV}={sent!r} {what}; set it to the commit this tree was sent at")
        return sent, os.environ.get("SPECBOOK_GIT_DIRTY", "0") not in ("", "0")
    commit = _git(root, "rev-parse", "HEAD")
    return commit, commit is not None and bool(_git(root, "status", "--porcelain", "--", ".", *UNCOMPUTED))


def git_commit(root: Path) -> str | None:
    """The commit a run here is recorded at (see _git_state); raises SpecbookError for a bad SPECBOOK_GIT_COMMIT, so
    that a command that records can refuse it before it runs anything."""
    return _git_state(root)[0]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else None


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The processor's model name (timings on CPU are facts about it), from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _customize() -> dict[str, dict[str, Any]]:
    """sitecustomize/usercustomize change every Python process silently (the game plan's NCCL tuning hid there)."""
    out = {}
    for mod in ("sitecustomize", "usercustomize"):
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            spec = None
        origin = spec.origin if spec and spec.origin and os.path.isfile(spec.origin) else None
        out[mod] = {"importable": spec is not None, "active": mod in sys.modules, "path": origin,
                    "hash": file_hash(origin) if origin else None}
    return out


def versions() -> dict[str, str | None]:
    import torch

    torch_v, cuda = torch.__version__, torch.version.cuda
    return {"python": platform.python_version(), "engine": _version("specbook"), "torch": torch_v,
            "transformers": _version("transformers"), "cuda": cuda, "papermill": _version("papermill")}


@functools.lru_cache(maxsize=1)
def cpu_isa() -> str:
    """The widest vector instructions the processor has (avx512, avx2, ...): on x86 the CPU's math picks its code
    path by them unless told otherwise (kernel_environ), and paths round differently."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("flags", "features")):
                flags = set(line.split(":", 1)[1].split())
                return next((isa for isa, flag in (("avx512", "avx512f"), ("avx2", "avx2"), ("avx", "avx"),
                                                    ("sve", "sve"), ("neon", "asimd")) if flag in flags), "other")
    except OSError:
        pass
    return platform.machine()


def kernel_environ(root: Path) -> dict[str, str]:
    """The variables a runbook kernel starts with: the project's [tool.specbook.kernel_env], each unless this
    process's environment sets it (then that value, which the fingerprint records)."""
    return {k: os.environ.get(k, v) for k, v in project.settings(root).kernel_env.items()}


def machine() -> dict[str, Any]:
    """This machine's kind, as a run's provenance names it: its GPUs and its processor."""
    names = gpus()
    return {"gpu": {"count": len(names), "names": sorted(set(names)), "driver": _driver() if names else None,
                    "uuids": list(gpu_uuids()), "memory_gib": list(gpu_memory_gib())},
            "cpu": {"model": cpu_model(), "count": os.cpu_count(), "isa": cpu_isa()}}


def fingerprint(root: Path, runbook_source: str | None = None, params: dict | None = None,
                inputs: dict[str, str] | None = None) -> dict[str, Any]:
    """Provenance of a run on this machine (docs/architecture.md, Records)."""
    names = gpus()
    commit, dirty = _git_state(root)
    fp: dict[str, Any] = {
        "git_commit": commit,
        "git_dirty": dirty,
        "runbook_hash": sha(runbook_source) if runbook_source is not None else None,
        "params_hash": sha(canonical(params)) if params is not None else None,
        "engine_hash": engine_hash(root, runbook_source, params),
        "versions": versions(),
        **machine(),
        "env": dict(sorted({**{k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)},
                            **kernel_environ(root)}.items())),
        "sitecustomize": _customize(),
        "platform": platform.platform(),
        "profile": profile_of(names),
        "date": now_iso(),
    }
    for name, h in (inputs or {}).items():
        fp[f"{name}_manifest"] = h
    return fp


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
