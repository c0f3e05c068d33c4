"""The `runbook` command: list, run, verify, status, show, env, context."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from specbook import RunFailed, SpecbookError, Terminated, execute, parallel, provenance, records
from specbook.execute import Target, target
from specbook.execute import run as run_target
from specbook.runbooks import check_name, check_profile, discover, find_root, load, parse_cli
from specbook.text import one_line
from specbook.verify import (FAILED, FAILING, INVALID, MOVED, STALE, STATES, Verdict, age, drift, exit_code, plan,
                             recorded_here, recorded_seconds, status, verify)

# Exit codes: the same meanings as `python -m engine`'s (engine/cli_options.py); tests/test_cli_conventions.py holds
# them together
EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 3, 130, 143
EXIT_CODES = """\b
States of a recorded number (the same words everywhere):
  fresh     re-measured here within tolerance
  drifted   re-measured here outside tolerance (a noisy number: by two of three runs
            paired with the recorded commit's engine)
  moved     outside tolerance with the code as recorded: a timing, or an exact number on
            another kind of processor or GPU (there also one it did not record); the
            machine or its environment moved it (shown, exit 0)
  flaky     a noisy number whose three measurements do not agree
  failed    could not be re-measured (the runbook failed)
  current   not re-measured; its inputs are unchanged since it was recorded
  stale     not re-measured; its inputs changed since it was recorded
  reported  measured by hand elsewhere, never re-run
\b
Exit codes (the same meanings as python -m engine's):
  0    ok: nothing drifted, flaky or failed (`status`: nothing stale)
  1    a check failed: drifted or flaky numbers, docs that disagree with the records
       (verify --docs), `status`: something is stale, `site --check`: a generated file is out of date
  2    bad input or usage: unknown runbook, profile, option or parameter, malformed header or
       record; one line on stderr (`list`, `status`, `context`: a malformed record file, named
       on stderr; the others are still shown)
  3    internal failure, could not run: a runbook failed or timed out, or the profile asked for
       is another machine's hardware (`run --profile h200` on a CPU; a misspelt profile is 2);
       one line on stderr (--debug shows the traceback)
  130  interrupted (Ctrl-C; SIGTERM: 143, "terminated"): a run's kernel and its
       directory are removed on the way out"""

DEBUG = "specbook.debug"  # key in click's context meta, shared by the group and its subcommands


@dataclass
class Ctx:
    root_opt: str | None

    @property
    def root(self) -> Path:
        return find_root(self.root_opt)


def _note_debug(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.meta[DEBUG] = True
    return value


def debug_option() -> click.Option:
    """--debug, accepted before and after the command name: it only marks the shared context."""
    return click.Option(["--debug"], is_flag=True, expose_value=False, callback=_note_debug,
                        help="Show tracebacks (before or after the command name).")


def _debug(ctx: click.Context) -> bool:
    return bool(ctx.meta.get(DEBUG) or os.environ.get("SPECBOOK_DEBUG"))


NO_ARGS = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2: a group called without a command


class Group(click.Group):
    """Bad input and failed runs are one line on stderr and an exit code; --debug shows the traceback."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        _terminate_as_interrupt()
        try:
            rc = super().main(args, prog_name or "runbook", complete_var, standalone_mode=False, **extra)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.Abort as e:
            terminated = isinstance(e.__context__, Terminated)
            click.echo("terminated" if terminated else "interrupted", err=True)
            sys.exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)
        except click.ClickException as e:  # usage: one line, exit 2 (not click's three-line block)
            if isinstance(e, NO_ARGS):  # no command given: the help, on stderr as click shows it
                e.show()
            else:
                click.echo(f"error: {e.format_message()} (see --help)", err=True)
            sys.exit(EXIT_BAD_INPUT)
        sys.exit(rc if isinstance(rc, int) else EXIT_OK)  # --help, or a command's ctx.exit(code)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SpecbookError as e:
            self._fail(ctx, str(e), e.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: one line, the shell's code, no traceback from the kernel
            if _debug(ctx):
                raise
            terminated = isinstance(e, Terminated)
            click.echo("terminated" if terminated else "interrupted", err=True)
            ctx.exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)
        except Exception as e:  # a bug or an environment problem: still one line unless --debug
            first = (str(e).strip().splitlines() or [""])[0]
            self._fail(ctx, f"{type(e).__name__}: {first} (rerun with --debug for the traceback)", EXIT_INTERNAL)

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        if not any(p.name == "debug" for p in cmd.params):
            cmd.params.append(debug_option())
        super().add_command(cmd, name)

    @staticmethod
    def _fail(ctx: click.Context, message: str, code: int) -> None:
        if _debug(ctx):
            raise
        click.echo(f"error: {message}", err=True)
        ctx.exit(code)


def _terminate_as_interrupt() -> None:
    """SIGTERM (`kill`, a supervisor's timeout) unwinds like Ctrl-C: a run stops its kernel's process group and
    removes its directory on the way out, where the default action would end this process and leave both."""
    def raise_terminated(signum, frame) -> None:
        raise Terminated()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_terminated)


