"""Headlines: the numbers a project's mission stands on, which must not slide unseen.

A committed file (`[tool.specbook] headlines = "headlines.yaml"`) names them, per profile, with which way is better
and an optional goal:

    headlines:
      - key: baseline-eagle3/h200/compiled_speedup
        what: trained pair, compiled EAGLE-3 over the compiled baseline, greedy
        goal: 3.0
        better: higher          # default: the record's direction (required where that is `none`)

Every re-record appends to a metric's history, and each one silently became the new reference. Here each headline's
history is read the way asv reads a benchmark's: its best value so far, and every run that made it worse than the
run before by more than its noise (the record's tolerance; nothing for an exact number). A headline that stands
worse than its best by more than its noise is **down**; the docs must say why, with a marker naming the last run that
lowered it (or a later one):

    <!-- regression: baseline-eagle3/h200/compiled_speedup@20261204T194812Z-7a1c -->the preset was shrunk<!-- /regression -->

Until they do, `runbook verify --docs` and `runbook site --check` fail, `runbook run --record` / `runbook record`
print it, and the status page and dashboard show it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specbook import SpecbookError, project, records
from specbook.text import md_cell

KEY = r"[A-Za-z0-9_.-]+"
REGRESSION_RE = re.compile(
    rf"<!--\s*regression:\s*(?P<key>{KEY}/{KEY}/{KEY})@(?P<run>{KEY})\s*-->(?P<text>[^<\n]*)<!--\s*/regression\s*-->")


@dataclass(frozen=True)
class Headline:
    key: str  # RUNBOOK/PROFILE/METRIC
    what: str
    better: str | None = None  # higher | lower; None: the record's direction
    goal: float | None = None

    @property
    def parts(self) -> tuple[str, str, str]:
        runbook, profile, metric = self.key.split("/", 2)
        return runbook, profile, metric


@dataclass(frozen=True)
class Point:
    value: float
    run: str
    date: str
    commit: str  # of the run, from its provenance ("" when unknown)


@dataclass
class Standing:
    """Where a headline stands in its record's history."""
    headline: Headline
    unit: str = ""
    better: str = "higher"
    noise: float = 0.0  # relative: how much worse a value may be and still be the same (the record's tolerance)
    now: Point | None = None
    best: Point | None = None
    drops: list[tuple[Point, Point]] = field(default_factory=list)  # (before, after) runs that lowered it since best
    explained: str | None = None  # where the docs say why (file:line), for the last drop
    problem: str = ""  # why it cannot be read (no record, unknown metric, ...)

    @property
    def down(self) -> bool:
        return self.now is not None and self.best is not None and self._worse(self.now.value, self.best.value)

    @property
    def met(self) -> bool | None:
        goal = self.headline.goal
        if goal is None or self.now is None:
            return None
        return self.now.value >= goal if self.better == "higher" else self.now.value <= goal

    @property
    def unexplained(self) -> bool:
        return self.down and self.explained is None

    def _worse(self, value: float, than: float) -> bool:
        delta = than - value if self.better == "higher" else value - than
        return delta > self.noise * abs(than) + 1e-12 * max(1.0, abs(than))

    def state(self) -> str:
        """One phrase: `down 44% from its best (2.77, 2026-11-30, 4913893); explained at docs/findings.md:12`."""
        if self.problem:
            return f"unreadable: {self.problem}"
        goal = {None: "", True: "goal met", False: "below goal"}[self.met]
        if not self.down:
            return goal or "at its best"
        b, n = self.best, self.now
        share = abs(n.value - b.value) / abs(b.value) if b.value else 0.0
        why = f"explained at {self.explained}" if self.explained else "UNEXPLAINED: say why in the docs"
        return (f"down {share:.0%} from its best ({fmt(b.value)} on {b.date[:10]}, commit {b.commit[:7] or '-'}); "
                f"{why}" + (f"; {goal}" if goal else ""))

    def marker(self) -> str:
        """The marker that explains the last drop, to paste into the docs."""
        run = self.drops[-1][1].run if self.drops else (self.now.run if self.now else "RUN")
        return f"<!-- regression: {self.headline.key}@{run} -->WHY<!-- /regression -->"


def fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def load(root: Path) -> list[Headline]:
    """The project's headlines; [] when it names no file. A malformed file is one line (SpecbookError)."""
    name = project.settings(root).headlines
    if name is None:
        return []
    path = Path(root) / name
    items = project.yaml_list(path, "headlines", "{key, what, goal, better}")
    out = []
    for i, item in enumerate(items):
        where = f"{path}: headlines[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("key"), str) \
                or not re.fullmatch(rf"{KEY}/{KEY}/{KEY}", item["key"]):
            raise SpecbookError(f"{where}: `key` must be RUNBOOK/PROFILE/METRIC")
        if unknown := sorted(set(item) - {"key", "what", "goal", "better"}):
            raise SpecbookError(f"{where}: unknown field(s) {', '.join(unknown)}")
        goal, better = item.get("goal"), item.get("better")
        if goal is not None and (isinstance(goal, bool) or not isinstance(goal, (int, float))):
            raise SpecbookError(f"{where}: `goal` must be a number, not {goal!r}")
        if better not in (None, "higher", "lower"):
            raise SpecbookError(f"{where}: `better` must be higher or lower, not {better!r}")
        out.append(Headline(item["key"], str(item.get("what") or item["key"]), better,
                            None if goal is None else float(goal)))
    return out


def history(root: Path, h: Headline, cache: dict) -> list[Point]:
    """Every recorded value of a headline, oldest first."""
    runbook, profile, metric = h.parts
    if runbook not in cache:
        path = records.path_for(Path(root), runbook)
        cache[runbook] = records.load(path).data if path.is_file() else None
    prof = ((cache[runbook] or {}).get("profiles") or {}).get(profile) or {}
    entry = (prof.get("metrics") or {}).get(metric)
    if entry is None:
        return []
    runs = {r["id"]: r for r in prof["runs"]}
    return [_point(e, runs) for e in entry.get("history") or [entry]]


def _point(entry: dict[str, Any], runs: dict[str, dict]) -> Point:
    prov = (runs.get(entry["run"]) or {}).get("provenance") or {}
    return Point(float(entry["value"]), str(entry["run"]), str(entry.get("date", "")),
                 str(prov.get("git_commit") or ""))


def standing(root: Path, h: Headline, cache: dict | None = None, explanations: dict | None = None) -> Standing:
    """A headline's best, now and the drops since its best, from its record's history."""
    cache = {} if cache is None else cache
    runbook, profile, metric = h.parts
    s = Standing(h)
    points = history(root, h, cache)
    prof = cache[runbook]["profiles"][profile] if points else None
    entry = prof["metrics"][metric] if prof else None
    if entry is None:
        s.problem = f"no record of {h.key}"
        return s
    s.unit, s.better = entry.get("unit", ""), h.better or entry.get("direction", "none")
    if s.better not in ("higher", "lower"):
        s.problem = f"{h.key} has direction {s.better}: say `better: higher` or `lower` in the headlines file"
        return s
    tol = entry.get("tolerance") or {}
    s.noise = 0.0 if records.kind_of(entry) == "exact" else float(tol.get("rel", 0.0))
    best_at = _best_index(s, points)
    s.best, s.now = points[best_at], points[-1]
    for before, after in zip(points[best_at:], points[best_at + 1:]):
        if s._worse(after.value, before.value) or (s._worse(after.value, s.best.value)
                                                   and not s._worse(before.value, s.best.value)):
            s.drops.append((before, after))
    if s.down:
        order = {p.run: i for i, p in enumerate(points)}
        last = order[s.drops[-1][1].run] if s.drops else len(points) - 1
        for run, where in (explanations or {}).get(h.key, []):
            if order.get(run, -1) >= last:
                s.explained = where
                break
    return s


def _best_index(s: Standing, history: list[Point]) -> int:
    """The first run of the best value: the highest (or lowest) the history holds. Noise is for judging `down`."""
    sign = 1.0 if s.better == "higher" else -1.0
    return max(range(len(history)), key=lambda i: (sign * history[i].value, -i))


def explanations(root: Path, texts: dict[str, str]) -> dict[str, list[tuple[str, str]]]:
    """{key: [(run, file:line), ...]} from the regression markers in the docs' texts ({file: text})."""
    out: dict[str, list[tuple[str, str]]] = {}
    for file, text in texts.items():
        for m in REGRESSION_RE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.setdefault(m["key"], []).append((m["run"], f"{file}:{line}"))
    return out


def _where(mark: str) -> tuple[str, int]:
    file, _, line = mark.rpartition(":")
    return file, int(line)

    return out


