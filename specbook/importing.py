"""Records made on another machine brought into this tree: `runbook import ARCHIVE`.

A lent GPU machine records in a copy of this tree and packs what its runs wrote (scripts/gpu-runbooks.sh:
baselines/*.yaml and docs/runbooks/executed/*.ipynb in results.tgz). Importing takes it profile by profile, as a
fast-forward: a profile's section of a record file is taken from the archive only when it holds every run this
tree's section holds, in the same order, and more. So a run recorded here is never lost, an older archive never
replaces a newer record, and the other profiles of the same file (this machine's cpu records, made meanwhile) stay as
they are. The executed notebook of each imported section comes with it; nothing else in the archive is read.
"""

from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from specbook import SpecbookError
from specbook.execute import EXECUTED
from specbook.fsutil import atomic_write
from specbook.records import BASELINES, RecordFile, load, parse, path_for, save
from specbook.runbooks import discover

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

IMPORTED, SAME, DIVERGED, OLDER = "imported", "same", "diverged", "older"


@dataclass
class Section:
    """One profile of one record file in the archive, and what importing it does."""
    runbook: str
    profile: str
    state: str  # IMPORTED, SAME (nothing new), DIVERGED (this tree has runs the archive lacks), OLDER (a prefix)
    added: list[str]  # run ids the archive adds (IMPORTED)
    commit: str | None  # the newest run's commit
    notebook: bool  # its executed notebook came along


@dataclass
class Archive:
    records: dict[str, dict[str, Any]]  # runbook -> validated record data
    notebooks: dict[str, bytes]  # "NAME-PROFILE.ipynb" -> content


def read_archive(path: Path) -> Archive:
    """The record files and executed notebooks in a tar archive (any compression), each record validated. Members
    are matched by their exact place (baselines/NAME.yaml, docs/runbooks/executed/NAME.ipynb, an optional leading
    ./); nothing is extracted, so a member's path cannot write anywhere."""
    try:
        tar = tarfile.open(path, "r:*")
    except FileNotFoundError:
        raise SpecbookError(f"{path}: no such archive") from None
    except (tarfile.TarError, OSError):
        raise SpecbookError(f"{path}: not a readable tar archive (plain, gzip, bzip2 or xz)") from None
    records: dict[str, dict[str, Any]] = {}
    notebooks: dict[str, bytes] = {}
    with tar:
        for m in tar:
            if not m.isfile():
                continue
            parts = PurePosixPath(m.name.removeprefix("./")).parts
            where, file = "/".join(parts[:-1]), parts[-1] if parts else ""
            if not NAME.fullmatch(file):
                continue
            if where == BASELINES and file.endswith(".yaml"):
                data = parse(_read(tar, m), Path(f"{path}:{m.name}"))
                if data.get("runbook") != file.removesuffix(".yaml"):
                    raise SpecbookError(f"{path}:{m.name}: the file names runbook {data.get('runbook')!r}")
                records[file.removesuffix(".yaml")] = data
            elif where == EXECUTED.as_posix() and file.endswith(".ipynb"):
                notebooks[file] = _read(tar, m)
    if not records:
        raise SpecbookError(f"{path}: no record files (baselines/*.yaml) in it")
    return Archive(records, notebooks)


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    f = tar.extractfile(member)
    if f is None:
        raise SpecbookError(f"{member.name}: cannot be read from the archive")
    return f.read()


def _ids(section: dict[str, Any] | None) -> list[str]:
    return [r["id"] for r in (section or {}).get("runs", [])]


def judge(ours: dict[str, Any] | None, theirs: dict[str, Any]) -> tuple[str, list[str]]:
    """How a profile's section in the archive relates to this tree's: (state, the run ids it adds)."""
    mine, new = _ids(ours), _ids(theirs)
    if new == mine:
        return SAME, []
    if new[:len(mine)] == mine:
        return IMPORTED, new[len(mine):]
    if mine[:len(new)] == new:
        return OLDER, []
    return DIVERGED, []


def plan(root: Path, archive: Archive, profiles: list[str] | None = None) -> list[Section]:
    """Every profile section of the archive (only `profiles` when given) with what importing it would do."""
    if unknown := sorted(set(archive.records) - set(discover(root))):
        raise SpecbookError(f"the archive holds records of runbooks this tree does not have: {', '.join(unknown)}")
    out = []
    for name, data in sorted(archive.records.items()):
        ours = load(path_for(root, name)).data["profiles"]
        for profile, theirs in data["profiles"].items():
            if profiles is not None and profile not in profiles:
                continue
            state, added = judge(ours.get(profile), theirs)
            runs = theirs.get("runs") or [{}]
            commit = runs[-1].get("provenance", {}).get("git_commit")
            out.append(Section(name, profile, state, added, commit, f"{name}-{profile}.ipynb" in archive.notebooks))
    return out


def apply(root: Path, archive: Archive, sections: list[Section]) -> list[Section]:
    """Write the IMPORTED sections into baselines/ (each file under its lock, atomically, refused if it changed
    since it was read) and their executed notebooks into docs/runbooks/executed/. Returns those written."""
    done = []
    for name in sorted({s.runbook for s in sections if s.state == IMPORTED}):
        rf: RecordFile = load(path_for(root, name))
        mine = [s for s in sections if s.runbook == name and s.state == IMPORTED]
        for s in mine:  # judged again on what is read now: the file may have changed since the plan
            if judge(rf.data["profiles"].get(s.profile), archive.records[name]["profiles"][s.profile])[0] != IMPORTED:
                raise SpecbookError(f"{path_for(root, name)} changed while importing ({s.profile}); run again")
        for s in mine:
            rf.data["profiles"][s.profile] = archive.records[name]["profiles"][s.profile]
        save(rf)
        for s in mine:
            nb = f"{name}-{s.profile}.ipynb"
            if nb in archive.notebooks:
                dest = root / EXECUTED / nb
                dest.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(dest, archive.notebooks[nb])
        done += mine
    return done