@click.group(cls=Group, epilog=EXIT_CODES, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--root", type=click.Path(file_okay=False), help="Repository root (default: $SPECBOOK_ROOT or the "
              "nearest parent directory with runbooks/).")
@click.option("--debug", is_flag=True, expose_value=False, callback=_note_debug,
              help="Show tracebacks (before or after the command name).")
@click.pass_context
def main(ctx: click.Context, root: str | None) -> None:
    """Runbooks, recorded baselines and their verification."""
    parallel.adopt_timing_lock()  # a child of verify or record: the timing lock is for its runbooks' kernels
    ctx.obj = Ctx(root)


def _log(msg: str) -> None:
    click.echo(msg, err=True)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[one_line(c) for c in r] for r in [headers, *rows]]  # a record's text stays in its cell
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def _emit(as_json: bool, payload: Any, text: str) -> None:
    click.echo(json.dumps(payload, indent=2, default=str) if as_json else text)


def _verdict_rows(vs: list[Verdict]) -> list[list[Any]]:
    return [[v.runbook, v.profile, v.metric, v.label, _num(v.recorded), _num(v.measured), v.unit,
             age(v.date) if v.date else "-", v.inputs or "-", v.detail] for v in vs]


VERDICT_HEADERS = ["runbook", "profile", "metric", "state", "recorded", "measured", "unit", "age", "inputs", "detail"]


def summary(verdicts: list[Verdict]) -> str:
    """One line of counts: the numbers this machine can re-measure, and those of other hardware or reported."""
    def counts(vs: list[Verdict]) -> str:
        return ", ".join(f"{n} {s}" for s in STATES if (n := sum(v.state == s for v in vs))) or "none"

    return (f"this machine's profiles: {counts([v for v in verdicts if v.here])}; other hardware or reported: "
            f"{counts([v for v in verdicts if not v.here])}")


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
        if worst is None or _rank(v.state) > _rank(worst):
            states[v.runbook][v.profile] = v.state
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
    _exit_if_invalid([v.detail for v in verdicts if v.state == INVALID])


def _exit_if_invalid(problems: list[str]) -> None:
    """Malformed record files, one line each on stderr and exit 2, after the rest was shown."""
    for p in problems:
        click.echo(f"error: {p}", err=True)
    if problems:
        click.get_current_context().exit(2)


def _failing_groups(verdicts: list[Verdict], total: int) -> str:
    """One line per runbook and profile with numbers in a failing state (stale: which inputs changed), then how to
    see every number."""
    groups: dict[tuple[str, str], list[Verdict]] = {}
    for v in verdicts:
        if v.state in FAILING:
            groups.setdefault((v.runbook, v.profile), []).append(v)
    lines = []
    for (runbook, profile), vs in groups.items():
        states = ", ".join(f"{n} {s}" for s in STATES if (n := sum(v.state == s for v in vs)))
        why = "; ".join(sorted({v.inputs if v.state == STALE else v.detail for v in vs} - {""}))
        lines.append(f"  {runbook} ({profile}): {states}" + (f" - {why}" if why else ""))
    head = ["not current:", *lines] if lines else ["every record is current or reported"]
    return "\n".join([*head, f"`runbook status --all` lists all {total} numbers"])


def _rank(state: str) -> int:
    """Which state a group shows when its numbers differ: the most alarming."""
    return len(STATES) - STATES.index(state) if state in FAILING else 0


@main.command()
@click.argument("name")
@click.option("-p", "--param", "params", multiple=True, metavar="KEY=VALUE",
              help="Override a parameter declared in the runbook's parameters cell (repeatable).")
@click.option("--profile", help="This machine's hardware profile (default: detected) or a variant of it declared in "
              "the runbook, e.g. cpu.dsv3.")
@click.option("--record", "record_", is_flag=True, help="Write the numbers into baselines/, the executed notebook "
              "into docs/runbooks/executed/ and the claim literals into docs/ (for a commit). Without it a run "
              "changes no tracked file: it measures and compares with the committed record. On a machine "
              "without GPUs a run that times something is not recorded while other processes take over a tenth "
              "of the cores (SPECBOOK_ALLOW_BUSY=1 records anyway).")
@click.option("--force", is_flag=True, help="Re-run dependencies even when their cached outputs are current.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (no progress bar).")
@click.option("--docs-later", is_flag=True, hidden=True, help="With --record: leave docs/ to the caller (the children "
              "of `runbook record`, whose parent brings docs/ up to date once, after all of them).")
