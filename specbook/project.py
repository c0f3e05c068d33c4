"""The project's own settings for specbook, from `[tool.specbook]` in the repository's pyproject.toml:

    [tool.specbook]
    engine_package = "engine"      # the package whose code a runbook's engine hash covers (engine_hash)
    timing_lock = true             # the engine keeps the timing lock (specbook.parallel): exact runbooks may run
                                   # beside a timing one on its GPU
    headlines = "headlines.yaml"   # the headline numbers and their goals (specbook.headlines)
    [tool.specbook.inputs]         # named inputs a runbook may declare (`inputs: [corpus]`)
    corpus = "engine.train.corpus:manifest_hash"   # module:function, called without arguments, returns a hash;
                                   # while SPECBOOK_OFFLINE=1 it downloads nothing (raises instead: `site --check`)
    [tool.specbook.same_parameters]  # a machine that runs another's profiles, recorded apart
    h100 = "h200"
    [tool.specbook.kernel_env]     # variables every runbook kernel starts with (unless the environment sets them)
    MKL_CBWR = "AVX2"              # e.g. one code path for the CPU's math on every x86 machine

specbook itself names no project package: what it fingerprints is configured here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from specbook import SpecbookError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

OFFLINE_ENV = "SPECBOOK_OFFLINE"  # what an input function honours: fetch nothing, raise instead


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """Input functions called inside download nothing (OFFLINE_ENV): a command documented to write nothing, such as
    `runbook site --check`, must not fill a cache either; an input that is not here then cannot be hashed."""
    before = os.environ.get(OFFLINE_ENV)
    os.environ[OFFLINE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(OFFLINE_ENV, None)
        else:
            os.environ[OFFLINE_ENV] = before


_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_PACKAGE = re.compile(r"^[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Settings:
    engine_package: str | None = None  # None: no engine code is fingerprinted
    inputs: dict[str, str] = field(default_factory=dict)  # name -> "module:function"
    timing_lock: bool = False  # the engine keeps the timing lock's protocol (specbook.parallel, TIMING_LOCK_ENV)
    kernel_env: dict[str, str] = field(default_factory=dict)  # what every runbook kernel starts with
    headlines: str | None = None  # the file naming the headline numbers (specbook.headlines), relative to the root
    same_parameters: dict[str, str] = field(default_factory=dict)  # machine -> machine whose profiles it runs


def settings(root: Path) -> Settings:
    path = Path(root) / "pyproject.toml"
    try:
        stat = path.stat()
    except OSError:
        return Settings()
    return _load(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)  # keyed by mtime and size: `runbook status` asks once per runbook and profile
def _load(path: Path, mtime_ns: int, size: int) -> Settings:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise SpecbookError(f"{path}: unreadable: {e}") from None
    tool = data.get("tool", {}).get("specbook", {})
    if not isinstance(tool, dict):
        raise SpecbookError(f"{path}: [tool.specbook] must be a table")
    package = tool.get("engine_package")
    if package is not None and not (isinstance(package, str) and _PACKAGE.match(package)):
        raise SpecbookError(f"{path}: tool.specbook.engine_package must be a top-level package name, not {package!r}")
    inputs = tool.get("inputs", {})
    if not isinstance(inputs, dict):
        raise SpecbookError(f"{path}: [tool.specbook.inputs] must be a table of name = \"module:function\"")
    for name, target in inputs.items():
        if not (isinstance(target, str) and _TARGET.match(target)):
            raise SpecbookError(f"{path}: tool.specbook.inputs.{name} must be \"module:function\", not {target!r}")
    timing_lock = tool.get("timing_lock", False)
    if not isinstance(timing_lock, bool):
        raise SpecbookError(f"{path}: tool.specbook.timing_lock must be true or false, not {timing_lock!r}")
    kernel_env = tool.get("kernel_env", {})
    if not (isinstance(kernel_env, dict) and all(isinstance(v, str) for v in kernel_env.values())):
        raise SpecbookError(f"{path}: [tool.specbook.kernel_env] must be a table of NAME = \"value\" (strings)")
    headlines = tool.get("headlines")
    if headlines is not None and not (isinstance(headlines, str) and headlines and not Path(headlines).is_absolute()
                                      and ".." not in Path(headlines).parts):
        raise SpecbookError(f"{path}: tool.specbook.headlines must be a file path inside the repository, not "
                            f"{headlines!r}")
    same = tool.get("same_parameters", {})
    if not (isinstance(same, dict) and all(isinstance(k, str) and isinstance(v, str) and _PACKAGE.match(k)
                                           and _PACKAGE.match(v) and k != v for k, v in same.items())):
        raise SpecbookError(f"{path}: [tool.specbook.same_parameters] must be a table of machine = \"machine\"")
    return Settings(package, dict(inputs), timing_lock, dict(kernel_env), headlines, dict(same))


def input_function(target: str) -> Callable[[], object]:
    """The function a "module:function" input names (imported now: a missing module raises ImportError)."""
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def yaml_list(path: Path, key: str, shape: str) -> list:
    """The list under `key` of a committed YAML file of the project (headlines, owed re-records); a file that does
    not read, or holds no such list, is one line (SpecbookError) naming the file and the expected `shape`."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise SpecbookError(f"{path}: unreadable: {type(e).__name__}: {e}".splitlines()[0]) from None
    items = data.get(key) if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise SpecbookError(f"{path}: must hold `{key}:`, a list of {shape}")
    return items
