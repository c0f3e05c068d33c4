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


def _number(what: str, x: object) -> float:
    # bool is an int subclass; True as a measurement is always a mistake
    if isinstance(x, bool) or not hasattr(x, "__float__"):
        raise ValueError(f"{what} must be a number, got {type(x).__name__}")
    v = float(x)
    if not math.isfinite(v):
        raise ValueError(f"{what} must be finite, got {v}")
    return v


def make_metric(name: str, value: float, *, unit: str, direction: str = "higher", rel_tol: float = 0.0,
                abs_tol: float = 0.0, samples=None, description: str = "") -> Metric:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"metric name {name!r} must match {_NAME.pattern}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction of {name} must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    rel, abs_ = _number(f"rel_tol of {name}", rel_tol), _number(f"abs_tol of {name}", abs_tol)
    if rel < 0 or abs_ < 0:
        raise ValueError(f"tolerances of {name} must be >= 0")
    return Metric(name=name, value=_number(f"value of {name}", value), unit=str(unit), direction=direction,
                  rel_tol=rel, abs_tol=abs_, samples=[_number(f"sample of {name}", s) for s in (samples or [])],
                  description=str(description))


def record(name: str, value: float, *, unit: str, direction: str = "higher", rel_tol: float = 0.0,
           abs_tol: float = 0.0, samples=None, description: str = "") -> Metric:
    """Record one number of this runbook run. direction: higher | lower | none (any change beyond tolerance drifts)."""
    m = make_metric(name, value, unit=unit, direction=direction, rel_tol=rel_tol, abs_tol=abs_tol,
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
