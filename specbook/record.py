"""The API runbooks call: `specbook.record(name, value, unit=..., direction=..., ...)`.

Inside `runbook run` the executor names a JSON-lines file in $SPECBOOK_RECORD_FILE and each call appends one line;
in a plain Python session the call only prints, so a runbook also works as a script.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

RECORD_FILE_ENV = "SPECBOOK_RECORD_FILE"
DIRECTIONS = ("higher", "lower", "none")
# noisy: a measurement with noise (tok/s, ms, a speedup; GPU training results), re-measured twice when it drifts;
# exact: a deterministic number (a loss, an accept length, a count with fixed seeds on CPU), compared once, tightly
KINDS = ("noisy", "exact")
MAX_NOISY_TOL = 0.25  # a wider tolerance would pass a real slowdown: measure against the noise instead
MAX_EXACT_TOL = 1e-3  # deterministic numbers reproduce to the last digits; this covers float summation order
MIN_NOISY_TOL = 0.1  # the floor of a tolerance derived from samples: runs differ more than repeats inside one run
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


@dataclass
class Metric:
    name: str
    value: float
    unit: str
    direction: str = "higher"
    rel_tol: float = 0.0
    abs_tol: float = 0.0
    samples: list[float] = field(default_factory=list)
    description: str = ""
    kind: str = "noisy"  # noisy | exact (KINDS)


def _number(what: str, x: object) -> float:
    # bool is an int subclass; True as a measurement is always a mistake
    if isinstance(x, bool) or not hasattr(x, "__float__"):
        raise ValueError(f"{what} must be a number, got {type(x).__name__}")
    v = float(x)
    if not math.isfinite(v):
        raise ValueError(f"{what} must be finite, got {v}")
    return v


def noisy_tolerance(samples: list[float], floor: float = MIN_NOISY_TOL) -> float:
    """A noisy number's relative tolerance from its samples: twice their relative spread, at least `floor`, at most
    MAX_NOISY_TOL (a number whose repeats spread wider than that is too noisy to verify, and says so)."""
    if len(samples) < 2:
        return floor
    mid = sorted(samples)[len(samples) // 2]
    spread = (max(samples) - min(samples)) / abs(mid) if mid else float("inf")
    return min(MAX_NOISY_TOL, max(floor, 2 * spread))


def make_metric(name: str, value: float, *, unit: str, direction: str = "higher", kind: str | None = None,
                rel_tol: float = 0.0, abs_tol: float = 0.0, samples=None, description: str = "") -> Metric:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"metric name {name!r} must match {_NAME.pattern}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction of {name} must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    kind = kind or ("exact" if direction == "none" else "noisy")
    if kind not in KINDS:
        raise ValueError(f"kind of {name} must be one of {', '.join(KINDS)}, got {kind!r}")
    rel, abs_ = _number(f"rel_tol of {name}", rel_tol), _number(f"abs_tol of {name}", abs_tol)
    if rel < 0 or abs_ < 0:
        raise ValueError(f"tolerances of {name} must be >= 0")
    samples = [_number(f"sample of {name}", s) for s in (samples or [])]
    if kind == "noisy":
        if rel > MAX_NOISY_TOL or abs_:
            raise ValueError(f"tolerance of noisy {name} must be relative and at most {MAX_NOISY_TOL} "
                             f"(got rel {rel:g}, abs {abs_:g}): a wider one passes a real slowdown")
        rel = noisy_tolerance(samples, floor=rel or MIN_NOISY_TOL)
    value = _number(f"value of {name}", value)
    if kind == "exact" and (rel > MAX_EXACT_TOL or abs_ > MAX_EXACT_TOL * max(1.0, abs(value))):
        raise ValueError(f"tolerance of exact {name} must be at most {MAX_EXACT_TOL} of its value (got rel {rel:g}, "
                         f"abs {abs_:g}): a deterministic number reproduces to the last digits")
    return Metric(name=name, value=value, unit=str(unit), direction=direction, kind=kind,
                  rel_tol=rel, abs_tol=abs_, samples=samples, description=str(description))


def record(name: str, value: float, *, unit: str, direction: str = "higher", kind: str | None = None,
           rel_tol: float = 0.0, abs_tol: float = 0.0, samples=None, description: str = "") -> Metric:
    """Record one number of this runbook run.

    direction: higher | lower | none (which way is better; none: any change beyond tolerance drifts).
    kind: noisy (e.g. a timing; its relative tolerance is derived from `samples`, with rel_tol as the floor, and
    is at most MAX_NOISY_TOL) or exact (deterministic; compared within MAX_EXACT_TOL of its value at most).
    Default: exact for direction none, else noisy."""
    m = make_metric(name, value, unit=unit, direction=direction, kind=kind, rel_tol=rel_tol, abs_tol=abs_tol,
                    samples=samples, description=description)
    path = os.environ.get(RECORD_FILE_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(m)) + "\n")
    else:
        print(f"{m.name} = {m.value:g} {m.unit}")
    return m


def read_metrics(path: Path) -> list[Metric]:
    """The metrics a run recorded, in order; a name recorded twice is an error in the runbook."""
    if not path.exists():
        return []
    metrics: dict[str, Metric] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        # checked again: a runbook may write the file itself, and JSON lets NaN and Infinity through
        try:
            fields = json.loads(line)
            m = make_metric(fields.pop("name"), fields.pop("value"), **fields)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed line in {path.name}: {line[:80]!r} ({type(e).__name__}: {e})") from None
        if m.name in metrics:
            raise ValueError(f"metric {m.name} was recorded twice in one run")
        metrics[m.name] = m
    return list(metrics.values())
