"""Atomic file writes: the one way specbook replaces a file that others read (records, executed notebooks, docs)."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

NEW_FILE_MODE = 0o666  # less the umask, as open() would create it


def atomic_write(path: Path, data: bytes, tmp_dir: Path | None = None) -> None:
    """Replace `path` with `data` in one step: a reader sees the old bytes or the new ones, never half of them, and a
    killed writer leaves the old file. The file keeps its mode (a new one gets 0o666 less the umask, like open());
    the temporary file lies in `tmp_dir` (default: beside `path`, hidden), which must be on the same filesystem."""
    path = Path(path)
    where = Path(tmp_dir) if tmp_dir is not None else path.parent
    tmp = where / f".{path.name}.{secrets.token_hex(4)}.tmp"
    try:
        mode: int | None = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = None
    # O_EXCL: never follow or reuse someone else's file; the kernel applies the umask to a new file's mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, NEW_FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # explicit: the umask must not narrow an existing file's mode
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
