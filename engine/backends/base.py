"""A serving engine run as a subprocess: one base for start, wait-for-health and stop (SGLang, vLLM)."""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine.errors import EngineError
from engine.spec_settings import SpecSettings


@dataclass
class LaunchConfig:
    """What a runbook decides about a server; each backend turns it into its own command line."""

    model: str
    drafter: str | None = None  # None: no speculation (the baseline)
    spec: SpecSettings = field(default_factory=SpecSettings)
    tp: int = 1
    cuda_graphs: bool = True
    cuda_graph_max_bs: int | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    # Opt-in: the flag lets the server run Python shipped with the checkpoint (modeling / tokenizer code).
    trust_remote_code: bool = False
    api_key: str | None = None
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # NCCL_* and friends, added to this process's environment
    python: str = "python"
    startup_timeout_s: float = 1800.0  # loading a 1T-parameter checkpoint on eight GPUs takes many minutes

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():  # the servers would run without authentication
            raise EngineError("the API key must not be empty (leave it out to serve without authentication)")


class ServerProcess:
    """Start a server command in its own process group, wait until /health answers 200, stop it."""

    health_path = "/health"

    def __init__(self, cfg: LaunchConfig, log_path: str | Path | None = None):
        self.cfg = cfg
        self.log_path = Path(log_path) if log_path else None  # default: a new temporary file at start()
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    def environ(self) -> dict[str, str]:
        return {**os.environ, **self.cfg.env}

    def start(self) -> "ServerProcess":
        if self.proc is not None:
            raise EngineError(f"{type(self).__name__} already started")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"{type(self).__name__}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        with open(self.log_path, "wb") as log:
            # A new session: tensor-parallel workers are children of the launcher; stop() signals them all.
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.environ(), start_new_session=True)
        return self

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float | None = None, poll: float = 0.5) -> None:
        """Block until the health endpoint answers 200; fail early when the process exits."""
        assert self.proc is not None, "start() first"
        timeout = self.cfg.startup_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        url = self.base_url + self.health_path
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(f"{self.command()[0]} exited with code {self.proc.returncode} before it was "
                                  f"healthy; log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(url, timeout=poll * 4).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll)
        raise EngineError(f"{url} not healthy after {timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL what is left after `grace` seconds; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        self._signal(signal.SIGKILL)  # stray workers of an exited launcher
        return self.proc.returncode

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "ServerProcess":
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