@click.pass_obj
def run(obj: Ctx, name: str, params: tuple[str, ...], profile: str | None, record_: bool, force: bool,
        as_json: bool, docs_later: bool) -> None:
    """Run runbook NAME (dependencies first when missing or stale), show what its numbers say and how they compare
    with the committed record; with --record, record them."""
    root = obj.root
    rb = load(root, name)
    overrides = parse_cli(rb, params)
    here = provenance.detect_profile()
    if profile:
        check_profile(root, profile)
    profile = profile or here
    if not provenance.runs_here(profile, here):  # a known profile, other hardware: could not run here (3)
        raise RunFailed(f"cannot measure profile {profile} on this machine (it is {here}); "
                        f"`runbook verify --profile {profile}` reports its records")
    if record_:
        provenance.git_commit(root)  # a bad SPECBOOK_GIT_COMMIT is refused before anything runs, not after
    started = time.monotonic()
    t = target(root, name, profile, overrides)
    _log("will run: " + ", ".join(_plan(t, force)) + ("" if record_ else
                                                      " (measure only; --record writes baselines/ and docs/)"))
    before = {n: records.load(records.path_for(root, n)) for n in _closure(t)}
    # a record is measured from nothing, as verify re-measures it: nothing read back from a cached run's outputs
    outcomes = run_target(root, t, record=record_, force=force, fresh=record_, progress=not as_json, log=_log)
    if record_ and not docs_later:  # a child of `record` leaves it to its parent: the next runbook waits for it
        from specbook.site import write_generated

        with records.docs_lock(root):
            _refresh_docs(root, [o.target.rb.name for o in outcomes if o.run_id])
            for path in write_generated(root):
                _log(f"updated {path.relative_to(root)}")
        _headlines_down(root, {o.run_id for o in outcomes if o.run_id})
    rows = []
    for o in outcomes:
        prof = before[o.target.rb.name].data["profiles"].get(profile, {})
        for m in o.execution.metrics:
            old = prof.get("metrics", {}).get(m.name)
            rows.append({"runbook": o.target.rb.name, "profile": profile, "metric": m.name, "measured": m.value,
                         "recorded": old["value"] if old else None, "unit": m.unit, "kind": m.kind,
                         "vs_recorded": _change(old, m.value), "run": o.run_id,
                         "notebook": str(o.notebook.relative_to(root)) if o.notebook else None,
                         "seconds": round(o.execution.seconds, 2)})
    if as_json:
        _emit(True, rows, "")
        return
    click.echo(_conclusion(root, outcomes, before[name].data["profiles"].get(profile, {}), record_,
                           time.monotonic() - started))


@main.command("record")
@click.argument("names", nargs=-1)
@click.option("--profile", "profiles", multiple=True, help="A profile to re-record (default: this machine's), e.g. "
              "h200.dsv3; repeat it to schedule several profiles' runbooks together.")
@click.option("--gpus", default="all", show_default=True, metavar="all|N|ID,ID", help="GPUs to spread the runs "
              "over, as verify does: a runbook whose record holds a timing (or that has none yet) has its GPU to "
              "itself (with the timing lock: while it times, and two share one); up to 3 whose numbers are all "
              "exact share one. Without GPUs they run one after another.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (no progress bar).")
@click.pass_obj
@click.pass_context
def record_(ctx: click.Context, obj: Ctx, names: tuple[str, ...], profiles: tuple[str, ...], gpus: str,
            as_json: bool) -> None:
    """Re-record runbooks NAMES on a profile (default: every runbook that declares it), dependencies first, each
    as `runbook run NAME --record` would, then bring docs/ up to date once: what an engine change asks for. Exit 3
    when a runbook failed (the others are still recorded)."""
    from specbook.rerecord import jobs, record_all
    from specbook.site import write_generated

    root = obj.root
    here = provenance.detect_profile()
    for p in profiles:
        check_profile(root, p)
        if not provenance.runs_here(p, here):
            raise RunFailed(f"cannot measure profile {p} on this machine (it is {here})")
    provenance.git_commit(root)  # a bad SPECBOOK_GIT_COMMIT is refused before anything runs
    todo = [j for p in profiles or (here,) for j in jobs(root, p, list(names) or None)]
    _log("will record: " + ", ".join(j.key for j in todo))
    done = record_all(root, todo, _gpu_ids(gpus), log=_log, progress=not as_json)
    with records.docs_lock(root):
        _refresh_docs(root, [r.runbook for r in done if r.run_id])
        for path in write_generated(root):
            _log(f"updated {path.relative_to(root)}")
    _headlines_down(root, {r.run_id for r in done if r.run_id})
    failed = [r for r in done if not r.run_id]
    rows = [[r.runbook, r.profile, r.run_id or f"failed: {r.error}"] for r in done]
    text = _table(["runbook", "profile", "recorded run"], rows) + (
        f"\n{len(failed)} of {len(done)} failed" if failed else "\ncommit baselines/ and docs/ on purpose")
    _emit(as_json, [asdict(r) for r in done], text)
    ctx.exit(3 if failed else 0)


@main.command("import")
@click.argument("archive", type=click.Path(path_type=Path))
@click.option("--profile", "profiles", multiple=True, help="Only this profile's records (repeatable; default: every "
              "profile in the archive).")
