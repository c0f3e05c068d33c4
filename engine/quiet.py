"""Quiet timing: a timed section has its device to itself while other processes' untimed work shares it.

A runner (specbook's verify and record) may run processes whose numbers are exact - training, accept lengths:
deterministic whatever else runs - beside one that times something, on one GPU. It tells each the path of that
GPU's lock file and a role, in the environment (LOCK_ENV, ROLE_ENV); four flock(2) locks coordinate them:

- PATH, the device: every process holds it shared for as long as it works outside a timed section; a timed
  section exclusively.
- PATH.turn, the turnstile: a timed section holds it exclusively from before it asks for the device until it is
  done, so a process that reaches a yield point, or starts, waits there rather than take the device.
- PATH.timers: a timer holds it shared outside its timed sections, a timed section exclusively, and takes it before
  the turnstile. A timer's untimed work (its compiles, captures, warm-ups: most of a timing runbook's wall time) has
  no yield points, so a timer waiting for another one's untimed work to end waits here, where the background goes on,
  not at the turnstile, where it would stop the background for as long as that compile lasts.
- PATH.queue, the timers' turnstile: a timed section holds it exclusively from before it asks for PATH.timers until
  it is done, and a timer passes it before it takes PATH.timers shared again. So timers time in the order they asked:
  one that has just timed cannot take its shared hold back, and start another compile, ahead of one that waits.

So `timed()` waits until every other timer has reached a timed section of its own (or ended), then until every
background process has reached `yield_point()` (between two training steps, two generations) and emptied its device
queue; nothing but the timer runs on the device, or the host, while it times. Timers may share a device too: their
timed sections take turns, their untimed work overlaps everything else's.
The kernel drops a process's locks when it ends, so one that crashes blocks no one. Without LOCK_ENV every call here
does nothing: a process on its own times on a quiet machine anyway.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from engine.errors import EngineError

try:
    import fcntl  # POSIX: a runner shares a GPU this way only there
except ImportError:  # pragma: no cover - Windows: no runner sets LOCK_ENV there
    fcntl = None

LOCK_ENV = "SPECBOOK_TIMING_LOCK"
ROLE_ENV = "SPECBOOK_TIMING_ROLE"
ROLES = ("timer", "background")


OWNER_ENV = ROLE_ENV + "_OWNER"  # set by a background process for the processes it starts: they are its work


class _Locks:
    def __init__(self, path: str, role: str):
        if fcntl is None:
            raise EngineError(f"{LOCK_ENV} is set, but this system has no flock(2)")
        if role not in ROLES:
            raise EngineError(f"{ROLE_ENV}={role!r}: the timing role is one of {', '.join(ROLES)}")
        try:
            self.device: IO = open(path, "a")
            self.turn: IO = open(path + ".turn", "a")
            self.timers: IO = open(path + ".timers", "a")
            self.queue: IO = open(path + ".queue", "a")
        except OSError as e:
            raise EngineError(f"{LOCK_ENV}={path}: cannot open the timing lock: {e.strerror}") from None
        self.role, self.pid, self.depth = role, os.getpid(), 0

    def take_device_shared(self) -> None:
        """Pass the turnstile (wait while a timer holds it), then hold the device shared; a timer first passes the
        timers' queue and holds the timers' lock shared (in this order: a timer that held the device while it waited
        for that lock would keep the one timing from ever getting the device)."""
        if self.role == "timer":
            fcntl.flock(self.queue, fcntl.LOCK_SH)
            fcntl.flock(self.queue, fcntl.LOCK_UN)
            fcntl.flock(self.timers, fcntl.LOCK_SH)
        fcntl.flock(self.turn, fcntl.LOCK_SH)
        fcntl.flock(self.turn, fcntl.LOCK_UN)
        fcntl.flock(self.device, fcntl.LOCK_SH)

    def let_device_go(self) -> None:
        """Stop holding the device, once this process's queued work on it has run."""
        _idle_device()
        fcntl.flock(self.device, fcntl.LOCK_UN)


_locks: _Locks | None = None


def _mine() -> _Locks | None:
    """This process's locks, opened on first use (the process then holds the device shared); None without
    LOCK_ENV, in a process forked from the owner (an inherited descriptor shares the parent's lock: letting it go
    here would let the parent's go) and in one the owner started (its parent holds the device)."""
    global _locks
    if _locks is None:
        path = os.environ.get(LOCK_ENV)
        if not path or os.environ.get(OWNER_ENV, str(os.getpid())) != str(os.getpid()):
            return None
        _locks = _Locks(path, os.environ.get(ROLE_ENV, "timer"))
        _locks.take_device_shared()
        os.environ[OWNER_ENV] = str(_locks.pid)
    return _locks if _locks.pid == os.getpid() else None


def _idle_device() -> None:
    """Wait until this process's queued device work has run: nothing of it may overlap a timed section."""
    torch = sys.modules.get("torch")  # not imported: this process has queued no device work
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def hold() -> None:
    """A process holds the device from its first call here on (engine/__init__ calls it, before any device work);
    elsewhere nothing."""
    _mine()


def yield_point() -> None:
    """Between two units of device work (outside a timed section): if a timer is waiting, let it time."""
    locks = _mine()
    if locks is None or locks.depth:
        return
    try:
        fcntl.flock(locks.turn, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # a timer holds the turnstile and waits for the device
        locks.let_device_go()
        locks.take_device_shared()
    else:
        fcntl.flock(locks.turn, fcntl.LOCK_UN)


@contextmanager
def timed() -> Iterator[None]:
    """A timed section: the device to itself for the block (a timer; nested sections share the outermost one's
    hold), or a yield point before it (a background process: it records no timings). A timer lets its shared holds
    go before it queues: a timer already queued waits for every shared hold to end, its own too."""
    locks = _mine()
    if locks is None or locks.role != "timer":
        yield_point()
        yield
        return
    if locks.depth == 0:
        locks.let_device_go()
        fcntl.flock(locks.timers, fcntl.LOCK_UN)
        fcntl.flock(locks.queue, fcntl.LOCK_EX)  # behind the timers that asked first
        fcntl.flock(locks.timers, fcntl.LOCK_EX)  # the other timers' untimed work ends; the background goes on
        fcntl.flock(locks.turn, fcntl.LOCK_EX)
        fcntl.flock(locks.device, fcntl.LOCK_EX)
    locks.depth += 1
    try:
        yield
    finally:
        locks.depth -= 1
        if locks.depth == 0:
            try:
                _idle_device()
            finally:
                fcntl.flock(locks.device, fcntl.LOCK_UN)
                fcntl.flock(locks.turn, fcntl.LOCK_UN)
                fcntl.flock(locks.timers, fcntl.LOCK_UN)
                fcntl.flock(locks.queue, fcntl.LOCK_UN)
                locks.take_device_shared()
