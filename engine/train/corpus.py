"""The training corpus: the Python source inside pinned release archives of well-known pure-Python projects.

The archives (wheels, or sdists) are named by exact version and sha256 in `corpus.lock.toml` beside this file,
fetched once with pip into a cache directory and checked against their sha256 every time the corpus is scanned, so
the corpus is the same bytes on every machine and every Python. Files are read inside the archives (never
extracted), deduplicated by content hash and split into train / validation / test by that hash, so the split of a
file never depends on which other files exist.

Two groups of projects: "classic" (long-lived projects written before type hints: networkx, nltk, pygments, twisted,
docutils) and "typed" (modern type-annotated libraries and applications: mypy, SQLAlchemy 2, pydantic, the OpenAI
client, textual, ...). Two mixes stand in for the game plan's two targets: mix A (half classic) trains target "A"
(Kimi-K2), mix B (mostly typed) trains target "B" (Kimi-K2.5) further from A; mix AB, between the two, is the
drift dial's change of mixture. The held-out prompts for accept-length evaluation are windows of test files.

Where the archives live: $SPECBOOK_CORPUS_DIR when set (a directory filled elsewhere, for a machine without
network: `python -m engine train corpus --fetch` fills it), else $SPECBOOK_CACHE/corpus, else
$XDG_CACHE_HOME/specbook/corpus (~/.cache/specbook/corpus).
"""
from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MIN_FILE_BYTES = 256  # empty __init__.py files and stubs teach nothing
MAX_FILE_BYTES = 512 * 1024  # beyond this: generated tables and vendored blobs
SPLITS = {"train": (0, 90), "validation": (90, 95), "test": (95, 100)}  # percent ranges of the hash
LOCK = Path(__file__).with_name("corpus.lock.toml")
DIR_ENV, CACHE_ENV = "SPECBOOK_CORPUS_DIR", "SPECBOOK_CACHE"
OFFLINE_ENV = "SPECBOOK_OFFLINE"  # set (not 0): nothing is downloaded, a missing archive is an error instead
# A wheel is looked up as a pure-Python one for the oldest Python the project supports, whatever runs pip: the same
# file is chosen on every machine (its sha256 is pinned, so any other choice would be refused anyway).
WHEEL_TARGET = ("--platform", "any", "--implementation", "py", "--abi", "none", "--python-version", "3.10")

Sources = tuple[tuple[str, tuple[Path, ...]], ...]  # ((group, (archive, ...)), ...)


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    filename: str
    sha256: str
    group: str

    @property
    def is_wheel(self) -> bool:
        return self.filename.endswith(".whl")


@dataclass(frozen=True)
class SourceFile:
    archive: Path  # the wheel or sdist it is read from
    member: str  # its path inside the archive
    group: str  # "classic" | "typed"
    size: int
    digest: str  # blake2b of the content, hex

    @property
    def split(self) -> str:
        bucket = int(self.digest[:8], 16) % 100
        return next(name for name, (lo, hi) in SPLITS.items() if lo <= bucket < hi)

    def text(self) -> str | None:
        return _decode(_read(self.archive, {self.member}).get(self.member))


@dataclass(frozen=True)
class Mix:
    name: str
    weights: dict[str, float]  # group -> share of the bytes
    description: str


MIXES = {
    "A": Mix("A", {"classic": 0.5, "typed": 0.5}, "half classic untyped code: stands for Kimi-K2's training data"),
    "B": Mix("B", {"classic": 0.1, "typed": 0.9}, "shifted to modern typed code: Kimi-K2.5's further training"),
    "AB": Mix("AB", {"classic": 0.3, "typed": 0.7}, "between A and B: a smaller shift of the same kind (the drift "
                                                      "dial's change of mixture)"),
}


def get_mix(name: str) -> Mix:
    if name not in MIXES:
        raise EngineError(f"unknown corpus mix {name!r}; known: {', '.join(MIXES)}")
    return MIXES[name]


# ---- the pinned archives -----------------------------------------------------------------------------------------

def pins(lock: Path | None = None) -> tuple[Pin, ...]:
    """The lock's archives (default LOCK), in its order (the order decides which group keeps a file that two archives
    share)."""
    lock = lock or LOCK
    try:
        rows = tomllib.loads(lock.read_text(encoding="utf-8")).get("archive", [])
        out = tuple(Pin(**{k: str(row[k]) for k in ("name", "version", "filename", "sha256", "group")})
                    for row in rows)
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as e:
        raise EngineError(f"corpus lock {lock} is unreadable: {type(e).__name__}: {e}") from None
    if not out:
        raise EngineError(f"corpus lock {lock} names no [[archive]]")
    return out