@click.option("--dry-run", is_flag=True, help="Write nothing: say what would be imported.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
@click.pass_context
def import_(ctx: click.Context, obj: Ctx, archive: Path, profiles: tuple[str, ...], dry_run: bool,
            as_json: bool) -> None:
    """Bring the records in ARCHIVE (a tar made on another machine, e.g. a lent GPU's results.tgz from
    scripts/gpu-runbooks.sh) into baselines/, profile by profile, with their executed notebooks, then bring docs/
    up to date as `record` does and say which headlines the new runs lowered. A profile is taken only as a
    fast-forward: the archive holds every run this tree holds for it, and more. Exit 1 when a profile diverged
    (this tree has runs the archive lacks: not taken; the others are), 2 for a bad archive or profile."""
    from specbook import importing
    from specbook.site import write_generated

    root = obj.root
    for p in profiles:
        check_profile(root, p)
    got = importing.read_archive(archive)
    sections = importing.plan(root, got, list(profiles) or None)
    if profiles and not sections:
        raise SpecbookError(f"{archive}: no records of {', '.join(profiles)} in it")
    done = [] if dry_run else importing.apply(root, got, sections)
    if done:
        with records.docs_lock(root):
            _refresh_docs(root, sorted({s.runbook for s in done}))
            for path in write_generated(root):
                _log(f"updated {path.relative_to(root)}")
        _headlines_down(root, {run for s in done for run in s.added})
    diverged = [s for s in sections if s.state == importing.DIVERGED]
    rows = [[s.runbook, s.profile, s.state + (" (dry run)" if dry_run and s.state == importing.IMPORTED else ""),
             len(s.added) or "-", (s.commit or "?")[:10], "yes" if s.notebook else "no"]
            for s in sections if s.state != importing.SAME]  # the archive's copies of what is here: counted below
    same = len(sections) - len(rows)
    text = (_table(["runbook", "profile", "state", "runs added", "commit", "notebook"], rows) + "\n" if rows else "") \
        + f"{same} profile record(s) as they are here"
    if diverged:
        text += (f"\n{len(diverged)} diverged: this tree holds runs of them that the archive lacks; not imported "
                 "(record them again, or merge by hand)")
    elif done:
        text += f"\n{len(done)} imported; commit baselines/ and docs/ on purpose"
    else:
        text += "\nnothing new to import" if not dry_run else ""
    _emit(as_json, [asdict(s) for s in sections], text)
    ctx.exit(1 if diverged else 0)


def _plan(t: Target, force: bool, seen: set[str] | None = None) -> list[str]:
    """The runbooks a run will execute, dependencies first: those not cached (all with --force), then NAME."""
    seen = set() if seen is None else seen
    out = []
    for dep in t.upstream.values():
        if dep.rb.name not in seen and (force or not dep.done):
            out += _plan(dep, force, seen)
    seen.add(t.rb.name)
    return out + [f"{t.rb.name} ({t.profile})"]


def _conclusion(root: Path, outcomes: list, prof: dict, recorded: bool, total_s: float) -> str:
    """What the whole run says, for a person: the runbook's conclusion sentence (and plainly when a speedup is
    within its noise), its headline numbers beside the committed record (saying when that record was made on
    another machine), what its dependencies measured on the way, the plots as PNG files, the time it all took, and
    the command that uses what it built."""
    o = outcomes[-1]
    rb, metrics = o.target.rb, {m.name: m for m in o.execution.metrics}
    lines = [f"== {rb.name} on {o.target.profile}: {rb.title}"]
    if rb.conclusion:
        try:
            lines.append(rb.conclusion.format(**{k: m.value for k, m in metrics.items()}))
        except (KeyError, ValueError, IndexError) as e:
            lines.append(f"(the runbook's conclusion could not be filled: {type(e).__name__} {e})")
    if noise := _speedups_in_noise(list(metrics.values()), o.target.profile):
        lines.append(noise)
    head = [metrics[n] for n in rb.reproduces if n in metrics] or list(metrics.values())
    if prof.get("metrics"):  # this kind of machine's own values, where it recorded them
        prof = recorded_here(prof, o.target.inputs_hash, provenance.machine())
    entries = prof.get("metrics", {})
    table = [[m.name, _num(m.value), _num(entries[m.name]["value"]) if m.name in entries else "-", m.unit,
              _change(entries.get(m.name), m.value)] for m in head]
    lines.append(_table(["metric", "measured", "committed record", "unit", "vs record"], table))
    if any(row[-1] in ONE_RUN.values() for row in table):
        lines.append(f"a timing outside its tolerance in one run is not yet a verdict: `runbook verify {rb.name}` "
                     "re-measures it, against the recorded commit's engine when it stays outside")
    if entries:
        run_entry = records.run_of(prof, next(iter(entries.values()))["run"])
        lines.append(_machine_note(run_entry))
    lines += _dependency_lines(o.target, outcomes[:-1])
    lines += _plot_lines(root, outcomes)
    lines.append(_total_line(outcomes, total_s))
    info = outputs_of(root, o.target)
    if info["command"] and info["built"]:
        lines += [f"run what it ran on (`runbook outputs {rb.name}` lists every path):", f"  {info['command']}"]
    lines.append(f"recorded as run {o.run_id}: commit baselines/ and docs/ on purpose" if recorded and o.run_id else
                 f"nothing recorded; `runbook run {rb.name} --record` writes these numbers into baselines/")
    return "\n".join(lines)


def _speedups_in_noise(metrics: list, profile: str) -> str | None:
    """A speedup (a noisy ratio named *speedup*) whose tolerance band around it holds 1.0 is no speedup: say so in
    words rather than leave a figure such as 1.03x to be read as one."""
    flat = []
    for m in metrics:
        band = max(m.rel_tol * abs(m.value), m.abs_tol)
        if m.kind == "noisy" and m.unit == "x" and "speedup" in m.name and abs(m.value - 1.0) <= band:
            flat.append(f"{m.name} {m.value:.2f}x (tolerance \u00b1{band / abs(m.value):.0%})")
    if not flat:
        return None
    where = "a CPU" if provenance.hardware_of(profile) == "cpu" else f"{provenance.hardware_of(profile)}"
    return (f"no real speedup on {where}: {' and '.join(flat)} {'is' if len(flat) == 1 else 'are'} within "
            "the noise of 1.0, the same speed as the baseline")


def _dependency_lines(t: Target, ran: list) -> list[str]:
    """What the runbooks it depends on measured in this run (their headline numbers), or that they were cached."""
    if not t.upstream:
        return []
    lines = ["what it depended on:"]
    by_name = {o.target.rb.name: o for o in ran}
    for dep in _chain(t)[:-1]:
        o = by_name.get(dep.rb.name)
        if o is None:
            lines.append(f"  {dep.rb.name} ({dep.profile}): built by an earlier run, cached (inputs {dep.inputs_hash}; "
                         f"`--force` runs it again)")
            continue
        ms = {m.name: m for m in o.execution.metrics}
        head = [ms[n] for n in dep.rb.reproduces if n in ms] or list(ms.values())
        numbers = ", ".join(f"{m.name} {_num(m.value)}{' ' + m.unit if m.unit else ''}" for m in head)
        lines.append(f"  {dep.rb.name} ({dep.profile}, ran {o.seconds:.0f} s): {numbers or 'no numbers'}")
    return lines


def _chain(t: Target) -> list[Target]:
    """`t` and what it depends on, transitively, dependencies first, each once."""
    out: dict[str, Target] = {}

    def walk(x: Target) -> None:
        for dep in x.upstream.values():
            walk(dep)
        out.setdefault(x.rb.name, x)

    walk(t)
    return list(out.values())


def _plot_lines(root: Path, outcomes: list) -> list[str]:
    """The plots of every runbook that ran, as PNG files in .specbook/executed/ (they open without Jupyter), and
    the executed notebook of the last."""
    lines = []
    for o in outcomes:
        if o.notebook and (pngs := execute.extract_plots(o.notebook, root / execute.LOCAL_EXECUTED)):
            lines.append(f"plots of {o.target.rb.name}: {', '.join(_shown(p) for p in pngs)}")
    if outcomes[-1].notebook:
        lines.append(f"executed notebook (plots and tables): {_shown(outcomes[-1].notebook)}")
    return lines


def _total_line(outcomes: list, total_s: float) -> str:
    """The whole run's wall time and each runbook's share; the last one's split into cells and kernel start. The
    first runbook's share counts from the process's start (execute._lap), before this command's clock began."""
    total_s = max(total_s, sum(o.seconds for o in outcomes))
    parts = ", ".join(f"{o.target.rb.name} {o.seconds:.0f} s" for o in outcomes)
    split = _time_split(outcomes[-1]) if outcomes[-1].notebook else None
    return f"took {total_s:.0f} s in all ({parts})" + (f"; {split}" if split else "")


def _time_split(o) -> str | None:
    """Where a run's wall time went: its cells, the kernel's start, and the rest (imports, hashes, the record)."""
    cells, kernel = execute.notebook_seconds(o.notebook), execute.kernel_start_seconds(o.notebook)
    if not o.seconds or cells is None or kernel is None:
        return None
    rest = max(0.0, o.seconds - cells - kernel)
    return f"{o.target.rb.name}: {cells:.0f} s in its cells, {kernel:.0f} s starting the kernel, {rest:.0f} s " \
           "outside the notebook"


def _machine_note(run_entry: dict) -> str:
    """Whether the committed record's timings were measured on this kind of machine."""
    p = run_entry.get("provenance") or {}
    then = (p.get("cpu") or {}).get("model")
    now = provenance.cpu_model()
    gpus_then, gpus_now = sorted((p.get("gpu") or {}).get("names") or []), sorted(set(provenance.gpus()))
    date = str(run_entry.get("date", ""))[:10]
    if then is None and not gpus_then:
        return f"the committed record ({date}) does not name its CPU: timings may compare across machines"
    if gpus_then != gpus_now or (not gpus_now and then != now):
        return (f"the committed record was made on another machine ({', '.join(gpus_then) or then}, {date}; this "
                f"is {', '.join(gpus_now) or now}): its timings compare across machines, and its exact numbers "
                "(losses, accept lengths) round as that processor does, so they may differ in their last digits "
                "or, after training, by more (docs/findings.md 15)")
    return f"the committed record was made on this kind of machine ({', '.join(gpus_now) or now}, {date})"


def _closure(t: Target) -> set[str]:
    return {t.rb.name}.union(*(_closure(d) for d in t.upstream.values()))


ONE_RUN = {"regression": "worse, in one run", "improvement": "better, in one run", "changed": "changed, in one run"}


def _change(old: dict | None, value: float) -> str:
    """One run against the committed record. A timing outside its tolerance is said to be so in one run: only
    `runbook verify` judges it against its noise. An exact number outside its tolerance is a real difference."""
    if old is None:
        return "new"
    d = drift(old, value)
    if d is None:
        return "within tolerance"
    return f"{d} (exact number)" if records.kind_of(old) == "exact" else ONE_RUN[d]


def _headlines_down(root: Path, runs: set[str]) -> None:
    """Say which headlines the runs just recorded left below their best (specbook.headlines): a re-record must not
    silently become the new reference."""
    from specbook import claims, headlines

    for s in headlines.new_drops(root, claims.doc_texts(root), runs):
        if s.explained:  # the drop that left it there is explained; this run lowered it no further
            _log(f"headline still below its best: {s.headline.key}: {s.state()}")
            continue
        _log(f"HEADLINE DOWN: {s.headline.key} ({s.headline.what}): {s.state()}; until the docs say why, "
             f"`runbook verify --docs` fails; paste: {s.marker()}")


def _refresh_docs(root: Path, ran: list[str]) -> None:
    from specbook.claims import refresh_docs

    if ran:
        for path in refresh_docs(root, ran):
            _log(f"updated {Path(path).relative_to(root) if Path(path).is_absolute() else path}")


@main.command("verify")
@click.argument("names", nargs=-1)
@click.option("--profile", "profiles", multiple=True, help="Only this profile's records; repeat it for several, "
              "whose runbooks are then scheduled together (e.g. --profile h200 --profile h200.dsv3). One other than "
              "this machine's is reported, not re-measured.")
@click.option("--docs", is_flag=True, help="Also check that numbers in docs/ and README.md match the records.")
@click.option("--all", "show_all", is_flag=True, help="List every number, not only those re-measured here or in "
              "a failing state.")
@click.option("--gpus", default="all", show_default=True, metavar="all|N|ID,ID", help="GPUs to spread the "
              "re-measured runbooks over, dependencies first: all visible ones, the first N, or these ids. A runbook "
              "that times something has its GPU to itself (with the timing lock: while it times, and two share one); "
              "up to 3 whose numbers are all exact share one.")
@click.option("--plan", "plan_only", is_flag=True, help="Run nothing: list what would be re-measured, the wall "
              "time of each runbook's recorded run (marked stale where that run was made with other code or "
              "parameters) and the estimated wall time on --gpus. With --profile it plans "
              "for that profile's machine, e.g. an h200 verify from a laptop (--gpus N: N such GPUs); with several, "
              "their runbooks in one schedule, as the verify would run them.")
@click.option("--save", is_flag=True, help="Write each re-measured number's verdict (state, date, machine, commit) "
              "into baselines/verified/verdicts.yaml, which the status page shows as 'last verified': commit it. "
              "Without it a verify changes no tracked file.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (no progress bar).")
@click.pass_obj
@click.pass_context
def verify_(ctx: click.Context, obj: Ctx, names: tuple[str, ...], profiles: tuple[str, ...], docs: bool,
            show_all: bool, gpus: str, plan_only: bool, save: bool, as_json: bool) -> None:
    """Re-run what can run here and judge each number against its record: a noisy one (a timing) within its
    tolerance (derived from the recorded samples, at most 25%; outside it, two of three measurements decide, and
    with changed code they are paired with the recorded commit's engine: side by side without GPUs, in turn on a
    GPU), an exact one to within 0.1%."""
    root = obj.root
    here = provenance.detect_profile()
    if plan_only:
        machines = {provenance.hardware_of(p) for p in profiles}
        if len(machines) > 1:
            raise SpecbookError(f"--plan plans for one machine; these profiles run on {', '.join(sorted(machines))}")
        _print_plan(root, machines.pop() if machines else here, list(names) or None, list(profiles) or None, gpus,
                    as_json)
        return
    ids = _gpu_ids(gpus)
    _announce_verify(root, here, list(names) or None, list(profiles) or None, ids)
    verdicts = verify(root, here, list(names) or None, list(profiles) or None, progress=not as_json, log=_log,
                      gpus=ids)
    code = exit_code(verdicts)
    if save:
        from specbook import verified

        with records.docs_lock(root):  # two verifies saving at once: one after the other, neither entry lost
            saved = verified.save(root, verdicts)
        _log(f"saved the verdicts of {len(saved)} numbers in {verified.PATH}: commit it; `runbook site` shows them "
             "on the status page")
    problems = [str(p) for p in _check_docs(root)] if docs else []
    if problems and code == 0:
        code = 1
    shown = verdicts if show_all else [v for v in verdicts if v.measured is not None or v.state in FAILING
                                       or v.state == MOVED]  # moved without a value: the re-run lacked it
    text = _table(VERDICT_HEADERS, _verdict_rows(shown)) + "\n" if shown else ""
    text += summary(verdicts) if verdicts else "nothing recorded to verify"
    text += "".join(f"\ndocs: {p}" for p in problems)
    _emit(as_json, {"profile": here, "verdicts": [v.as_dict() for v in verdicts], "docs": problems,
                    "exit_code": code}, text)
    ctx.exit(code)


def _announce_verify(root: Path, here: str, names: list[str] | None, profiles: list[str] | None,
                     ids: list[str]) -> None:
    """Before a verify runs anything, as `run` does: which runbooks on which profiles it will re-measure (the
    variants of this machine's profile too), the dependencies it must build first, and `--plan`'s estimate."""
    planned, wall, _ = plan(root, here, names, profiles, ids)
    if not planned:
        return
    keys = {(x.runbook, x.profile) for x in planned}
    builds: dict[tuple[str, str], float] = {}
    for x in planned:
        for dep in _missing_upstream(target(root, x.runbook, x.profile)):
            if (dep.rb.name, dep.profile) not in keys:
                try:
                    prof = records.load(records.path_for(root, dep.rb.name)).data["profiles"].get(dep.profile, {})
                except SpecbookError:  # a malformed record: its own verify names it; here it only adds no time
                    prof = {}
                builds[(dep.rb.name, dep.profile)] = recorded_seconds(root, dep.rb.name, dep.profile, prof)[0] or 0
    seen = sorted({x.profile for x in planned})
    line = "will verify: " + ", ".join(f"{x.runbook} ({x.profile})" for x in planned)
    if builds:
        line += "; first builds (not cached): " + ", ".join(f"{n} ({p})" for n, p in builds)
    line += f"; estimated {(wall + sum(builds.values())) / 60:.1f} min from the recorded runs (`runbook verify " \
            f"--plan` times each re-measured one)"
    if len(seen) > 1 and not profiles:
        line += f"; `--profile {seen[0]}` verifies one profile of {', '.join(seen)}"
    _log(line)


def _missing_upstream(t: Target) -> list[Target]:
    """`t`'s dependencies, transitively, whose outputs are not cached: a run builds them first."""
    out = []
    for dep in t.upstream.values():
        if not dep.done:
            out += [*_missing_upstream(dep), dep]
    return out


def _print_plan(root: Path, machine: str, names: list[str] | None, profiles: list[str] | None, gpus: str,
                as_json: bool) -> None:
    """`verify --plan`: the runbooks a verify on `machine` would re-measure and how long that should take."""
    if gpus == "all":  # this machine's GPUs; planning for another profile's machine: one GPU unless told
        ids = _gpu_ids(gpus) or ([] if profiles is None else ["0"])
    elif gpus.isdigit() and int(gpus) >= 1:
        ids = [str(i) for i in range(int(gpus))]
    else:
        ids = [g.strip() for g in gpus.split(",") if g.strip()]
        if not ids:
            raise SpecbookError(f"--gpus {gpus}: give all, a count or ids")
    planned, wall, total = plan(root, machine, names, profiles, ids)
    rows = [[x.runbook, x.profile, "shared" if x.shares_gpu else "alone",
             "-" if x.seconds is None else f"{x.seconds / 60:.1f} min" + (" (cells)" if x.timed == "cells" else "")
             + (" (stale)" if x.stale else ""),
             ", ".join(x.after) or "-"] for x in planned]
    unknown = [x.runbook for x in planned if x.seconds is None]
    cells = [x.runbook for x in planned if x.timed == "cells"]
    text = _table(["runbook", "profile", "gpu", "recorded run", "waits for"], rows) + "\n" if rows else ""
    where = f"on {len(ids)} GPU(s)" if ids else "here, one runbook at a time"
    text += (f"estimated wall time {where}: {wall / 60:.1f} min (the recorded runs' wall times, cell times where "
             f"marked; runbooks sharing a GPU taken as not slowing each other); one after another: {total / 60:.1f} min"
             ) if planned else f"nothing to re-measure on {machine}"
    if cells:
        text += (f"\n(cells): recorded before runs kept their wall time, so only the cells count, not the process "
                 f"and kernel starts: {', '.join(cells)}")
    if any(x.stale for x in planned):
        text += ("\n(stale): the record was made with other code, parameters or inputs; the time is that run's, and "
                 "today's may differ either way")
    if unknown:
        text += f"\nno executed notebook (counted as 0): {', '.join(unknown)}"
    _emit(as_json, {"machine": machine, "gpus": ids, "plan": [asdict(x) for x in planned], "estimate_s": wall,
                    "sum_s": total}, text)


def _gpu_ids(spec: str) -> list[str]:
    """The GPU ids `--gpus` names, as CUDA_VISIBLE_DEVICES values for the children."""
    visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()] or \
        [str(i) for i in range(len(provenance.gpus()))]
    if spec == "all":
        return visible
    if spec.isdigit():
        if not 1 <= int(spec) <= len(visible):
            raise SpecbookError(f"--gpus {spec}: this machine has {len(visible)} visible GPU(s)")
        return visible[:int(spec)]
    ids = [g.strip() for g in spec.split(",") if g.strip()]
    if not ids or any(i not in visible for i in ids):
        raise SpecbookError(f"--gpus {spec}: not among the visible GPUs ({','.join(visible) or 'none'})")
    return ids


