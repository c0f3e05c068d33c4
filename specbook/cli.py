"""The `runbook` command: list, run, verify, status, show, env, context."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from specbook import SpecbookError, provenance, records
from specbook.execute import Target, target
from specbook.execute import run as run_target
from specbook.runbooks import check_name, check_profile, discover, find_root, load, parse_cli
from specbook.verify import DRIFTED, FAILED, INVALID, STALE, Verdict, age, drift, exit_code, status, verify

EXIT_CODES = """\b
Exit codes:
  0  ok (numbers fresh, or stale but within tolerance, or not verifiable here)
  1  drifted: a re-run number is outside its tolerance (regression, improvement or change),
     or docs disagree with the records (verify --docs); `status`: something is stale
  2  bad input: unknown runbook or parameter, malformed header or record, wrong profile;
     `list`, `status`, `context`: a malformed record file (named on stderr; the others are still shown)
  3  could not run: a runbook failed, timed out, or cannot run on this machine's profile
  130  interrupted (Ctrl-C)"""


@dataclass
class Ctx:
    root_opt: str | None
    debug: bool

    @property
    def root(self) -> Path:
        return find_root(self.root_opt)


class Group(click.Group):
    """Bad input and failed runs are one line on stderr and an exit code; --debug shows the traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SpecbookError as e:
            self._fail(ctx, str(e), e.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT, no traceback from the kernel
            if (ctx.obj and ctx.obj.debug) or os.environ.get("SPECBOOK_DEBUG"):
                raise
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except Exception as e:  # a bug or an environment problem: still one line unless --debug
            self._fail(ctx, f"{type(e).__name__}: {e} (rerun with --debug for the traceback)", 3)

    @staticmethod
    def _fail(ctx: click.Context, message: str, code: int) -> None:
        if (ctx.obj and ctx.obj.debug) or os.environ.get("SPECBOOK_DEBUG"):
            raise
        click.echo(f"error: {message}", err=True)
        ctx.exit(code)


@click.group(cls=Group, epilog=EXIT_CODES, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--root", type=click.Path(file_okay=False), help="Repository root (default: $SPECBOOK_ROOT or the "
              "nearest parent directory with runbooks/).")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.pass_context
def main(ctx: click.Context, root: str | None, debug: bool) -> None:
    """Runbooks, recorded baselines and their verification."""
    ctx.obj = Ctx(root, debug)


def _log(msg: str) -> None:
    click.echo(msg, err=True)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def _emit(as_json: bool, payload: Any, text: str) -> None:
    click.echo(json.dumps(payload, indent=2, default=str) if as_json else text)


def _verdict_text(v: Verdict) -> str:
    return f"{v.verdict} ({v.change})" if v.change else v.verdict


def _verdict_rows(vs: list[Verdict]) -> list[list[Any]]:
    return [[v.runbook, v.profile, v.metric, _verdict_text(v), _num(v.recorded), _num(v.measured), v.unit, v.age,
             v.detail] for v in vs]


VERDICT_HEADERS = ["runbook", "profile", "metric", "verdict", "recorded", "measured", "unit", "age", "detail"]


@main.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def list_(obj: Ctx, as_json: bool) -> None:
    """Runbooks with their profiles and the state of their records."""
    root = obj.root
    states: dict[str, dict[str, str]] = {}
    verdicts = status(root)
    for v in verdicts:
        worst = states.setdefault(v.runbook, {}).get(v.profile)
        if worst is None or _rank(v.verdict) > _rank(worst):
            states[v.runbook][v.profile] = v.verdict
    items = []
    for name in discover(root):
        try:
            rb = load(root, name)
        except SpecbookError as e:  # one broken runbook must not hide the others
            items.append({"name": name, "title": f"invalid: {e}", "profiles": [], "depends": [], "records": {}})
            continue
        items.append({"name": name, "title": rb.title, "profiles": list(rb.profiles), "depends": rb.depends,
                      "records": states.get(name, {})})
    rows = [[i["name"], ",".join(i["profiles"]), ",".join(i["depends"]) or "-",
             ", ".join(s if p == "-" else f"{p}: {s}" for p, s in i["records"].items()) or "-", i["title"]]
            for i in items]
    _emit(as_json, items, _table(["runbook", "profiles", "depends", "records", "title"], rows))
    _exit_if_invalid([v.detail for v in verdicts if v.verdict == INVALID])


def _exit_if_invalid(problems: list[str]) -> None:
    """Malformed record files, one line each on stderr and exit 2, after the rest was shown."""
    for p in problems:
        click.echo(f"error: {p}", err=True)
    if problems:
        click.get_current_context().exit(2)


def _rank(verdict: str) -> int:
    return {FAILED: 3, DRIFTED: 2, STALE: 1}.get(verdict, 0)


@main.command()
@click.argument("name")
@click.option("-p", "--param", "params", multiple=True, metavar="KEY=VALUE",
              help="Override a parameter declared in the runbook's parameters cell (repeatable).")
@click.option("--profile", help="This machine's hardware profile (default: detected) or a variant of it declared in "
              "the runbook, e.g. cpu.dsv3.")
@click.option("--force", is_flag=True, help="Re-run dependencies even when their cached outputs are current.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (no progress bar).")
@click.pass_obj
def run(obj: Ctx, name: str, params: tuple[str, ...], profile: str | None, force: bool, as_json: bool) -> None:
    """Run runbook NAME (dependencies first when missing or stale) and record its numbers."""
    root = obj.root
    rb = load(root, name)
    overrides = parse_cli(rb, params)
    here = provenance.detect_profile()
    if profile:
        check_profile(root, profile)
    profile = profile or here
    if not provenance.runs_here(profile, here):
        raise SpecbookError(f"cannot measure profile {profile} on this machine (it is {here}); "
                            f"`runbook verify --profile {profile}` reports its records")
    t = target(root, name, profile, overrides)
    before = {n: records.load(records.path_for(root, n)) for n in _closure(t)}
    outcomes = run_target(root, t, record=True, force=force, progress=not as_json, log=_log)
    for o in outcomes:
        if o.run_id:
            _log(f"recorded run {o.run_id} in {records.path_for(root, o.target.rb.name).relative_to(root)}")
        _log(f"executed notebook: {o.notebook.relative_to(root)}")
    _refresh_docs(root, [o.target.rb.name for o in outcomes if o.run_id])
    rows = []
    for o in outcomes:
        prev = before[o.target.rb.name].data["profiles"].get(profile, {}).get("metrics", {})
        for m in o.execution.metrics:
            old = prev.get(m.name)
            change = _change(old, m.value)
            rows.append({"runbook": o.target.rb.name, "profile": profile, "metric": m.name, "fresh": m.value,
                         "recorded": old["value"] if old else None, "unit": m.unit, "change": change,
                         "run": o.run_id, "seconds": round(o.execution.seconds, 2)})
    text = _table(["runbook", "metric", "fresh", "recorded before", "unit", "vs recorded"],
                  [[r["runbook"], r["metric"], _num(r["fresh"]), _num(r["recorded"]), r["unit"], r["change"]]
                   for r in rows]) if rows else f"{name}: ran, recorded no numbers"
    _emit(as_json, rows, text)


def _closure(t: Target) -> set[str]:
    return {t.rb.name}.union(*(_closure(d) for d in t.upstream.values()))


def _change(old: dict | None, value: float) -> str:
    if old is None:
        return "new"
    return drift(old, value) or "within tolerance"


def _refresh_docs(root: Path, ran: list[str]) -> None:
    try:
        from specbook.claims import refresh_docs
    except ImportError:  # the docs layer is optional for running
        return
    if ran:
        for path in refresh_docs(root, ran):
            _log(f"updated {Path(path).relative_to(root) if Path(path).is_absolute() else path}")


@main.command("verify")
@click.argument("names", nargs=-1)
@click.option("--profile", help="Only this profile's records; one other than this machine's is reported as "
              "not verifiable here.")
@click.option("--docs", is_flag=True, help="Also check that numbers in docs/ match the records.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (no progress bar).")
@click.pass_obj
@click.pass_context
def verify_(ctx: click.Context, obj: Ctx, names: tuple[str, ...], profile: str | None, docs: bool,
            as_json: bool) -> None:
    """Re-run what can run here and compare with the records, within tolerance."""
    root = obj.root
    here = provenance.detect_profile()
    if profile:
        check_profile(root, profile)
    verdicts = verify(root, here, list(names) or None, profile, progress=not as_json, log=_log)
    code = exit_code(verdicts)
    problems = [str(p) for p in _check_docs(root)] if docs else []
    if problems and code == 0:
        code = 1
    text = _table(VERDICT_HEADERS, _verdict_rows(verdicts)) if verdicts else "nothing recorded to verify"
    text += "".join(f"\ndocs: {p}" for p in problems)
    _emit(as_json, {"profile": here, "verdicts": [v.as_dict() for v in verdicts], "docs": problems,
                    "exit_code": code}, text)
    ctx.exit(code)


def _check_docs(root: Path) -> list:
    try:
        from specbook.claims import check_docs
    except ImportError:
        raise SpecbookError("--docs needs specbook.claims, which is not installed") from None
    return check_docs(root)


@main.command("status")
@click.argument("names", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
@click.pass_context
def status_(ctx: click.Context, obj: Ctx, names: tuple[str, ...], as_json: bool) -> None:
    """Which records are stale against the current code and parameters; runs nothing."""
    verdicts = status(obj.root, list(names) or None)
    code = 3 if any(v.verdict == FAILED for v in verdicts) else 1 if any(v.verdict == STALE for v in verdicts) else 0
    _emit(as_json, [v.as_dict() for v in verdicts],
          _table(VERDICT_HEADERS, _verdict_rows(verdicts)) if verdicts else "no runbooks or records")
    _exit_if_invalid([v.detail for v in verdicts if v.verdict == INVALID])
    ctx.exit(code)


@main.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="The record file as JSON.")
@click.pass_obj
def show(obj: Ctx, name: str, as_json: bool) -> None:
    """The records of runbook NAME and their provenance."""
    root = obj.root
    check_name(name)
    path = records.path_for(root, name)
    if not path.exists():
        load(root, name)  # unknown names fail with suggestions
    rf = records.load(path)
    if as_json:
        _emit(True, rf.data, "")
        return
    rows, runs = [], []
    for pname, prof in rf.data["profiles"].items():
        for mname, m in prof["metrics"].items():
            tol = m.get("tolerance", {})
            r = records.run_of(prof, m["run"])
            rows.append([pname, mname, _num(m["value"]), m["unit"], m["direction"],
                         f"rel {tol.get('rel', 0):g} abs {tol.get('abs', 0):g}", len(m.get("history", [])),
                         r["source"], age(r["date"]), m["run"]])
        runs += [_run_line(pname, r) for r in prof["runs"]]
    text = f"{name}: {path.relative_to(root)}\n" + (_table(
        ["profile", "metric", "value", "unit", "direction", "tolerance", "history", "source", "age", "run"], rows)
        if rows else "no records") + "".join(f"\n{line}" for line in runs)
    click.echo(text)


def _run_line(profile: str, r: dict) -> str:
    p = r.get("provenance", {})
    if r["source"] == "reported":
        return f"run {r['id']} ({profile}): reported, {p.get('reported_by', 'no source given')}"
    v, gpu, site = p.get("versions", {}), p.get("gpu", {}), p.get("sitecustomize", {})
    active = [k for k, s in site.items() if isinstance(s, dict) and s.get("active")]
    return (f"run {r['id']} ({profile}): commit {str(p.get('git_commit'))[:10]}{' dirty' if p.get('git_dirty') else ''}"
            f", engine {p.get('engine_hash')}, torch {v.get('torch')}, cuda {v.get('cuda')}, "
            f"gpu {','.join(gpu.get('names', [])) or 'none'} x{gpu.get('count', 0)}"
            f"{', ' + '+'.join(active) + ' active' if active else ''}, params {r.get('parameters')}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def env(obj: Ctx, as_json: bool) -> None:
    """The fingerprint of this machine: hardware profile, versions, GPU, performance-relevant environment."""
    fp = provenance.fingerprint(obj.root)
    fp = {k: v for k, v in fp.items() if k not in ("runbook_hash", "params_hash")}
    lines = [f"{k}: {json.dumps(v, default=str)}" for k, v in fp.items()]
    _emit(as_json, fp, "\n".join(lines))


@main.command()
@click.option("--budget", type=click.IntRange(min=1), default=2000, show_default=True, metavar="TOKENS",
              help="Most tokens the pack may take (estimated at 4 characters a token).")
@click.pass_obj
def context(obj: Ctx, budget: int) -> None:
    """A compact context pack for agents: numbers with verdicts, open decisions, next steps."""
    from specbook.context import build_context

    click.echo(build_context(obj.root, budget), nl=False)
    _exit_if_invalid(records.broken(obj.root))


if __name__ == "__main__":
    sys.exit(main())
