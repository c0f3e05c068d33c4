"""baselines/<runbook>.yaml: load, validate, and change under a lock with atomic replace.

Nothing is lost: a write goes to a temporary file that replaces the record in one step (a killed run leaves the old
file), read-modify-write holds a file lock (two runs both land), and a file whose bytes changed since they were read
(a hand edit) is never overwritten.

A record file is data, not a document: every write re-serialises the whole file, so comments written into it by
hand vanish on the next run (put notes in a metric's `description`, or in the docs). YAML anchors and aliases are
refused (a record never needs them, and a few hundred bytes of nested aliases expand to gigabytes), and so are NaN
and infinity wherever a number is expected.
"""

from __future__ import annotations

import copy
import datetime as dt
import math
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock
import yaml

from specbook import SpecbookError
from specbook.fsutil import atomic_write
from specbook.provenance import sha
from specbook.record import DIRECTIONS, KINDS, Metric

BASELINES = "baselines"
SOURCES = ("measured", "reported")
COMMIT = re.compile(r"[0-9a-f]{4,40}")  # what a record may name as its commit: a commit id, full or abbreviated
LOCK_TIMEOUT_S = 120.0
# libyaml when present: record files grow with every run and history entry
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


@dataclass
class RecordFile:
    path: Path
    data: dict[str, Any]
    digest: str | None  # hash of the bytes read; None when the file did not exist

    @property
    def name(self) -> str:
        return self.data["runbook"]


def path_for(root: Path, name: str) -> Path:
    return root / BASELINES / f"{name}.yaml"


def _state_dir(path: Path, kind: str) -> Path:
    """.specbook/KIND of the project a file under baselines/ belongs to (beside baselines/, so that temp files
    replace on the same filesystem)."""
    d = path.parent.parent / ".specbook" / kind
    d.mkdir(parents=True, exist_ok=True)
    return d


_locks: dict[Path, filelock.FileLock] = {}


def _file_lock(lock_file: Path) -> filelock.FileLock:
    # one object per file: a second FileLock on the same file in this process would deadlock against the first
    if lock_file not in _locks:
        _locks[lock_file] = filelock.FileLock(lock_file, timeout=LOCK_TIMEOUT_S)
    return _locks[lock_file]


def _lock(path: Path) -> filelock.FileLock:
    key = path.resolve()
    return _file_lock(_state_dir(key, "locks") / f"{key.name}.lock")


def docs_lock(root: Path) -> filelock.FileLock:
    """Held while docs/ and README.md are rewritten from the records (claim literals, generated files): concurrent
    `runbook run --record`s take turns, where one would otherwise refuse the file the other just wrote, or replace
    a generated file with what it computed before the other's record landed."""
    return _file_lock(_state_dir(Path(root).resolve() / BASELINES / "any", "locks") / "docs.lock")


