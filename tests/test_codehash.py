"""Fingerprints by meaning (specbook/codehash.py): a record goes stale when the code it ran computes something
different - not on a docstring or comment, not when a kernel no run chooses lands - and `status` says where."""
from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

from specbook import provenance, verify
from specbook.execute import target
from specbook.runbooks import discover, load
from specbook_testing import make_repo, runbook_text

ROOT = Path(__file__).resolve().parents[1]

KERNELS = '''\
"""Kernels."""
import math

BLOCK = 4  # rows a program


def fast(x):
    """The default."""
    rows = x * BLOCK  # a local named like no top-level definition
    return rows


def helper_of_new(x):
    return math.sqrt(x)


if True:
    def guarded(x):
        return -x
'''


def package(root: Path, text: str = KERNELS, model: str = "from mylib.kernels import fast\n\ndef run(x, name='fast'):\n"
            "    return fast(x)\n") -> None:
    (root / "mylib").mkdir(exist_ok=True)
    (root / "mylib" / "__init__.py").write_text("")
    (root / "mylib" / "kernels.py").write_text(text)
    (root / "mylib" / "model.py").write_text(model)
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n\n[tool.specbook]\nengine_package = 'mylib'\n")


SOURCE = "from mylib.model import run\nprint(run(2))\n"


def h(root: Path, params: dict | None = None) -> str:
    return provenance.engine_hash(root, SOURCE, params)


def test_docstrings_comments_and_blank_lines_change_nothing(tmp_path):
    package(tmp_path)
    before = h(tmp_path)
    edited = KERNELS.replace('"""The default."""', '"""The default, reworded."""').replace("# rows a program", "")
    package(tmp_path, '"""Another module docstring."""\n\n' + edited.split('"""Kernels."""', 1)[1] + "\n\n# tail\n")
    assert h(tmp_path) == before


def test_a_changed_constant_or_body_of_reached_code_changes_it(tmp_path):
    package(tmp_path)
    before = h(tmp_path)
    package(tmp_path, KERNELS.replace("BLOCK = 4", "BLOCK = 8"))
    assert h(tmp_path) != before
    package(tmp_path, KERNELS.replace("return rows", "return rows + 1"))
    assert h(tmp_path) != before


def test_a_new_kernel_no_run_names_is_outside_the_fingerprint_until_a_parameter_names_it(tmp_path):
    package(tmp_path)
    before, before_named = h(tmp_path), h(tmp_path, {"kernels": {"verify": "rows"}})
    new = KERNELS + "\n\nROWS_BLOCK = 64\n\n\ndef rows(x):\n    return helper_of_new(x) * ROWS_BLOCK\n"
    package(tmp_path, new)
    assert h(tmp_path) == before  # landed off by default: no record goes stale
    assert h(tmp_path, {"kernels": {"verify": "rows"}}) != before_named  # a run that chooses it covers it
    package(tmp_path, new.replace("ROWS_BLOCK = 64", "ROWS_BLOCK = 32"))  # ... and its constants, followed by name
    assert h(tmp_path) == before and h(tmp_path, {"kernels": {"verify": "rows"}}) != before_named
    # a local variable named like the new kernel (`rows` in fast) does not pull it in: covered by the equality above


def test_code_in_module_level_blocks_and_relative_imports_are_followed(tmp_path):
    package(tmp_path, model="from .kernels import guarded\n\ndef run(x):\n    return guarded(x)\n")
    before = h(tmp_path)
    package(tmp_path, KERNELS.replace("return -x", "return -2 * x"),
            model="from .kernels import guarded\n\ndef run(x):\n    return guarded(x)\n")
    assert h(tmp_path) != before


def test_a_file_no_import_reaches_is_outside(tmp_path):
    package(tmp_path)
    before = h(tmp_path)
    (tmp_path / "mylib" / "server.py").write_text("PORT = 1\n")
    assert h(tmp_path) == before


# ------------------------------------------------------------------------------------------------ the real engine


def _engine_copy(tmp: Path) -> Path:
    root = tmp / "repo"
    shutil.copytree(ROOT / "engine", root / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "runbooks", root / "runbooks")
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def _hashes(root: Path) -> dict[str, str]:
    out = {}
    for name in sorted(discover(ROOT)):
        rb = load(ROOT, name)
        for profile in rb.profiles:
            out[f"{name}/{profile}"] = provenance.engine_hash(root, rb.source, rb.params_for(profile))
    return out


def _importers(module: str) -> set[str]:
    """Runbook/profile keys whose runbook imports `module` (transitively): the plain import graph, read here
    independently of codehash."""
    def imports(path: Path) -> set[str]:
        names = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Import):
                names.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                names.update({n.module, *(f"{n.module}.{a.name}" for a in n.names)})
        return {m for m in names if m.split(".")[0] == "engine"}

    def closure(path: Path) -> set[str]:
        seen, todo = set(), list(imports(path))
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            for f in (ROOT / Path(*m.split("."))).with_suffix(".py"), ROOT / Path(*m.split(".")) / "__init__.py":
                if f.is_file():
                    todo.extend(imports(f))
        return seen

    out = set()
    for name in discover(ROOT):
        rb = load(ROOT, name)
        if module in closure(rb.path):
            out.update(f"{name}/{p}" for p in rb.profiles)
    return out