def corpus_dir() -> Path:
    if given := os.environ.get(DIR_ENV):
        return Path(given).expanduser()
    if cache := os.environ.get(CACHE_ENV):
        return Path(cache).expanduser() / "corpus"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "specbook" / "corpus"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(pin: Pin, path: Path) -> None:
    got = sha256_of(path)
    if got != pin.sha256:
        raise EngineError(f"corpus archive {path} does not match its pinned sha256 (lock {pin.sha256[:16]}..., "
                          f"file {got[:16]}...): delete it to fetch it again, or restore the original")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _pip_download(batch: list[Pin], dest: Path) -> None:
    """One `pip download` of exact versions, each checked against its sha256 by pip's hash-checking mode."""
    reqs = dest / "requirements.txt"
    reqs.write_text("".join(f"{p.name}=={p.version} --hash=sha256:{p.sha256}\n" for p in batch))
    kind = ["--only-binary=:all:", *WHEEL_TARGET] if batch[0].is_wheel else ["--no-binary=:all:"]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes", *kind,
           "--dest", str(dest), "--requirement", str(reqs)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]
        why = lines[-1].strip() if lines else f"pip exited {r.returncode}"
        raise EngineError(f"could not fetch the corpus archives with pip ({why}); on a machine without network, "
                          f"copy a filled corpus directory here and set {DIR_ENV} to it")


def fetch(lock: Path | None = None, directory: Path | None = None,
          say: Callable[[str], None] = _say) -> dict[Pin, Path]:
    """The pinned archives in `directory` (default corpus_dir()), each verified; missing ones are fetched first with
    pip (exact version, hash-checked) into a temporary directory and moved in only once they match, unless
    SPECBOOK_OFFLINE is set. A complete directory is only read, so a read-only copy serves as well."""
    directory = directory or corpus_dir()
    todo = pins(lock)
    if missing := [p.filename for p in todo if not (directory / p.filename).is_file()]:
        if os.environ.get(OFFLINE_ENV, "0") not in ("", "0"):
            raise EngineError(f"{len(missing)} corpus archive(s) not in {directory} ({missing[0]}, ...), and "
                              f"{OFFLINE_ENV} forbids fetching them")
        try:
            _fetch_missing(todo, directory, say)
        except OSError as e:
            raise EngineError(f"cannot write the corpus directory {directory}: {e.strerror or e}") from None
    out = {}
    for p in todo:
        verify(p, directory / p.filename)
        out[p] = directory / p.filename
    return out


def _fetch_missing(todo: tuple[Pin, ...], directory: Path, say: Callable[[str], None]) -> None:
    from filelock import FileLock  # several processes may start on an empty cache at once

    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(directory / ".fetch.lock"):
        missing = [p for p in todo if not (directory / p.filename).is_file()]  # another process may have fetched
        if not missing:
            return
        say(f"corpus: fetching {len(missing)} pinned archive(s) with pip into {directory} "
            f"({', '.join(f'{p.name}=={p.version}' for p in missing)})")
        with tempfile.TemporaryDirectory(dir=directory, prefix=".fetch-") as tmp:
            for batch in ([p for p in missing if p.is_wheel], [p for p in missing if not p.is_wheel]):
                if batch:
                    _pip_download(batch, Path(tmp))
            for p in missing:
                got = Path(tmp) / p.filename
                if not got.is_file():
                    raise EngineError(f"pip fetched no {p.filename} for {p.name}=={p.version}: "
                                      "the lock's filename does not match the release")
                verify(p, got)
                os.replace(got, directory / p.filename)


def pinned_sources(lock: Path | None = None, directory: Path | None = None) -> Sources:
    """((group, (archive, ...)), ...) of the pinned corpus, groups in the lock's order of first appearance."""
    groups: dict[str, list[Path]] = {}
    for pin, path in fetch(lock, directory).items():
        groups.setdefault(pin.group, []).append(path)
    return tuple((g, tuple(paths)) for g, paths in groups.items())


# ---- reading inside archives -------------------------------------------------------------------------------------

def _wanted(name: str, size: int) -> bool:
    return name.endswith(".py") and MIN_FILE_BYTES <= size <= MAX_FILE_BYTES


def _members(archive: Path, names: set[str] | None = None) -> Iterator[tuple[str, bytes]]:
    """(member name, content) of the usable .py files of a wheel/zip or a tar sdist (only `names` when given)."""
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as z:
                for info in sorted(z.infolist(), key=lambda i: i.filename):
                    if _wanted(info.filename, info.file_size) and (names is None or info.filename in names):
                        yield info.filename, z.read(info)
        elif tarfile.is_tarfile(archive):
            with tarfile.open(archive, "r:*") as t:
                for m in t:  # one pass in archive order: a compressed tar has no random access
                    if m.isfile() and _wanted(m.name, m.size) and (names is None or m.name in names):
                        f = t.extractfile(m)
                        if f is not None:
                            yield m.name, f.read()
        else:
            raise EngineError(f"corpus archive {archive} is neither a zip (wheel) nor a tar (sdist) archive")
    except (OSError, zipfile.BadZipFile, tarfile.TarError, EOFError) as e:
        raise EngineError(f"cannot read corpus archive {archive}: {type(e).__name__}: {e}") from None


