"""`runbook context`: a compact context pack for an agent - current numbers with their verdicts, open decisions,
next steps - cut to a token budget. Sections come in priority order; a section cut short says how much it left out
and where to find the rest."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specbook import SpecbookError, claims, headlines, runbooks, site, verify
from specbook.text import one_line

CHARS_PER_TOKEN = 4  # a rough, conservative estimate for English and numbers


@dataclass
class Section:
    title: str
    lines: list[str]
    more: str  # where the lines left out can be read
    share: float  # of the budget after the header


def tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


def _headline(root: Path, runbook: str) -> set[str]:
    """The metrics a runbook's header says it reproduces (empty when there is no runbook, e.g. reported numbers)."""
    try:
        return set(runbooks.load(root, runbook).reproduces)
    except SpecbookError:
        return set()


def number_lines(root: Path) -> list[str]:
    """One line per runbook and profile, those the docs quote first: the verdict most of its numbers share, source,
    hardware, date, then its headline metrics (those its header says it reproduces; all when it names none), a
    metric's own verdict only where it differs."""
    groups: dict[tuple[str, str], list[site.Row]] = {}
    for row in site.record_rows(root):
        groups.setdefault((row.runbook, row.profile), []).append(row)
    quoted = {(c.runbook, c.profile) for path in claims.doc_files(root)
              for c in claims.parse_claims(path.read_text(), path.name)[0]}
    lines = []
    for (runbook, profile), rows in sorted(groups.items(), key=lambda g: (g[0] not in quoted, g[0])):
        headline = _headline(root, runbook)
        shown = [r for r in rows if r.metric in headline] or rows
        common = Counter(r.verdict for r in rows).most_common(1)[0][0]
        metrics = "; ".join(f"{r.metric} {r.value:.4g} {r.unit}".rstrip()
                            + (f" [{r.verdict}]" if r.verdict != common else "") for r in shown)
        more = f"; +{len(rows) - len(shown)} more" if len(rows) > len(shown) else ""
        latest = max(rows, key=lambda r: r.date)
        where = "" if latest.here or latest.source == "reported" else f", {profile.split('.')[0]} only"
        lines.append(one_line(f"- {runbook} @ {profile} [{common}{where}] ({latest.source}, {latest.hardware}, "
                              f"{latest.date}): {metrics}{more}"))
    return lines