def _show(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


_PARSED: dict[tuple[str, str], dict[str, Any]] = {}  # (path, content hash) -> validated data: status, the site and
# claims load every record file many times per command, and parsing is most of their time


def load(path: Path) -> RecordFile:
    if not path.exists():
        return RecordFile(path, {"runbook": path.stem, "profiles": {}}, None)
    raw = path.read_bytes()
    key = (str(path.resolve()), sha(raw))
    if key not in _PARSED:
        data = parse(raw, path)
        if len(_PARSED) >= 256:
            _PARSED.clear()
        _PARSED[key] = data
    return RecordFile(path, copy.deepcopy(_PARSED[key]), key[1])  # a copy: callers add runs to theirs


def parse(raw: bytes, path: Path) -> dict[str, Any]:
    """A record file's validated data from its bytes; `path` names it in errors (the file, or one inside an
    archive)."""
    try:
        _refuse_aliases(raw, path)
        data = yaml.load(raw, Loader=_LOADER)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{_show(path)}:{mark.line + 1}" if mark else _show(path)
        raise SpecbookError(f"{where}: malformed YAML: {getattr(e, 'problem', None) or e}") from None
    validate(data, path)
    return data


def _refuse_aliases(raw: bytes, path: Path) -> None:
    """Anchors and aliases are refused before anything is built from them: a few hundred bytes of nested aliases
    load as shared references but print (show, --json) as gigabytes. The event stream is checked, not the loaded
    data, because an alias is only visible there."""
    for event in yaml.parse(raw, Loader=_LOADER):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            line = event.start_mark.line + 1 if event.start_mark else "?"
            raise SpecbookError(f"{_show(path)}:{line}: YAML anchors and aliases are not allowed in a record file "
                                "(write the values out)")


def load_all(root: Path, skip_broken: bool = False) -> dict[str, RecordFile]:
    """Every record file; with skip_broken, malformed ones are left out (`broken` names them)."""
    out = {}
    for p in sorted((root / BASELINES).glob("*.yaml")):
        try:
            out[p.stem] = load(p)
        except SpecbookError:
            if not skip_broken:
                raise
    return out


def broken(root: Path) -> list[str]:
    """One line for each malformed record file in baselines/ (empty when all load)."""
    out = []
    for p in sorted((root / BASELINES).glob("*.yaml")):
        try:
            load(p)
        except SpecbookError as e:
            out.append(str(e))
    return out


def validate(data: Any, path: Path) -> None:
    def bad(where: str, problem: str) -> SpecbookError:
        return SpecbookError(f"{_show(path)}: {where}: {problem}")

    if not isinstance(data, dict) or set(data) != {"runbook", "profiles"}:
        raise bad("top level", "expected exactly the keys runbook and profiles")
    if data["runbook"] != path.stem:
        raise bad("runbook", f"is {data['runbook']!r} but the file is named for {path.stem!r}")
    if not isinstance(data["profiles"], dict):
        raise bad("profiles", "must be a mapping of profile name to runs and metrics")
    for pname, prof in data["profiles"].items():
        if not isinstance(pname, str) or not pname:
            raise bad(f"profiles.{_brief(pname)}", "a profile name must be a string")
        if not isinstance(prof, dict) or not isinstance(prof.get("runs"), list) \
                or not isinstance(prof.get("metrics"), dict):
            raise bad(f"profiles.{pname}", "needs a runs list and a metrics mapping")
        ids = set()
        for i, run in enumerate(prof["runs"]):
            _check_run(run, f"profiles.{pname}.runs[{i}]", bad)
            ids.add(run["id"])
        for mname, m in prof["metrics"].items():
            if not isinstance(mname, str) or not mname:
                raise bad(f"profiles.{pname}.metrics.{_brief(mname)}", "a metric name must be a string")
            _check_metric(m, ids, f"profiles.{pname}.metrics.{mname}", bad)


def _brief(x: Any, limit: int = 40) -> str:
    """A value as an error line quotes it: its repr (one line), cut short (a hand edit may be 400 digits long)."""
    try:
        text = repr(x)
    except ValueError:  # an int beyond Python's digit limit for str()
        text = f"<{type(x).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_number(x: Any) -> bool:
    """A finite int or float that a float can hold: NaN compares unequal to everything (never drifts, never
    matches), inf has no tolerance, and an int of 400 digits overflows every comparison with a float."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


# The provenance fields the commands read, and what each must be where present (a hand edit of one must be named,
# not crash every command that shows the record): a predicate and its description, a mapping of such per key, or
# _Each(shape) for a mapping from any string key to values of one shape.
@dataclass(frozen=True)
class _Each:
    shape: Any


def _text(x: Any) -> bool:
    return isinstance(x, str)


def _text_or_null(x: Any) -> bool:
    return x is None or isinstance(x, str)


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 31


TEXT, TEXT_OR_NULL = (_text, "a string"), (_text_or_null, "a string or null")
FLAG = (lambda x: isinstance(x, bool), "true or false")
TEXTS = (lambda x: isinstance(x, list) and all(map(_text, x)), "a list of strings")
PROVENANCE = {
    "git_dirty": FLAG, "runbook_hash": TEXT_OR_NULL, "params_hash": TEXT_OR_NULL, "engine_hash": TEXT_OR_NULL,
    "versions": _Each(TEXT_OR_NULL), "env": _Each(TEXT),
    "gpu": {"count": (_count, "a count (a whole number >= 0)"), "names": TEXTS, "uuids": TEXTS,
            "driver": TEXT_OR_NULL},
    "cpu": {"model": TEXT_OR_NULL, "count": (lambda x: x is None or _count(x), "a count or null"),
            "isa": TEXT_OR_NULL},
    "sitecustomize": _Each({"importable": FLAG, "active": FLAG, "path": TEXT_OR_NULL, "hash": TEXT_OR_NULL}),
    "platform": TEXT_OR_NULL, "profile": TEXT_OR_NULL, "date": TEXT_OR_NULL, "reported_by": TEXT,
    "others_cpu_share": (_is_number, "a finite number"),
}


def _conform(x: Any, shape: Any, where: str, bad) -> None:
    """Check `x` against `shape` (see PROVENANCE), naming the innermost field that does not fit."""
    if isinstance(shape, (dict, _Each)):
        if not isinstance(x, dict) or not all(isinstance(k, str) for k in x):
            raise bad(where, f"must be a mapping with string keys, not {_brief(x)}")
        for k, v in x.items():
            sub = shape.shape if isinstance(shape, _Each) else shape.get(k)
            if sub is not None:
                _conform(v, sub, f"{where}.{k}", bad)
        return
    ok, what = shape
    if not ok(x):
        raise bad(where, f"must be {what}, not {_brief(x)}")


def _plain(x: Any, depth: int = 0) -> bool:
    """JSON-like data (mappings with string keys, lists, strings, finite numbers, booleans, null), as parameters are:
    they are hashed as canonical JSON, which sorts keys."""
    if depth > 32:
        return False
    if isinstance(x, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in x.items())
    if isinstance(x, list):
        return all(_plain(v, depth + 1) for v in x)
    return x is None or isinstance(x, (str, bool)) or _is_number(x)


def _check_run(run: Any, where: str, bad) -> None:
    if not isinstance(run, dict) or not isinstance(run.get("id"), str):
        raise bad(where, "needs an id")
    if run.get("source") not in SOURCES:
        raise bad(where, f"source must be one of {', '.join(SOURCES)}")
    try:
        parse_date(run.get("date"))
    except (TypeError, ValueError):
        raise bad(where, f"date {run.get('date')!r} is not an ISO date like 2026-11-29T14:40:00Z") from None
    if not isinstance(run.get("provenance"), dict):
        raise bad(where, "needs a provenance mapping")
    commit = run["provenance"].get("git_commit")
    if commit is not None and not (isinstance(commit, str) and COMMIT.fullmatch(commit)):
        raise bad(f"{where}.provenance.git_commit", f"must be a commit id (hex digits) or null, not {_brief(commit)}")
    if "seconds" in run and not (_is_number(run["seconds"]) and run["seconds"] >= 0):
        raise bad(where, f"seconds must be a number of seconds, not {run['seconds']!r}")
    if run["source"] == "measured" and not (isinstance(run.get("inputs_hash"), str)
                                            and isinstance(run.get("parameters"), dict)):
        raise bad(where, "a measured run needs inputs_hash (string) and parameters (mapping)")
    if "parameters" in run and not (isinstance(run["parameters"], dict) and _plain(run["parameters"])):
        raise bad(f"{where}.parameters", "must be a mapping of plain values (string keys, finite numbers)")
    for key, shape in PROVENANCE.items():
        if key in run["provenance"]:
            _conform(run["provenance"][key], shape, f"{where}.provenance.{key}", bad)
    for key, value in run["provenance"].items():
        if not isinstance(key, str):
            raise bad(f"{where}.provenance.{_brief(key)}", "a provenance field name must be a string")
        if key.endswith("_manifest") and not _text_or_null(value):
            raise bad(f"{where}.provenance.{key}", f"must be a string, not {_brief(value)}")


def _check_metric(m: Any, run_ids: set[str], where: str, bad) -> None:
    if not isinstance(m, dict) or not _is_number(m.get("value")):
        raise bad(where, "needs a numeric value (finite: no NaN or infinity)")
    if not isinstance(m.get("unit"), str):
        raise bad(where, "needs a unit (string)")
    if not isinstance(m.get("description", ""), str):
        raise bad(f"{where}.description", f"must be a string, not {_brief(m['description'])}")
    if m.get("direction") not in DIRECTIONS:
        raise bad(where, f"direction must be one of {', '.join(DIRECTIONS)}")
    if m.get("kind", kind_of(m)) not in KINDS:
        raise bad(where, f"kind must be one of {', '.join(KINDS)}")
    tol = m.get("tolerance", {})
    if not isinstance(tol, dict) or set(tol) - {"rel", "abs"} or \
            not all(_is_number(v) and v >= 0 for v in tol.values()):
        raise bad(where, "tolerance must be {rel: finite number >= 0, abs: finite number >= 0}")
    if m.get("run") not in run_ids:
        raise bad(where, f"run {m.get('run')!r} is not among this profile's runs")
    if not isinstance(m.get("samples", []), list) or not all(_is_number(s) for s in m.get("samples", [])):
        raise bad(where, "samples must be a list of finite numbers")
    if not isinstance(m.get("history", []), list):
        raise bad(where, "history must be a list")
    for i, h in enumerate(m.get("history", [])):
        if not isinstance(h, dict) or not _is_number(h.get("value")):
            raise bad(f"{where}.history[{i}]", "needs a numeric value (finite: no NaN or infinity)")
        if not isinstance(h.get("run"), str):
            raise bad(f"{where}.history[{i}].run", f"must be a run id (string), not {_brief(h.get('run'))}")


def dump(data: dict[str, Any]) -> str:
    return yaml.dump(data, Dumper=_DUMPER, sort_keys=False, default_flow_style=None, width=120, allow_unicode=True)


def save(rf: RecordFile) -> None:
    """Replace the file atomically, unless someone changed it since `rf` was read."""
    text = dump(rf.data).encode()
    with _lock(rf.path):
        now = sha(rf.path.read_bytes()) if rf.path.exists() else None
        if now != rf.digest:
            raise SpecbookError(f"{_show(rf.path)} changed since it was read (edited by hand?); not overwritten, "
                                "run again")
        rf.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(rf.path, text, tmp_dir=_state_dir(rf.path, "tmp"))  # no temp file in baselines/ if killed
    rf.digest = sha(text)


def new_run_id(date: str) -> str:
    return date.replace("-", "").replace(":", "") + "-" + secrets.token_hex(2)


def add_run(root: Path, name: str, profile: str, run: dict[str, Any], metrics: list[Metric]) -> list[str]:
    """Append a run to a profile and make its metrics the profile's recorded values (history appended), under the
    lock. A metric the run did not record is dropped: the record is what the runbook measures now, and a number it
    no longer produces could never be verified again. Returns the dropped names."""
    path = path_for(root, name)
    with _lock(path):
        rf = load(path)
        prof = rf.data["profiles"].setdefault(profile, {"runs": [], "metrics": {}})
        prof["runs"].append(run)
        for m in metrics:
            history = prof["metrics"].get(m.name, {}).get("history", [])
            entry: dict[str, Any] = {"value": m.value, "unit": m.unit, "direction": m.direction, "kind": m.kind,
                                     "tolerance": {"rel": m.rel_tol, "abs": m.abs_tol}, "run": run["id"]}
            if m.samples:
                entry["samples"] = m.samples
            if m.description:
                entry["description"] = m.description
            entry["history"] = [*history, {"value": m.value, "run": run["id"], "date": run["date"]}]
            prof["metrics"][m.name] = entry
        dropped = sorted(set(prof["metrics"]) - {m.name for m in metrics})
        for gone in dropped:
            del prof["metrics"][gone]
        validate(rf.data, path)
        save(rf)
    return dropped


def kind_of(entry: dict[str, Any]) -> str:
    """noisy or exact; records made before kinds existed: exact when the direction is none."""
    return entry.get("kind") or ("exact" if entry.get("direction") == "none" else "noisy")


def run_of(prof: dict[str, Any], run_id: str) -> dict[str, Any]:
    return next(r for r in prof["runs"] if r["id"] == run_id)


def parse_date(value: Any) -> dt.datetime:
    """A run date as an aware datetime (YAML may already have parsed it; no zone means UTC)."""
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        value = dt.datetime(value.year, value.month, value.day)
    elif not isinstance(value, dt.datetime):
        value = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