def _read(archive: Path, names: set[str]) -> dict[str, bytes]:
    return dict(_members(archive, names))


def _decode(data: bytes | None) -> str | None:
    try:
        return None if data is None else data.decode("utf-8")
    except UnicodeDecodeError:
        return None


# ---- the corpus --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def scan(sources: Sources | None = None) -> tuple[SourceFile, ...]:
    """All usable files, deduplicated by content (the first archive in the lock's order, then the first member in
    name order wins), sorted by digest. sources: ((group, (archive, ...)), ...); default: the pinned archives,
    fetched if missing and verified against the lock."""
    groups = pinned_sources() if sources is None else sources
    seen: dict[str, SourceFile] = {}
    for group, archives in groups:
        for archive in archives:
            for member, data in _members(archive):
                digest = hashlib.blake2b(data, digest_size=16).hexdigest()
                seen.setdefault(digest, SourceFile(archive, member, group, len(data), digest))
    return tuple(sorted(seen.values(), key=lambda f: f.digest))


def manifest_hash(files: tuple[SourceFile, ...] | None = None) -> str:
    """Fingerprint of the corpus (groups, sizes, content hashes): provenance's `corpus` input. Archive and member
    names are left out: the same content under another name or directory is the same training data."""
    files = scan() if files is None else files
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.group}\0{f.size}\0{f.digest}\n".encode())
    return h.hexdigest()[:16]


def select(mix: str, split: str, max_bytes: int, files: tuple[SourceFile, ...] | None = None) -> list[SourceFile]:
    """Files of one split for a mix: each group fills its share of the bytes in digest order (deterministic). When a
    group has fewer bytes than its share of max_bytes, the total shrinks so that the shares still hold."""
    if split not in SPLITS:
        raise EngineError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    m = get_mix(mix)
    files = scan() if files is None else files
    if not files:
        raise EngineError("empty corpus: no Python source files in the corpus archives")
    have = {g: sum(f.size for f in files if f.group == g and f.split == split) for g in m.weights}
    total = min([max_bytes] + [have[g] / share for g, share in m.weights.items() if share > 0])
    chosen: list[SourceFile] = []
    for group, share in m.weights.items():
        budget = share * total
        for f in files:
            if budget <= 0:
                break
            if f.group == group and f.split == split:
                chosen.append(f)
                budget -= f.size
    if not chosen:
        raise EngineError(f"empty corpus: no {split} files for mix {mix} (groups {', '.join(m.weights)})")
    return chosen


def texts(mix: str, split: str, max_bytes: int, files: tuple[SourceFile, ...] | None = None) -> list[str]:
    """The selected files' text in selection order; each archive is opened once (a tar can only be read through)."""
    chosen = select(mix, split, max_bytes, files)
    wanted: dict[Path, set[str]] = {}
    for f in chosen:
        wanted.setdefault(f.archive, set()).add(f.member)
    content = {(a, name): data for a, names in wanted.items() for name, data in _read(a, names).items()}
    return [t for f in chosen if (t := _decode(content.get((f.archive, f.member)))) is not None]


def prompts(n: int, chars: int = 600, mix: str = "A", files: tuple[SourceFile, ...] | None = None) -> list[str]:
    """Held-out prompts: n windows of test files, each starting at a line boundary a third into the file
    (file heads are mostly license boilerplate) and cut at a line end near `chars` characters."""
    out = []
    for t in texts(mix, "test", 10**12, files):
        if len(t) < 2 * chars:
            continue
        start = t.index("\n", len(t) // 3) + 1
        window = t[start:start + chars]
        cut = window.rfind("\n")
        if cut > chars // 2:
            out.append(window[:cut + 1])
        if len(out) == n:
            return out
    raise EngineError(f"only {len(out)} held-out prompts of {chars} characters in mix {mix}'s test split, {n} asked")


def stats(files: tuple[SourceFile, ...] | None = None) -> dict[str, dict[str, int]]:
    """Files and bytes per group and split, for `train corpus`."""
    files = scan() if files is None else files
    out: dict[str, dict[str, int]] = {}
    for f in files:
        row = out.setdefault(f"{f.group}/{f.split}", {"files": 0, "bytes": 0})
        row["files"] += 1
        row["bytes"] += f.size
    return dict(sorted(out.items()))
