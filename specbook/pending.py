"""Re-records the project owes: machines whose records an engine change made stale, before hardware to re-make them
was at hand (`baselines/pending/records.yaml`, committed):

    pending:
      - machine: h200
        since: 0123abc...           # the commit whose engine made them stale
        why: no lent GPU came in the session that landed the kernel choices (docs/findings.md, section 28)

A number of such a machine (its variants included) that is stale stays stale on every page - the status page says
the re-record is owed - but it is no docs problem on a machine that cannot re-measure it, so an engine change can
land without holding the docs hostage to a lease. An entry is itself a problem where it is not needed (nothing of
its machine is stale) or not honest (this machine could re-record it now)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from specbook import SpecbookError, project, provenance

PATH = Path("baselines") / "pending" / "records.yaml"


@dataclass(frozen=True)
class Owed:
    machine: str
    since: str
    why: str

    def words(self) -> str:
        return f"re-record owed since {self.since[:10]}: {self.why}"


def load(root: Path) -> dict[str, Owed]:
    """machine -> what is owed; {} without the file. A malformed file is one line (SpecbookError)."""
    path = Path(root) / PATH
    if not path.is_file():
        return {}
    items = project.yaml_list(path, "pending", "{machine, since, why}")
    out = {}
    for i, item in enumerate(items):
        ok = (isinstance(item, dict) and set(item) == {"machine", "since", "why"}
              and all(isinstance(item[k], str) and item[k].strip() for k in item)
              and re.fullmatch(r"[a-z0-9][a-z0-9-]*", item["machine"]) and re.fullmatch(r"[0-9a-f]{7,40}", item["since"]))
        if not ok:
            raise SpecbookError(f"{path}: pending[{i}] must be {{machine: NAME, since: COMMIT (hex), why: TEXT}}")
        out[item["machine"]] = Owed(item["machine"], item["since"], item["why"].strip())
    return out


def owed(root: Path, profile: str, here: str | None = None) -> Owed | None:
    """What is owed for a profile's machine, when this machine cannot re-measure it."""
    machine = provenance.hardware_of(profile)
    if machine == (here or provenance.detect_profile()):
        return None
    return load(root).get(machine)


def problems(root: Path, stale_profiles: set[str], here: str | None = None) -> list[str]:
    """Entries not needed (nothing of their machine stale) or that this machine could re-record itself."""
    here = here or provenance.detect_profile()
    out = []
    for machine, o in load(root).items():
        if machine == here:
            out.append(f"{machine} records are owed, and this machine is a {here}: re-record them here")
        elif not any(provenance.hardware_of(p) == machine for p in stale_profiles):
            out.append(f"nothing of {machine} is stale any more: remove its entry")
    return out
