"""Runbooks: jupytext percent-format notebooks in runbooks/, their YAML header and their parameters cell.

The header is the first markdown cell's ```yaml block; the cell tagged `parameters` holds literal defaults, whose
types are the types a parameter accepts (from the annotation when there is one).
"""

from __future__ import annotations

import ast
import copy
import functools
import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jupytext
import yaml

from specbook import RunFailed, SpecbookError, project

ROOT_ENV = "SPECBOOK_ROOT"
INJECTED = ("outputs_dir", "upstream")  # set by specbook when the parameters cell declares them
HEADER_KEYS = {"title", "reproduces", "feeds", "depends", "inputs", "profiles", "timeout", "cell_timeout",
               "conclusion", "outputs", "gpu_memory_gib"}
# header blocks that describe rather than compute: left out of the runbook's hash (a profile's parameters reach it as
# parameters), so adding a variant profile, naming the outputs or declaring the GPU memory leaves the records current
UNHASHED_KEYS = ("profiles", "outputs", "gpu_memory_gib")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict}


@dataclass
class Param:
    name: str
    default: Any
    types: tuple[type, ...] | None  # None: any literal (a None default without annotation)
    nullable: bool = False

    def describe(self) -> str:
        names = "any" if self.types is None else " | ".join(t.__name__ for t in self.types)
        return names + (" | None" if self.nullable else "")


@dataclass
class Runbook:
    name: str
    path: Path
    title: str
    profiles: dict[str, dict[str, Any]]
    parameters: dict[str, Param]
    reproduces: list[str] = field(default_factory=list)
    feeds: list[str] = field(default_factory=list)
    depends: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    timeout: float = 3600.0
    cell_timeout: float = 600.0
    conclusion: str = ""  # a sentence with {metric:spec} fields, printed after a run: what the numbers say
    # what a person takes away from a run: `paths` (name in the outputs directory -> what it is) and `command` (a
    # command line using them; {python}, {outputs_dir} and {DEPENDENCY} name the interpreter and outputs dirs)
    outputs: dict[str, Any] = field(default_factory=dict)
    # the most GPU memory a run takes on its GPU profiles (GiB, CUDA context included): runbooks sharing a GPU in a
    # record or verify start only while their declared memory fits the card's (specbook.parallel); 0: not declared
    gpu_memory_gib: float = 0.0

    @property
    def source(self) -> str:
        return self.path.read_text(encoding="utf-8")

    @property
    def hashed_source(self) -> str:
        """The source without the header's `profiles` and `outputs` blocks (UNHASHED_KEYS): a profile's parameters
        reach the inputs hash as parameters, so adding or changing another profile (a variant, another machine)
        leaves this one fresh, and naming the outputs changes no number."""
        return "\n".join(_without_unhashed(self.source.splitlines()))

    def params_for(self, profile: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """Effective parameters on a profile: defaults, then the profile's overrides, then the caller's."""
        if profile not in self.profiles:
            have = ", ".join(self.profiles) or "none"
            raise RunFailed(f"runbook {self.name} cannot run on profile {profile} (its profiles: {have})")
        params = {n: p.default for n, p in self.parameters.items() if n not in INJECTED}
        params.update(self.profiles[profile])
        params.update(overrides or {})
        return params


def find_root(explicit: str | os.PathLike | None = None) -> Path:
    """The repository root: --root, else $SPECBOOK_ROOT, else the nearest parent of cwd holding runbooks/."""
    given = explicit or os.environ.get(ROOT_ENV)
    if given:
        root = Path(given).resolve()
        if not (root / "runbooks").is_dir():
            raise SpecbookError(f"{root} has no runbooks/ directory")
        return root
    for d in (Path.cwd(), *Path.cwd().parents):
        if (d / "runbooks").is_dir() and (d / "pyproject.toml").exists():
            return d
    raise SpecbookError("not inside a specbook repository (no runbooks/ above the current directory); use --root")


def discover(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / "runbooks").glob("*.py") if _NAME.match(p.stem))


def check_name(name: str) -> None:
    if "/" in name or "\\" in name or ".." in name or not _NAME.match(name):
        raise SpecbookError(f"invalid runbook name {name!r}: use a plain name without path separators or '..'")


def known_profiles(root: Path) -> set[str]:
    """Profiles that some runbook's header declares or some record file holds (broken files are skipped: they are
    reported where they are read)."""
    from specbook import records  # records imports nothing from here; late to keep header parsing light

    known: set[str] = set()
    for name in discover(root):
        try:
            known.update(load(root, name).profiles)
        except SpecbookError:
            pass
    for rf in records.load_all(root, skip_broken=True).values():
        known.update(rf.data["profiles"])
    return known