def _check_docs(root: Path) -> list:
    from specbook.claims import check_docs
    from specbook.site import out_of_date

    return [*check_docs(root), *(f"{p.relative_to(root)}: out of date; run `runbook site`" for p in out_of_date(root))]


@main.command("site")
@click.option("--check", is_flag=True, help="Write nothing and fetch nothing; exit 1 when a generated file is out "
              "of date or a headline is down without a word why in the docs (headlines.yaml), 3 when an input "
              "cannot be hashed here without fetching it (unknown here).")
@click.pass_obj
@click.pass_context
def site_(ctx: click.Context, obj: Ctx, check: bool) -> None:
    """Bring what is generated from the records up to date: claim literals in docs/ and README.md, docs/status.md
    (every documented number with its state), docs/llms.txt and docs/llms-full.txt (the docs for agents). `runbook
    run --record` does this too; after copying records made elsewhere (a GPU machine), run it and commit."""
    from specbook import claims, project, site

    root = obj.root
    if check:
        from specbook import headlines

        with project.offline():  # documented to write nothing: no download into a cache either
            stale = site.out_of_date(root)
        for p in stale:
            click.echo(f"{p.relative_to(root)}: out of date; run `runbook site`")
        down = headlines.problems(root, claims.doc_texts(root))
        for file, line, message in down:
            click.echo(f"{file}{f':{line}' if line else ''}: {message}")
        ctx.exit(1 if stale or down else 0)
    site.check_inputs_here(root)  # before anything is written
    with records.docs_lock(root):
        changed = [*claims.refresh_docs(root), *site.write_generated(root)]
    click.echo("\n".join(f"wrote {Path(p).relative_to(root)}" for p in changed) or "generated files are up to date")