def test_on_the_engine_a_docstring_edit_stales_nothing_and_a_kernel_constant_exactly_its_importers(tmp_path):
    root = _engine_copy(tmp_path)
    before = _hashes(root)
    model = root / "engine" / "model.py"
    text = model.read_text()
    model.write_text(text.replace('"""', '"""Reworded: ', 1) + "\n# a comment at the end\n")
    assert _hashes(root) == before
    model.write_text(text)
    gemv = root / "engine" / "gemv.py"
    source = gemv.read_text()
    assert "\nBLOCK_N = 4" in source, "the planted change needs gemv.BLOCK_N"
    gemv.write_text(source.replace("\nBLOCK_N = 4", "\nBLOCK_N = 8"))
    after = _hashes(root)
    changed = {k for k in before if after[k] != before[k]}
    assert changed and changed == _importers("engine.gemv")
    assert set(before) - changed, "some runbook does not run the one-row kernel"


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def test_status_names_the_file_and_definition_that_changed(tmp_path):
    root = make_repo(tmp_path / "repo", up=runbook_text(
        body='from mylib.model import run\nrecord("x", float(run(2)), unit="u", direction="higher", rel_tol=0.1)'))
    package(root)
    _git(root, "init", "-q")
    _git(root, "-c", "user.email=a@b", "-c", "user.name=a", "add", "-A")
    _git(root, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "one")
    t = target(root, "up", "cpu")
    run = {"provenance": {"runbook_hash": provenance.sha(t.rb.hashed_source),
                          "params_hash": provenance.sha(provenance.canonical(t.params)),
                          "engine_hash": t.engine, "git_commit": _git(root, "rev-parse", "HEAD")}}
    package(root, KERNELS.replace("BLOCK = 4", "BLOCK = 8").replace('"""The default."""', '"""Reworded."""'))
    t2 = target(root, "up", "cpu")
    assert t2.engine != t.engine
    assert verify.why_stale(root, t2, run) == "engine (mylib/kernels.py: BLOCK) changed"
    # an import that grows by a name: its old and its new statement, each one item of the list
    uses_floor = KERNELS.replace("import math", "from math import floor").replace("x * BLOCK", "floor(x) * BLOCK")
    package(root, uses_floor)
    _git(root, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qam", "two")
    run["provenance"]["git_commit"] = _git(root, "rev-parse", "HEAD")
    package(root, uses_floor.replace("import floor", "import ceil, floor"))
    assert verify.why_stale(root, target(root, "up", "cpu"), run) == \
        "engine (mylib/kernels.py: (ceil, floor), floor) changed"
    run["provenance"]["git_commit"] = "0" * 40  # not in this clone: where cannot be said, that it changed can
    assert verify.why_stale(root, t2, run) == "engine changed"


def test_on_the_engine_the_gpu_preset_is_outside_every_cpu_record(tmp_path):
    """Presets are looked up by name: changing the gpu one stales the runbooks run with it, and no cpu one."""
    root = _engine_copy(tmp_path)
    before = _hashes(root)
    presets = root / "engine" / "train" / "presets.py"
    text = presets.read_text()
    assert 'name="gpu"' in text
    presets.write_text(text.replace("tokenizer_bytes=10_000_000", "tokenizer_bytes=9_000_000"))
    after = _hashes(root)
    changed = {k for k in before if after[k] != before[k]}
    assert changed and all(k.split("/")[1].split(".")[0] in ("h200", "h100") for k in changed), changed
    assert {f"{rb}/h200" for rb in ("train-target", "train-drafter", "finetune-drafter", "scale-data")} <= changed


def test_a_newer_pythons_empty_fields_hash_as_an_older_ones():
    """Python 3.12 gives every def an empty `type_params`; a record made there (a lent GPU) must hash the same code as
    one made on 3.11 does. Planted here: the def's class given that field, empty."""
    import ast

    from specbook.codehash import _digest

    plain = ast.parse("def f(x):\n    return x + 1\n").body[0]
    newer = ast.parse("def f(x):\n    return x + 1\n").body[0]
    if "type_params" not in newer._fields:
        fields = ast.FunctionDef._fields + ("type_params",)
        newer.__class__ = type("FunctionDef", (ast.FunctionDef,), {"_fields": fields})
    newer.type_params = []
    assert "type_params=[]" in ast.dump(newer)  # the plant took
    assert _digest(newer) == _digest(plain)
    changed = ast.parse("def f(x):\n    return x + 2\n").body[0]
    assert _digest(changed) != _digest(plain)


def test_a_nested_format_spec_hashes_alike_with_and_without_312s_empty_text():
    """Python 3.12 ends a nested f-string format spec (`{k:<{w}}`) with Constant(''), which 3.11 leaves out: planted
    here on a 3.11 tree, the digest stays; a real change of the spec still changes it."""
    import ast

    from specbook.codehash import _digest

    src = 'def f(k, w):\n    return f"{k:<{w}}!"\n'
    plain, newer = ast.parse(src).body[0], ast.parse(src).body[0]
    spec = next(n for n in ast.walk(newer) if isinstance(n, ast.FormattedValue) and n.format_spec).format_spec
    if not (isinstance(spec.values[-1], ast.Constant) and spec.values[-1].value == ""):
        spec.values.append(ast.Constant(value=""))
    assert "Constant(value='')" in ast.dump(newer)  # the plant took
    assert _digest(newer) == _digest(plain)
    assert "Constant(value='')" in ast.dump(newer)  # the tree itself is left as it was
    assert _digest(ast.parse(src.replace("<", ">")).body[0]) != _digest(plain)