def check_profile(root: Path, profile: str) -> None:
    """A profile named on the command line must be one the repository knows: a typo would otherwise run nothing
    (verify) or fail as if the runbook could not run here (run)."""
    known = known_profiles(root)
    if profile not in known:
        raise SpecbookError(f"unknown profile {profile!r}; known profiles: {', '.join(sorted(known)) or 'none'}")


def resolve(root: Path, name: str) -> Path:
    check_name(name)
    path = root / "runbooks" / f"{name}.py"
    if not path.exists():
        close = difflib.get_close_matches(name, discover(root), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; `runbook list` shows the {len(discover(root))}"
        raise SpecbookError(f"unknown runbook {name!r}{hint}")
    return path


@functools.lru_cache(maxsize=128)  # keyed by the text: a command resolves each runbook on every profile, many times
def _notebook(text: str):
    return jupytext.reads(text, fmt="py:percent")


def load(root: Path, name: str) -> Runbook:
    path = resolve(root, name)
    try:
        nb = copy.deepcopy(_notebook(path.read_text(encoding="utf-8")))
    except Exception as e:  # jupytext raises many types on odd input
        raise SpecbookError(f"{path}: not a jupytext percent-format notebook: {e}") from None
    header = _header(path, nb, root)
    params = _parameters(path, nb)
    rb = Runbook(name=name, path=path, title=header["title"], profiles=with_same_parameters(root, header["profiles"]),
                 parameters=params,
                 **{k: header[k] for k in ("reproduces", "feeds", "depends", "inputs", "timeout", "cell_timeout",
                                           "conclusion", "outputs", "gpu_memory_gib") if k in header})
    for profile, overrides in rb.profiles.items():
        for k, v in overrides.items():
            rb.profiles[profile][k] = check_value(rb, k, v, where=f"profile {profile}")
    return rb


def with_same_parameters(root: Path, profiles: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The header's profiles, plus those of machines the project runs on the parameters of another
    ([tool.specbook.same_parameters], e.g. h100 = "h200": an H100 runs what the H200 profile runs, recorded apart as
    h100, and its variants likewise). A runbook's own declaration of such a profile wins."""
    out = dict(profiles)
    for machine, source in project.settings(root).same_parameters.items():
        for name, params in profiles.items():
            hw, dot, variant = name.partition(".")
            if hw == source:
                out.setdefault(machine + dot + variant, dict(params))
    return out


def _without_unhashed(lines: list[str]) -> list[str]:
    out, skipping = [], False
    for line in lines:
        if line.startswith(tuple(f"# {k}:" for k in UNHASHED_KEYS)):
            skipping = True  # the key's line, then its indented lines (`#   cpu: ...`)
            continue
        if skipping and re.match(r"#\s{2,}\S", line):
            continue
        skipping = False
        out.append(line)
    return out


def _header(path: Path, nb, root: Path) -> dict[str, Any]:
    cells = [c for c in nb.cells if c.cell_type == "markdown"]
    m = re.search(r"```ya?ml\s*\n(.*?)```", cells[0].source if cells else "", re.S)
    if not m:
        raise SpecbookError(f"{path}: the first markdown cell has no ```yaml header block")
    try:
        h = yaml.safe_load(m.group(1))
    except yaml.YAMLError as e:
        raise SpecbookError(f"{path}: malformed YAML header: {str(e).splitlines()[0]}") from None
    if not isinstance(h, dict):
        raise SpecbookError(f"{path}: the YAML header must be a mapping")
    if unknown := set(h) - HEADER_KEYS:
        raise SpecbookError(f"{path}: unknown header keys {sorted(unknown)} (allowed: {sorted(HEADER_KEYS)})")
    if not isinstance(h.get("title"), str):
        raise SpecbookError(f"{path}: the header needs a title")
    for key in ("reproduces", "feeds", "depends", "inputs"):
        h.setdefault(key, [])
        if not isinstance(h[key], list) or not all(isinstance(x, str) for x in h[key]):
            raise SpecbookError(f"{path}: header key {key} must be a list of strings")
    profiles = h.get("profiles")
    if not isinstance(profiles, dict) or not profiles:
        raise SpecbookError(f"{path}: the header needs profiles (e.g. `profiles: {{cpu: {{}}}}`)")
    for p, o in profiles.items():
        if o is None:
            profiles[p] = {}
        elif not isinstance(o, dict):
            raise SpecbookError(f"{path}: profile {p} must map parameter names to values")
    _check_outputs(path, h.get("outputs", {}))
    if not isinstance(h.get("conclusion", ""), str):
        raise SpecbookError(f"{path}: header key conclusion must be a string with {{metric:spec}} fields")
    for key, unit in (("timeout", "seconds"), ("cell_timeout", "seconds"), ("gpu_memory_gib", "GiB")):
        if key in h and (isinstance(h[key], bool) or not isinstance(h[key], (int, float)) or h[key] <= 0):
            raise SpecbookError(f"{path}: header key {key} must be a positive number of {unit}")
    from specbook.provenance import known_inputs  # the project's configured inputs and those registered in code

    known = known_inputs(root)
    if unknown := [i for i in h["inputs"] if i not in known]:
        raise SpecbookError(f"{path}: unknown inputs {unknown} (known: {known})")
    return h


def _check_outputs(path: Path, outputs: Any) -> None:
    """`outputs: {paths: {NAME: what it is}, command: "..."}`, both optional."""
    if not isinstance(outputs, dict) or set(outputs) - {"paths", "command"}:
        raise SpecbookError(f"{path}: header key outputs must map paths (NAME: what it is) and command (a string)")
    paths = outputs.get("paths", {})
    if not isinstance(paths, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in paths.items()):
        raise SpecbookError(f"{path}: outputs.paths must map names in the outputs directory to what they are")
    if not isinstance(outputs.get("command", ""), str):
        raise SpecbookError(f"{path}: outputs.command must be a string")


def _parameters(path: Path, nb) -> dict[str, Param]:
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    if len(cells) > 1:
        raise SpecbookError(f"{path}: more than one cell is tagged parameters")
    if not cells:
        return {}
    try:
        tree = ast.parse(cells[0].source)
    except SyntaxError as e:
        raise SpecbookError(f"{path}: parameters cell, line {e.lineno}: {e.msg}") from None
    params: dict[str, Param] = {}
    for node in tree.body:
        where = f"{path}: parameters cell, line {node.lineno}"
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target = node.target
        else:
            target = None
        if not isinstance(target, ast.Name):
            raise SpecbookError(f"{where}: only `name = literal` assignments")
        try:
            default = ast.literal_eval(node.value)
        except ValueError:
            raise SpecbookError(f"{where}: {target.id} must be a literal") from None
        if isinstance(node, ast.AnnAssign):
            p = Param(target.id, default, *_annotation(where, node.annotation))
            if not (default is None and p.nullable or p.types is None or isinstance(default, p.types)):
                raise SpecbookError(f"{where}: default of {target.id} is not {p.describe()}")
        else:  # the default's type; a None default accepts any literal
            p = Param(target.id, default, None if default is None else (type(default),), default is None)
        params[target.id] = p
    return params


def _annotation(where: str, ann: ast.expr) -> tuple[tuple[type, ...] | None, bool]:
    """Types and nullability of `int`, `float | None`, `Optional[str]`, `list[int]` (element types unchecked)."""
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        (lt, ln), (rt, rn) = _annotation(where, ann.left), _annotation(where, ann.right)
        return (lt or ()) + (rt or ()) or None, ln or rn
    if isinstance(ann, ast.Constant) and ann.value is None:
        return None, True
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Optional":
        return _annotation(where, ann.slice)[0], True
    name = ann.value if isinstance(ann, ast.Subscript) else ann
    if isinstance(name, ast.Name) and name.id in _TYPES:
        return (_TYPES[name.id],), False
    raise SpecbookError(f"{where}: annotation must use {', '.join(_TYPES)}, None or Optional")


def check_value(rb: Runbook, name: str, value: Any, where: str = "parameter") -> Any:
    """The value as the parameter's type (an int is a valid float), or one clear error."""
    if name in INJECTED:
        raise SpecbookError(f"{where}: {name} is set by specbook, not by hand")
    if name not in rb.parameters:
        close = difflib.get_close_matches(name, list(rb.parameters), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; declared: {', '.join(rb.parameters) or 'none'}"
        raise SpecbookError(f"{where}: runbook {rb.name} has no parameter {name!r}{hint}")
    p = rb.parameters[name]
    if value is None and p.nullable or p.types is None:
        return value
    if float in p.types and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and bool not in p.types or not isinstance(value, p.types):
        raise SpecbookError(f"{where}: {name} of runbook {rb.name} must be {p.describe()}, got {value!r}")
    return value


def parse_cli(rb: Runbook, pairs: tuple[str, ...]) -> dict[str, Any]:
    """`-p key=value` pairs as typed values; strings stay raw for str parameters."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise SpecbookError(f"-p {pair!r}: expected key=value")
        p = rb.parameters.get(key)
        value = text if p is not None and p.types == (str,) else _literal(text)
        out[key] = check_value(rb, key, value, where=f"-p {pair}")
    return out


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return {"true": True, "false": False, "none": None, "null": None}.get(text.strip().lower(), text)
