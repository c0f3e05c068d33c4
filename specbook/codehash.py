"""The engine code a runbook runs, hashed by meaning: what a record's engine fingerprint covers.

A record goes stale when the code it ran would compute something different, not when a comment, a docstring or a
function no run calls changes. So the unit of hashing is a top-level definition (a function, a class, an import, a
module-level assignment; the bodies of module-level `if`/`try`/`with` count as top level), normalised as its AST
without docstrings (comments never reach the AST), and a runbook's fingerprint covers only the units it can reach:

- the modules its source imports, then those their included units import (absolute and relative imports);
- in those modules, every unit that binds no name (a statement run for its effect) and every unit whose name is
  referenced by included code - as an identifier, an attribute, an import alias or a string constant - and by the
  runbook's source and the string values of its parameters.

So a kernel that lands off by default (selected by name, e.g. `Kernels(verify_linear="rows")`) enters the fingerprint
of exactly the runs whose parameters name it, and a changed constant enters those of the runbooks that reach it.
References are by name, not resolved: a name defined in two modules includes both, which can only stale more.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

COMPOUND = (ast.If, ast.Try, ast.With)  # module-level blocks whose bodies define top-level names
DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class Unit:
    """One top-level definition of a module: the names it binds, its normalised text, what it references."""
    module: str  # dotted module name
    names: frozenset[str]  # empty: a statement run for its effect, always part of its module
    label: str  # how status names it: a function or class name, or `line N`
    digest: str  # hash of the normalised AST
    refs: frozenset[str]  # identifiers, attribute names, aliases and string constants it uses
    imports: frozenset[str]  # dotted module names it may load


@dataclass(frozen=True)
class Module:
    name: str
    path: str  # relative to the root, posix
    units: tuple[Unit, ...]
    star: frozenset[str]  # modules it imports with `*`: all their units are referenced


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, DOCSTRING_OWNERS) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return tree


def _top_level(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Module statements, with the bodies of module-level if/try/with flattened (their tests stand as units)."""
    for node in body:
        if isinstance(node, ast.If):
            yield node.test
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body)
            for h in node.handlers:
                if h.type is not None:
                    yield h.type
                yield from _top_level(h.body)
            yield from _top_level(node.orelse)
            yield from _top_level(node.finalbody)
        elif isinstance(node, ast.With):
            yield from (item.context_expr for item in node.items)
            yield from _top_level(node.body)
        else:
            yield node


def _bound(node: ast.AST) -> set[str]:
    """Names a top-level statement binds (attribute and subscript targets bind none: an effect)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"}
    targets: list[ast.AST] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    names = set()
    for t in targets:
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                names.add(n.id)
            elif isinstance(n, (ast.Attribute, ast.Subscript)):
                return set()  # `mod.x = ...`, `table[k] = ...`: run for its effect
    return names


def _locals(node: ast.AST) -> set[str]:
    """Names a function or class binds inside itself (arguments, assignments, loop and with targets): a use of
    such a name is not a reference to a top-level definition (a local `rows` does not pull in a kernel `rows`)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return set()
    out, declared = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            out.add(n.id)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            declared.update(n.names)
        elif n is not node and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
    return out - declared


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _external_strings(node: ast.AST, external: frozenset[str]) -> set[int]:
    """ids of the string constants passed straight to a library's function (`tl.atomic_add(..., scope="gpu")`): a
    library cannot call back into the package by a name, so they name no definition of it."""
    skip = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and _root_name(n.func) in external:
            skip.update(id(a) for a in (*n.args, *(k.value for k in n.keywords)) if isinstance(a, ast.Constant))
    return skip


def _refs(node: ast.AST, external: frozenset[str] = frozenset()) -> set[str]:
    out, skip = set(), _external_strings(node, external)
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.alias):
            out.update({n.name.split(".")[-1], n.asname or ""})
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier() and id(n) not in skip:
            out.add(n.value)
    return out - _locals(node) - {""}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str | None:
    if not node.level:
        return node.module
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 > len(parts):
        return None
    base = parts[:len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else [])) or None