@main.command("status")
@click.argument("names", nargs=-1)
@click.option("--all", "show_all", is_flag=True, help="Also list every number (without it: the summary and the "
              "runbooks whose numbers are stale or failing).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (every number).")
@click.pass_obj
@click.pass_context
def status_(ctx: click.Context, obj: Ctx, names: tuple[str, ...], show_all: bool, as_json: bool) -> None:
    """Which records are stale against the current code and parameters; runs nothing. The summary first."""
    verdicts = status(obj.root, list(names) or None)
    code = 3 if any(v.state == FAILED for v in verdicts) else 1 if any(v.state == STALE for v in verdicts) else 0
    text = "no runbooks or records"
    if verdicts:
        text = summary(verdicts) + "\n" + (_table(VERDICT_HEADERS, _verdict_rows(verdicts)) if show_all else
                                           _failing_groups(verdicts, len(verdicts)))
    _emit(as_json, [v.as_dict() for v in verdicts], text.rstrip("\n"))
    _exit_if_invalid([v.detail for v in verdicts if v.state == INVALID])
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
        runs += ["\n    ".join(map(one_line, _run_line(pname, r).split("\n    "))) for r in prof["runs"]]
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
            f"{', ' + '+'.join(active) + ' active' if active else ''}\n    params: {_params_text(r.get('parameters'))}")