def standings(root: Path, texts: dict[str, str]) -> list[Standing]:
    cache: dict = {}
    marks = explanations(root, texts)
    return [standing(root, h, cache, marks) for h in load(root)]


def problems(root: Path, texts: dict[str, str]) -> list[tuple[str, int, str]]:
    """(file, line, message) for every headline down without a word why (at the headlines file), and every
    regression marker that names no run of its headline's history."""
    out = []
    name = project.settings(root).headlines or "headlines"
    known: dict[str, set[str]] = {}
    for s in standings(root, texts):
        if s.problem:
            out.append((name, 0, s.problem))
            continue
        if s.unexplained:
            b, n = s.best, s.now
            out.append((name, 0, f"headline {s.headline.key} is down from {fmt(b.value)} {s.unit} ({b.date[:10]}, "
                              f"commit {b.commit[:7] or '-'}) to {fmt(n.value)} (run {n.run}, commit "
                              f"{n.commit[:7] or '-'}): say why in the docs with {s.marker()}"))
    for key, marks in explanations(root, texts).items():
        runbook, profile, metric = key.split("/", 2)
        if key not in known:
            path = records.path_for(Path(root), runbook)
            data = records.load(path).data if path.is_file() else {}
            entry = data.get("profiles", {}).get(profile, {}).get("metrics", {}).get(metric) or {}
            known[key] = {e["run"] for e in entry.get("history") or []}
        for run, where in marks:
            if run not in known[key]:
                out.append((*_where(where), f"regression marker names {key}@{run}, which is no run of that metric's history"))
    return out


def new_drops(root: Path, texts: dict[str, str], runs: set[str]) -> list[Standing]:
    """The headlines that one of `runs` (just recorded) left down: what `runbook run --record` prints."""
    return [s for s in standings(root, texts) if s.down and s.now is not None and s.now.run in runs]


def markdown(root: Path, texts: dict[str, str]) -> list[str]:
    """The status page's headline table: where each headline stands, its goal and whether a drop is explained."""
    rows = ["| headline | now | best | goal | state |", "|---|---|---|---|---|"]
    for s in standings(root, texts):
        h = s.headline
        if s.problem:
            rows.append(f"| `{h.key}` | - | - | - | {md_cell(s.state())} |")
            continue
        goal = "-" if h.goal is None else f"{'>=' if s.better == 'higher' else '<='} {fmt(h.goal)}"
        state = s.state().replace("UNEXPLAINED", "**UNEXPLAINED**")
        cells = (f"{h.what} (`{h.key}`)", f"{fmt(s.now.value)} {s.unit} ({s.now.date[:10]})",
                 f"{fmt(s.best.value)} ({s.best.date[:10]})", goal, state)
        rows.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
    return rows


def history_svg(root: Path, shown: list[Standing]) -> str:
    """Small multiples: one panel per headline, its every recorded value in order (x: the run's date), the goal
    dashed, the best ringed and the runs that lowered it in red; one quantity and its unit per panel."""
    import matplotlib  # noqa: PLC0415 - heavy, only needed when the site is built

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    shown = [s for s in shown if not s.problem]
    cols = 3
    rows = max(1, -(-len(shown) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.4 * rows), squeeze=False)
    cache: dict = {}
    for ax, s in zip(axes.flat, shown):
        points = history(root, s.headline, cache)
        xs = list(range(len(points)))
        ax.plot(xs, [p.value for p in points], marker="o", ms=3, color="#3366aa", lw=1)
        lowered = {after.run for _, after in s.drops}
        bad = [(i, p.value) for i, p in enumerate(points) if p.run in lowered]
        if bad:
            ax.plot(*zip(*bad), "o", color="#cc2222", ms=5, label="lowered it")
        best = next(i for i, p in enumerate(points) if p.run == s.best.run)
        ax.plot([best], [points[best].value], "o", mfc="none", mec="#228822", ms=9, label="best")
        if s.headline.goal is not None:
            ax.axhline(s.headline.goal, color="grey", ls="--", lw=0.8, label="goal")
        ax.set_title(f"{s.headline.key}", fontsize=8)
        ax.set_ylabel(s.unit or "value", fontsize=8)
        ticks = sorted({0, len(points) - 1})
        ax.set_xticks(ticks, [points[i].date[5:10] for i in ticks], fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    if shown:
        axes.flat[0].legend(fontsize=6, frameon=False)
    fig.tight_layout()
    import io  # noqa: PLC0415

    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    return buf.getvalue()
