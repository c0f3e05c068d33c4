"""Atomic file writes: the one way the engine writes a file that others read (checkpoints, configs, training state).
Torch-free. specbook keeps its own (specbook.fsutil) for its records: the engine never imports specbook, and
specbook does not import the engine (importing it starts the timing lock's device hold, engine.quiet)."""
from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

NEW_FILE_MODE = 0o666  # less the umask, as open() would create it


def atomic_write(path: str | Path, data: bytes | str | Callable[[Path], None]) -> None:
    """Replace `path` in one step: a reader sees the old file or the new one, never half of one, and a failed or
    killed writer leaves the old file. `data` is the content (str: UTF-8 text) or a writer that writes the file it is
    given (safetensors' save_file, torch.save). The file keeps an existing file's mode; a new one gets 0o666 less the
    umask, like open() - whatever mode the writer gave it (safetensors writes 0600). The temporary file lies beside
    `path`, hidden, under a name of its own (concurrent writers never share one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    # O_EXCL: never follow or reuse someone else's file; the kernel applies the umask to the new file's mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, NEW_FILE_MODE)
    try:
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if callable(data):
            os.close(fd)
            fd = -1
            data(tmp)
        else:
            with os.fdopen(fd, "wb") as f:
                fd = -1
                f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, mode)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the bytes on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