def _params_text(params: Any) -> str:
    """A run's parameters as a person reads them: `preset=gpu device=cuda threads=2; unset: target, target_b`."""
    if not isinstance(params, dict) or not params:
        return "none recorded" if not params else str(params)

    def value(v: Any) -> str:
        if isinstance(v, str):
            return v if v and not any(c.isspace() for c in v) else json.dumps(v)
        return json.dumps(v, separators=(",", ":"), default=str) if isinstance(v, (dict, list, bool)) else str(v)

    given = " ".join(f"{k}={value(v)}" for k, v in params.items() if v is not None)
    unset = [k for k, v in params.items() if v is None]
    return (given or "-") + (f"; unset: {', '.join(unset)}" if unset else "")


@main.command("outputs")
@click.argument("name")
@click.option("--profile", help="This machine's hardware profile (default: detected) or another declared one, e.g. "
              "cpu.dsv3.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def outputs_(obj: Ctx, name: str, profile: str | None, as_json: bool) -> None:
    """Where runbook NAME's outputs and its dependencies' are (the trained models under .specbook/outputs/, for
    the code and parameters as they are now) and the command that uses them, as the runbooks' headers name them."""
    root = obj.root
    load(root, name)
    if profile:
        check_profile(root, profile)
    info = outputs_of(root, target(root, name, profile or provenance.detect_profile()))
    _emit(as_json, info, _outputs_text(info))


def outputs_of(root: Path, t: Target) -> dict[str, Any]:
    """What runbook `t` and its dependencies leave for a person (their headers' `outputs`): each one's outputs
    directory, whether it is built, its named paths, and `t`'s command with the directories filled in."""
    chain = {x.rb.name: x for x in _chain(t)}
    groups = [{"runbook": x.rb.name, "profile": x.profile, "dir": _shown(x.outputs_dir), "built": x.done,
               "paths": {_shown(x.outputs_dir / n): what for n, what in x.rb.outputs.get("paths", {}).items()}}
              for x in chain.values() if x.rb.outputs.get("paths")]
    command = t.rb.outputs.get("command", "")
    if command:
        dirs = {n: _shown(x.outputs_dir) for n, x in chain.items()}
        try:
            command = command.format_map({**dirs, "outputs_dir": dirs[t.rb.name],
                                          "python": _shown(Path(sys.executable))})
        except (KeyError, ValueError, IndexError) as e:
            command = f"(the runbook's command could not be filled: {type(e).__name__} {e})"
    return {"runbook": t.rb.name, "profile": t.profile, "built": all(x.done for x in chain.values()),
            "outputs": groups, "command": command}


def _shown(path: Path) -> str:
    """A path as a person types it here: relative to the current directory when it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _outputs_text(info: dict[str, Any]) -> str:
    name, profile = info["runbook"], info["profile"]
    lines = []
    for g in info["outputs"]:
        state = "built" if g["built"] else "not built yet"
        lines += [f"{g['runbook']} ({g['profile']}, {state}): {g['dir']}",
                  *(f"  {path}  {what}" for path, what in g["paths"].items())]
    if info["command"]:
        lines += ["run it:" if info["built"] else "run it, once built:", f"  {info['command']}"]
    if not info["built"]:
        lines.append(f"not built yet for the code and parameters as they are: `runbook run {name}"
                     f"{'' if profile == provenance.detect_profile() else ' --profile ' + profile}` builds them")
    return "\n".join(lines) or f"runbook {name} names no outputs (its header has no `outputs`)"


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
              help="Most tokens the pack may take (estimated at 4 characters a token; not with --json).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable and whole: every number and every docs claim "
              "with its state, the decisions, docs problems and next steps.")
@click.pass_obj
def context(obj: Ctx, budget: int, as_json: bool) -> None:
    """A compact context pack for agents: numbers with verdicts, open decisions, next steps."""
    from specbook.context import build_context, context_data

    if as_json:
        _emit(True, context_data(obj.root), "")
    else:
        click.echo(build_context(obj.root, budget), nl=False)
    _exit_if_invalid(records.broken(obj.root))


if __name__ == "__main__":
    sys.exit(main())