def imported(node: ast.AST, module: str = "", is_package: bool = False) -> set[str]:
    """Dotted module names the import statements anywhere in `node` may load (`from a import b` may be a.b)."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Import):
            names.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            base = _resolve(module, is_package, n)
            if base:
                names.add(base)
                names.update(f"{base}.{a.name}" for a in n.names if a.name != "*")
    return names


# Fields a newer Python's parser adds to every node of a kind (3.12: PEP 695's type_params); left out when empty, so
# that a record made on another interpreter (a lent GPU's) hashes the same code alike.
_NEWER_FIELDS = ("type_params",)
# 3.13's ast.dump leaves out empty fields unless told otherwise; keep them, as older versions print them
_DUMP_KW = {"show_empty": True} if "show_empty" in ast.dump.__code__.co_varnames else {}


def _empty_text(n: ast.AST) -> bool:
    return isinstance(n, ast.Constant) and n.value == ""


def _dump(node: ast.AST) -> str:
    """ast.dump in one form on every Python version this runs on: the newer fields left out where empty, and the
    empty text parts of f-strings too (3.12 ends a nested format spec, `{k:<{w}}`, with Constant(''))."""
    joined = [(n, n.values) for n in ast.walk(node) if isinstance(n, ast.JoinedStr) and any(map(_empty_text, n.values))]
    try:
        for n, values in joined:
            n.values = [v for v in values if not _empty_text(v)]
        return _dump_fields(node)
    finally:
        for n, values in joined:
            n.values = values


def _dump_fields(node: ast.AST) -> str:
    newer = [(n, f) for n in ast.walk(node) for f in _NEWER_FIELDS if f in n._fields and getattr(n, f, None) == []]
    if not newer:
        return ast.dump(node, include_attributes=False, **_DUMP_KW)
    saved = [(n, n.__class__) for n, _ in newer]
    try:
        for n, f in newer:  # a subclass without the field, for this dump only
            n.__class__ = type(n.__class__.__name__, (n.__class__,), {"_fields": tuple(x for x in n._fields if x != f)})
        return ast.dump(node, include_attributes=False, **_DUMP_KW)
    finally:
        for n, cls in saved:
            n.__class__ = cls


def _digest(node: ast.AST) -> str:
    return hashlib.sha256(_dump(node).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=2048)  # keyed by content: status resolves every runbook on every profile
def parse_module(name: str, path: str, text: str, is_package: bool) -> Module:
    tree = _strip_docstrings(ast.parse(text))
    units, star = [], set()
    package = name.split(".")[0]
    external = frozenset(n for node in _top_level(tree.body) if isinstance(node, (ast.Import, ast.ImportFrom))
                         and not any(m.split(".")[0] == package for m in imported(node, name, is_package))
                         for n in _bound(node))
    for node in _top_level(tree.body):
        bound = _bound(node)
        # a statement binding several names (`from x import a, b`) reads as one item in status's comma list
        label = next(iter(sorted(bound))) if len(bound) == 1 else (
            f"({', '.join(sorted(bound))})" if bound else f"line {getattr(node, 'lineno', '?')}")
        units.append(Unit(name, frozenset(bound), label, _digest(node), frozenset(_refs(node, external)),
                          frozenset(imported(node, name, is_package))))
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            star.add(_resolve(name, is_package, node) or "")
    return Module(name, path, tuple(units), frozenset(star))


def module_name(rel: str) -> tuple[str, bool]:
    """`engine/train/loop.py` -> (`engine.train.loop`, False); `engine/__init__.py` -> (`engine`, True)."""
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def modules(files: dict[str, str]) -> dict[str, Module]:
    """{relative posix path: source} -> {dotted name: Module}."""
    out = {}
    for rel, text in files.items():
        name, pkg = module_name(rel)
        out[name] = parse_module(name, rel, text, pkg)
    return out


def _with_parents(name: str) -> Iterator[str]:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])  # importing a.b.c runs a/__init__ and a/b/__init__ too


RUNBOOK = "__runbook__"  # the runbook's source, as a module whose every statement runs


def reachable(mods: dict[str, Module], source: str | None, roots: Iterable[str] = ()) -> list[Unit] | None:
    """The package's units a runbook's source reaches, with `roots` (its parameters' strings) referenced too (see
    the module doc); None when the source does not parse."""
    try:
        runbook = parse_module(RUNBOOK, "", source or "", False)
    except SyntaxError:
        return None
    mods = {**mods, RUNBOOK: runbook}
    refs, active, included = set(roots), set(), []
    todo = [RUNBOOK]
    pending = {name: list(m.units) for name, m in mods.items()}
    progressed = True
    while progressed:
        progressed = False
        while todo:
            name = todo.pop()
            if name in active:
                continue
            active.add(name)
            progressed = True
            for s in mods[name].star:
                refs.update(n for u in mods.get(s, Module(s, "", (), frozenset())).units for n in u.names)
                todo.extend(m for m in _with_parents(s) if m in mods)
        for name in sorted(active):
            keep = []
            for u in pending[name]:
                if u.names and not u.names & refs and name != RUNBOOK:
                    keep.append(u)
                    continue
                included.append(u)
                refs |= u.refs
                todo.extend(m for i in u.imports for m in _with_parents(i) if m in mods)
                progressed = True
            pending[name] = keep
    return [u for u in included if u.module != RUNBOOK]


def strings(value: object) -> Iterator[str]:
    """The string values (and dict keys) in a runbook's parameters: a parameter may select code by name."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings(k)
            yield from strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from strings(v)


def digest(units: Iterable[Unit], mods: dict[str, Module]) -> str:
    h = hashlib.sha256()
    for path, digest_ in sorted((mods[u.module].path, u.digest) for u in units):
        h.update(f"{path}\0{digest_}\0".encode())
    return h.hexdigest()[:16]


def by_label(units: Iterable[Unit], mods: dict[str, Module]) -> dict[tuple[str, str], frozenset[str]]:
    """(path, label) -> the digests of the units of that label (a name bound twice keeps both)."""
    out: dict[tuple[str, str], set[str]] = {}
    for u in units:
        out.setdefault((mods[u.module].path, u.label), set()).add(u.digest)
    return {k: frozenset(v) for k, v in out.items()}


def changes(before: dict[tuple[str, str], frozenset[str]], after: dict[tuple[str, str], frozenset[str]]
            ) -> dict[str, list[str]]:
    """{path: [labels added, removed or changed]} between two `by_label` maps."""
    out: dict[str, list[str]] = {}
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            out.setdefault(key[0], []).append(key[1])
    return out


def read_package(root: Path, package: str) -> dict[str, str]:
    """{relative posix path: source} of every .py file of the package (and a top-level `package.py`)."""
    paths = [*(root / package).rglob("*.py"), root / f"{package}.py"]
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in paths if p.is_file()}