def _sections_of(text: str, level: str) -> list[tuple[str, str]]:
    """(heading, body) for each heading of the given level ("##")."""
    parts = re.split(rf"^{level} (.+)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def _plain_text(text: str) -> str:
    text = re.sub(r"<!--\s*(?:claim|cite):[^>]*-->|<!--\s*/(?:claim|cite)\s*-->", "", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return " ".join(text.replace("**", "").split())


def _field(body: str, name: str) -> str:
    m = re.search(rf"^- \*\*{name}:\*\*(.*?)(?=^- \*\*|^#|\Z)", body, flags=re.M | re.S)
    return _plain_text(m.group(1)) if m else ""


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def decisions(root: Path) -> list[dict[str, str]]:
    """Every decision of docs/decisions.md: title, status, date, decision, why it is open (plain text)."""
    path = Path(root) / "docs" / "decisions.md"
    if not path.is_file():
        return []
    return [{"title": heading, "status": _field(body, "Status") or "unknown", "date": _field(body, "Date"),
             "decision": _field(body, "Decision"), "why_open": _field(body, "Why it is open")}
            for heading, body in _sections_of(path.read_text(), "##")]


def decision_lines(root: Path) -> list[str]:
    """Open decisions from docs/decisions.md, with date, decision and the first sentence of why they are open (the
    rest is in the file: a decision must fit its share of a small budget); then a count of the rest."""
    lines, closed = [], []
    for d in decisions(root):
        if d["status"] != "open":
            closed.append(f"{d['title'].split(':')[0]} {d['status']}")
            continue
        why = _SENTENCE_END.split(d["why_open"], maxsplit=1)[0]
        lines.append(f"- {d['title']} [open, {d['date']}]: {d['decision']} Open because: {why}")
    if closed:
        lines.append(f"- Closed: {', '.join(closed)} (docs/decisions.md)")
    return lines


def next_steps(root: Path) -> list[str]:
    """The items of the game plan's "Next steps" section, as plain text."""
    path = Path(root) / "docs" / "game-plan.md"
    if not path.is_file():
        return []
    for heading, body in _sections_of(path.read_text(), "##"):
        if heading.strip().lower() == "next steps":
            return [_plain_text(item) for item in re.findall(r"^- (.+(?:\n  .+)*)", body, flags=re.M)]
    return []


def next_step_lines(root: Path) -> list[str]:
    return [f"- {item}" for item in next_steps(root)]


def headline_lines(root: Path) -> list[str]:
    """The headlines (headlines.yaml), those down or below their goal first: what the mission stands on."""
    out = []
    for s in headlines.standings(root, claims.doc_texts(root)):
        if s.problem or s.now is None:
            continue
        goal = "" if s.headline.goal is None else f", goal {headlines.fmt(s.headline.goal)}"
        out.append((not s.down and s.met is not False,
                    f"- {s.headline.key} = {headlines.fmt(s.now.value)} {s.unit}{goal}: {s.state()}"))
    return [line for _, line in sorted(out, key=lambda x: x[0])]


def problem_lines(root: Path) -> list[str]:
    return [f"- {p}" for p in claims.check_docs(root)]


def claim_rows(root: Path) -> list[dict[str, Any]]:
    """Every number the docs and README quote: where, the literal, and its record's state on this machine."""
    index = verify.index(root)
    rows = []
    for path in [*claims.doc_files(root), *claims.extra_files(root)]:
        rel = path.relative_to(root).as_posix()
        for c in claims.parse_claims(path.read_text(), rel)[0]:
            v = index.get(c.key)
            state = claims.PINNED if c.run and v else v.state if v else verify.UNRECORDED
            rows.append({"claim": c.key, "run": c.run, "file": rel, "line": c.line, "literal": c.literal,
                         "state": state, "unit": v.unit if v else None})
    return rows


def context_data(root: Path | str) -> dict[str, Any]:
    """What the context pack says, whole and machine-readable (no budget): every recorded number with its state, every
    claim in the docs with its state, the decisions, the docs problems and the next steps."""
    root = Path(root)
    numbers = [{"runbook": r.runbook, "profile": r.profile, "metric": r.metric, "value": r.value, "unit": r.unit,
                "state": r.verdict, "source": r.source, "hardware": r.hardware, "date": r.date, "here": r.here}
               for r in site.record_rows(root)]
    marks = claims.doc_texts(root)
    heads = [{"key": s.headline.key, "what": s.headline.what, "goal": s.headline.goal,
              "now": s.now.value if s.now else None, "best": s.best.value if s.best else None, "down": s.down,
              "explained": s.explained, "state": s.state()} for s in headlines.standings(root, marks)]
    return {"headlines": heads, "numbers": numbers, "claims": claim_rows(root), "decisions": decisions(root),
            "problems": [str(p) for p in claims.check_docs(root)], "next_steps": next_steps(root)}


def build_context(root: Path | str, budget: int = 2000) -> str:
    """The context pack, at most `budget` tokens (estimated). Each section may fill the budget up to its cumulative
    share, so a long list of numbers cannot crowd out the open decisions; what a section leaves unused carries on."""
    root = Path(root)
    head = ("# specbook context\n"
            "EAGLE-3 drafter moved from Kimi-K2 to Kimi-K2.5; numbers are records in baselines/ with states "
            "(current = inputs unchanged since recorded; stale = inputs changed; reported = measured by hand "
            "elsewhere; 'h200 only' = re-measurable only on that hardware; docs/status.md lists every claim). "
            "Before trusting a number: `runbook show NAME`, `runbook env`, `runbook verify NAME`. "
            "Start with AGENTS.md and docs/index.md.\n")
    sections = [
        Section("Headlines (headlines.yaml: against their best and goal)", headline_lines(root), "docs/status.md",
                0.15),
        Section("Numbers (runbook @ profile [verdict]: headline metrics)", number_lines(root), "`runbook show NAME`",
                0.4),
        # decisions before problems: a checkout whose records are stale has many problem lines
        Section("Open decisions", decision_lines(root), "docs/decisions.md", 0.2),
        Section("Docs problems", problem_lines(root), "`runbook verify --docs`", 0.15),
        Section("Next steps", next_step_lines(root), "docs/game-plan.md", 0.1),
    ]
    out = head
    if tokens(out) > budget:
        raise claims.DocsError(f"--budget {budget} is too small for the context header ({tokens(head)} tokens)")
    share = 0.0
    for sec in sections:
        share += sec.share
        limit = budget if sec is sections[-1] else tokens(head) + int(share * (budget - tokens(head)))
        out += _fit(sec, out, limit, budget)
    return out


def _fit(sec: Section, out: str, limit: int, budget: int) -> str:
    """As many of the section's lines as fit under `limit` tokens, with a pointer to the rest; a one-line note when
    none fits."""
    if not sec.lines:
        return ""
    title, kept = f"\n## {sec.title}\n", []
    for i, line in enumerate(sec.lines):
        left = len(sec.lines) - i - 1
        tail = f"- ... {left} more: {sec.more}\n" if left else ""
        if tokens(out + title + "".join(kept) + line + "\n" + tail) > limit:
            break
        kept.append(line + "\n")
    if not kept:
        note = f"\n({sec.title}: {len(sec.lines)} left out for the budget; see {sec.more})\n"
        return note if tokens(out + note) <= budget else ""
    left = len(sec.lines) - len(kept)
    return title + "".join(kept) + (f"- ... {left} more: {sec.more}\n" if left else "")
