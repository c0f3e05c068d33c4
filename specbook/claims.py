"""Numbers in docs tied to records, and the docs checks.

A claim is written literally between two HTML comments, so raw Markdown shows the real value:

    <!-- claim: baseline-decode/h200/decode_tok_s fmt=.0f -->227<!-- /claim -->

`fmt` is a Python format spec for the record's value, or `range:SPEC` for the low and high of its samples
("82-83"; just the value when the record has no samples). A claim follows the record: each new run rewrites it.
Prose about one run ("the record before gave 562 tok/s") pins the claim to that run's entry in the record's
history instead, which later runs never change and staleness never touches:

    <!-- claim: deepseek-mla-moe/h200/compiled_decode_tok_s@20261203T164740Z-37bd fmt=.0f -->562<!-- /claim -->
 Numbers that look measured (tok/s, ms, speedups, accept
length) must stand in a claim; numbers that come from elsewhere (a paper, a goal) are wrapped in a citation instead:

    <!-- cite: EAGLE-3 paper, table 1 -->4.40x<!-- /cite -->
"""
from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import yaml

from specbook import SpecbookError, headlines, pending, records, verify
from specbook.fsutil import atomic_write

FRONT_MATTER_KEYS = ("title", "status", "updated", "runbooks", "records")
# Pages the site generates at build time (specbook.site): links to them are not broken.
GENERATED_PAGES = frozenset({"dashboard.md"})
# Pages `runbook site` writes and commits (specbook.site.generated): made from the claims, not read for them.
GENERATED_FILES = frozenset({"docs/status.md"})
# States that make a documented number untrustworthy; "current" on another profile is shown, not failed.
FAILING_VERDICTS = verify.FAILING

KEY = r"[A-Za-z0-9_.-]+"
CLAIM_RE = re.compile(
    rf"<!--\s*claim:\s*(?P<runbook>{KEY})/(?P<profile>{KEY})/(?P<metric>{KEY})(?:@(?P<run>{KEY}))?"
    r"(?:\s+fmt=(?P<fmt>\S+))?\s*-->"
    r"(?P<literal>[^<\n]*)<!--\s*/claim\s*-->"
)
CITE_RE = re.compile(r"<!--\s*cite:\s*(?P<source>[^>\n]*\S)\s*-->(?P<text>[^<\n]*)<!--\s*/cite\s*-->")
CHECK_RE = re.compile(r"<!--\s*check:\s*(?P<expr>[^\n]*?\S)\s*-->(?P<text>[^<\n]*)<!--\s*/check\s*-->")
ANY_MARKER_RE = re.compile(r"<!--\s*/?\s*(?:claim|cite|check)\b")
KEY_RE = re.compile(rf"(?<![\w/.-])({KEY})/({KEY})/({KEY})(?:@({KEY}))?(?![\w/@])")
FENCE_RE = re.compile(r"^(\s*)(```|~~~).*?^\1\2[^\n]*$", re.M | re.S)
INLINE_CODE_RE = re.compile(r"`[^`\n]+`")
COMMENT_RE = re.compile(r"<!--.*?-->", re.S)
LINK_RE = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")

NUM = r"(?<![\w.-])\d+(?:\.\d+)?(?:\s*[-\u2013]\s*\d+(?:\.\d+)?)?"
MEASURED_RES = (
    (re.compile(rf"{NUM}\s*(?:tok/s|tokens?/s|tokens per second|ms|\u00b5s|us|[GTMK]i?B/s|[GTM]i?B|"
                rf"s|sec|seconds?|min|minutes?|h|hours?)(?![\w/])"), "a rate, size or time"),
    (re.compile(rf"{NUM}\s*[x\u00d7](?![\w-])(?!\s*[A-Z])"), "a speedup"),
    (re.compile(rf"{NUM}\s*[x\u00d7]?\s*(?:slower|faster)\b"), "a relative speed"),
    (re.compile(rf"{NUM}\s*%"), "a percentage"),
    (re.compile(rf"(?i:accept(?:ance)?[ _-]len(?:gth)?s?|\btau\b|\u03c4)[^.\d\n]{{0,24}}{NUM}"), "an accept length"),
)
# a comparison between measured numbers stated in words: it must stand in a <!-- check: EXPR --> marker
COMPARISON_RE = re.compile(r"(?i)\b(?:faster|slower|gains? (?:less|more)|beats|outperforms?|(?:more|less|fewer) than|"
                           r"(?:higher|lower|better|worse) than)\b")


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


@dataclass(frozen=True)
class Claim:
    file: str
    line: int
    start: int  # offsets of the literal in the file's text
    end: int
    marker: tuple[int, int]  # offsets of the whole marker pair around it
    runbook: str
    profile: str
    metric: str
    fmt: str
    literal: str
    run: str | None = None  # pinned to this run's entry in the metric's history; None: the recorded value

    @property
    def key(self) -> str:
        return f"{self.runbook}/{self.profile}/{self.metric}"

    @property
    def label(self) -> str:
        """The key as written in the marker, with the pinned run."""
        return self.key + (f"@{self.run}" if self.run else "")


class DocsError(SpecbookError):
    """Bad docs input or a refused write; the message is one line for the user."""


# ---------------------------------------------------------------------------------------------- records


def _load_record(root: Path, runbook: str, cache: dict) -> dict | None:
    """The parsed baselines/RUNBOOK.yaml (validated by specbook.records), or None when there is none."""
    if runbook not in cache:
        path = records.path_for(Path(root), runbook)
        cache[runbook] = records.load(path).data if path.is_file() else None
    return cache[runbook]


def find_metric(root: Path, runbook: str, profile: str, metric: str, cache: dict | None = None) -> dict | None:
    """The metric entry of a record (value, unit, samples, ...) or None."""
    data = _load_record(root, runbook, {} if cache is None else cache) or {}
    return (data["profiles"].get(profile) or {}).get("metrics", {}).get(metric) if data else None


def pinned_metric(metric: dict | None, run: str | None) -> dict | None:
    """The metric as one run measured it (its history entry: the value, no samples), or the metric itself when no
    run is named; None when the history has no entry of that run."""
    if metric is None or run is None:
        return metric
    entry = next((h for h in reversed(metric.get("history") or []) if h.get("run") == run), None)
    return None if entry is None else {**{k: v for k, v in metric.items() if k not in ("samples", "history")},
                                       "value": entry["value"], "run": run}


PINNED = "pinned"  # a claim's state when it quotes one run's value: never stale, since that run measured it
PINNED_MEANING = "one run's value from the record's history (`@RUN` in the marker): what that run measured stays true"


def pinned_run(root: Path, claim: Claim, cache: dict) -> dict | None:
    """The run a pinned claim quotes, from the record's runs (date, provenance), or None."""
    data = _load_record(root, claim.runbook, cache) or {}
    prof = (data.get("profiles") or {}).get(claim.profile) or {}
    return next((r for r in prof.get("runs") or [] if r.get("id") == claim.run), None) if claim.run else None


def claim_metric(root: Path, claim: Claim, cache: dict) -> dict | None:
    """What a claim quotes: the recorded metric, or its history entry of the pinned run."""
    return pinned_metric(find_metric(root, claim.runbook, claim.profile, claim.metric, cache), claim.run)


def record_verdict(root: Path, runbook: str, profile: str, metric: str, cache: dict) -> str:
    """The state of one recorded metric (specbook.verify: current, stale, reported, ...), from input hashes; the
    index of every record is computed once per cache."""
    if "index" not in cache:
        cache["index"] = verify.index(Path(root))
    v = cache["index"].get(f"{runbook}/{profile}/{metric}")
    return v.state if v else verify.UNRECORDED


def format_value(metric: dict, fmt: str) -> str:
    """The literal a claim shows: `range:SPEC` renders low-high of the samples (the value when there are none)."""
    if fmt.startswith("range:"):
        spec, samples = fmt[len("range:"):], metric.get("samples") or [metric["value"]]
        low, high = format(min(samples), spec), format(max(samples), spec)
        return low if low == high else f"{low}-{high}"
    return format(metric["value"], fmt)


def valid_fmt(fmt: str) -> bool:
    try:
        format(1.5, fmt.removeprefix("range:"))
    except (ValueError, TypeError):
        return False
    return True


# ---------------------------------------------------------------------------------------------- parsing


def _blank(text: str, start: int, end: int) -> str:
    """Replace text[start:end] with spaces, keeping newlines, so offsets and line numbers stay put."""
    return text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def split_front_matter(text: str) -> tuple[dict | None, int]:
    """(front matter mapping or None, offset where the body starts)."""
    m = re.match(r"---\n(.*?\n)---\n", text, re.S)
    if not m:
        return None, 0
    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError:
        return None, 0
    return (data if isinstance(data, dict) else None), m.end()


def prose_mask(text: str) -> str:
    """The text with front matter, fenced code and inline code blanked: what markers and numbers are read from."""
    _, body = split_front_matter(text)
    masked = _blank(text, 0, body)
    for rx in (FENCE_RE, INLINE_CODE_RE):
        for m in rx.finditer(masked):
            masked = _blank(masked, m.start(), m.end())
    return masked


def parse_claims(text: str, file: str) -> tuple[list[Claim], list[Problem]]:
    masked = prose_mask(text)
    claims, problems, covered = [], [], []
    for m in CLAIM_RE.finditer(masked):
        covered.append((m.start(), m.end()))
        line = _line_of(text, m.start())
        fmt = m.group("fmt") or "g"
        if not valid_fmt(fmt):
            problems.append(Problem(file, line, f"claim {m.group('runbook')}/{m.group('profile')}/"
                                                f"{m.group('metric')}: bad fmt={fmt!r}"))
            continue
        claims.append(Claim(file, line, m.start("literal"), m.end("literal"), m.span(), m.group("runbook"),
                            m.group("profile"), m.group("metric"), fmt, m.group("literal"), m.group("run")))
    covered += [(m.start(), m.end()) for rx in (CITE_RE, CHECK_RE) for m in rx.finditer(masked)]
    for m in ANY_MARKER_RE.finditer(masked):
        if not any(a <= m.start() < b for a, b in covered):
            problems.append(Problem(file, _line_of(text, m.start()),
                                    "malformed marker: expected <!-- claim: RUNBOOK/PROFILE/METRIC[@RUN] fmt=SPEC -->"
                                    "LITERAL<!-- /claim --> or <!-- cite: SOURCE -->TEXT<!-- /cite --> on one line"))
    return claims, problems


# ---------------------------------------------------------------------------------------------- checks


def doc_files(root: Path) -> list[Path]:
    """Markdown that agents and the site read: docs/**/*.md and AGENTS.md (executed notebooks excluded)."""
    root = Path(root)
    files = sorted(p for p in (root / "docs").rglob("*.md") if "executed" not in p.relative_to(root).parts
                   and p.relative_to(root).as_posix() not in GENERATED_FILES)
    return files + [p for p in [root / "AGENTS.md"] if p.is_file()]


def extra_files(root: Path) -> list[Path]:
    """Markdown outside docs/ whose numbers are checked too (README.md), without front matter or site rules."""
    return [p for p in [Path(root) / "README.md"] if p.is_file()]


def _check_front_matter_records(root: Path, text: str, file: str) -> list[Problem]:
    """Front matter `records:` names record files that exist and that the page quotes; `runbooks:` runbooks that
    exist."""
    data, _ = split_front_matter(text)
    if not data:
        return []
    quoted = {c.runbook for c in parse_claims(text, file)[0]}
    out = []
    for name in data.get("records") or []:
        if not records.path_for(root, str(name)).is_file():
            out.append(Problem(file, 2, f"front matter records: {name} has no baselines/{name}.yaml"))
        elif name not in quoted:
            out.append(Problem(file, 2, f"front matter records: {name} is listed but no claim on the page quotes it"))
    out += [Problem(file, 2, f"front matter runbooks: no runbooks/{n}.py") for n in data.get("runbooks") or []
            if not (root / "runbooks" / f"{n}.py").is_file()]
    return out


def _check_front_matter(text: str, file: str) -> list[Problem]:
    data, _ = split_front_matter(text)
    if data is None:
        return [Problem(file, 1, "no YAML front matter (--- " + ", ".join(FRONT_MATTER_KEYS) + " ---)")]
    missing = [k for k in FRONT_MATTER_KEYS if k not in data]
    if missing:
        return [Problem(file, 2, f"front matter lacks {', '.join(missing)}")]
    bad = [k for k in ("runbooks", "records") if not isinstance(data[k], list)]
    return [Problem(file, 2, f"front matter {k} must be a list") for k in bad]


def _check_links(text: str, path: Path, root: Path, file: str) -> list[Problem]:
    problems = []
    docs = (root / "docs").resolve()
    for m in LINK_RE.finditer(prose_mask(text)):
        target = m.group(1)
        if re.match(r"[a-zA-Z][\w+.-]*:", target) or target.startswith(("#", "/")):
            continue
        rel = target.split("#", 1)[0]
        dest = (path.parent / rel).resolve()
        generated = dest.is_relative_to(docs) and dest.relative_to(docs).as_posix() in GENERATED_PAGES
        if not (dest.exists() or generated):
            problems.append(Problem(file, _line_of(text, m.start()), f"broken link: {target}"))
    return problems


def _check_numbers(text: str, file: str) -> list[Problem]:
    masked = COMMENT_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), _masked_markers(text))
    problems = [Problem(file, _line_of(text, m.start()),
                        f"{m.group()!r} compares in words: state it as <!-- check: RUNBOOK/PROFILE/METRIC < ... -->"
                        "TEXT<!-- /check --> so the comparison is checked against the records")
                for m in COMPARISON_RE.finditer(masked)]
    for rx, what in MEASURED_RES:
        for m in rx.finditer(masked):
            problems.append(Problem(file, _line_of(text, m.start()),
                                    f"{m.group().strip()!r} looks like {what} outside a claim marker "
                                    "(tie it to a record, or wrap a published number in <!-- cite: SOURCE -->)"))
    return problems


def _masked_markers(text: str) -> str:
    masked = prose_mask(text)
    for rx in (CLAIM_RE, CITE_RE, CHECK_RE):
        for m in rx.finditer(masked):
            masked = _blank(masked, m.start(), m.end())
    return masked


def check_claim(root: Path, claim: Claim, cache: dict) -> list[Problem]:
    metric = find_metric(root, claim.runbook, claim.profile, claim.metric, cache)
    if metric is None:
        return [Problem(claim.file, claim.line, f"claim {claim.key}: no such record in baselines/")]
    if (pinned := pinned_metric(metric, claim.run)) is None:
        return [Problem(claim.file, claim.line, f"claim {claim.label}: no run {claim.run} in the history of "
                                                f"{claim.key}")]
    expected = format_value(pinned, claim.fmt)
    if claim.literal != expected:
        return [Problem(claim.file, claim.line, f"claim {claim.label}: literal {claim.literal!r} != record "
                                                f"{expected!r} (run `runbook run`)")]
    if claim.run:  # what one run measured stays true when later inputs change
        return []
    verdict = record_verdict(root, claim.runbook, claim.profile, claim.metric, cache)
    if verdict == verify.STALE and pending.owed(root, claim.profile):  # shown as owed, re-made where it can be
        return []
    if verdict in FAILING_VERDICTS:
        return [Problem(claim.file, claim.line,
                        f"claim {claim.key}: record is {verdict} (`runbook verify {claim.runbook}`)")]
    return []


def evaluate_check(root: Path, expr: str, cache: dict) -> bool:
    """A check marker's expression over record values (RUNBOOK/PROFILE/METRIC, with @RUN for one run's value),
    numbers, + - * /, comparisons, and/or/not, abs/min/max; raises DocsError for anything else or a missing record."""
    values: dict[str, float] = {}

    def name_of(m: re.Match) -> str:
        metric = pinned_metric(find_metric(root, m.group(1), m.group(2), m.group(3), cache), m.group(4))
        if metric is None:
            raise DocsError(f"check {expr!r}: no record {m.group()}")
        key = f"_v{len(values)}"
        values[key] = metric["value"]
        return key

    source = KEY_RE.sub(name_of, expr)
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        raise DocsError(f"check {expr!r}: not an expression") from None
    allowed = (ast.Expression, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Name, ast.Load, ast.Constant,
               ast.Call, ast.operator, ast.unaryop, ast.cmpop, ast.boolop)
    for node in ast.walk(tree):
        if not isinstance(node, allowed) or isinstance(node, ast.Call) and not (
                isinstance(node.func, ast.Name) and node.func.id in ("abs", "min", "max")) or \
                isinstance(node, ast.Name) and node.id not in values and node.id not in ("abs", "min", "max"):
            raise DocsError(f"check {expr!r}: only record keys, numbers, arithmetic, comparisons, abs/min/max")
    return bool(eval(compile(tree, "<check>", "eval"), {"__builtins__": {}, "abs": abs, "min": min, "max": max},
                     values))


def _check_checks(root: Path, text: str, file: str, cache: dict) -> list[Problem]:
    out = []
    for m in CHECK_RE.finditer(prose_mask(text)):
        line = _line_of(text, m.start())
        try:
            if not evaluate_check(root, m.group("expr"), cache):
                out.append(Problem(file, line, f"check {m.group('expr')!r} is false for the records: the text "
                                               f"{m.group('text').strip()!r} no longer holds"))
        except (DocsError, SpecbookError) as e:
            out.append(Problem(file, line, str(e)))
    return out


def doc_texts(root: Path) -> dict[str, str]:
    """{relative path: text} of every docs page, README.md and AGENTS.md."""
    return {p.relative_to(root).as_posix(): p.read_text() for p in [*doc_files(root), *extra_files(root)]}


def check_docs(root: Path | str) -> list[Problem]:
    """Every problem of the docs (and README.md), each with file and line; empty when the docs are true. A headline
    that is down without a word why in the docs is one (specbook.headlines)."""
    root = Path(root)
    problems = [Problem(*p) for p in headlines.problems(root, doc_texts(root))]
    stale = {v.profile for v in verify.index(root).values() if v.state == verify.STALE}
    problems += [Problem(pending.PATH.as_posix(), 0, m) for m in pending.problems(root, stale)]
    cache: dict = {}
    for path in [*doc_files(root), *extra_files(root)]:
        file = path.relative_to(root).as_posix()
        text = path.read_text()
        if path.parent != root:  # AGENTS.md and README.md are not site pages
            problems += _check_front_matter(text, file)
            problems += _check_front_matter_records(root, text, file)
        problems += _check_checks(root, text, file, cache)
        claims, bad = parse_claims(text, file)
        problems += bad
        for claim in claims:
            try:
                problems += check_claim(root, claim, cache)
            except SpecbookError as e:  # a malformed record file: still reported at the claim that needs it
                problems.append(Problem(claim.file, claim.line, str(e)))
        problems += _check_links(text, path, root, file)
        problems += _check_numbers(text, file)
    return sorted(set(problems), key=lambda p: (p.file, p.line, p.message))


# ---------------------------------------------------------------------------------------------- refresh


@dataclass(frozen=True)
class Edit:
    path: Path
    digest: str  # sha256 of the text the edit was computed from
    new_text: str


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def plan_refresh(root: Path | str, runbooks: Iterable[str] | None = None) -> list[Edit]:
    """Edits that bring claim literals in line with the records (claims without a record are left alone)."""
    root, only, cache = Path(root), set(runbooks) if runbooks is not None else None, {}
    edits = []
    for path in [*doc_files(root), *extra_files(root)]:
        text = path.read_text()
        new, shift = text, 0
        for claim in parse_claims(text, path.relative_to(root).as_posix())[0]:
            if only is not None and claim.runbook not in only:
                continue
            metric = claim_metric(root, claim, cache)
            if metric is None:
                continue
            literal = format_value(metric, claim.fmt)
            new = new[: claim.start + shift] + literal + new[claim.end + shift:]
            shift += len(literal) - len(claim.literal)
        if new != text:
            edits.append(Edit(path, _digest(text), new))
    return edits


def apply_edits(edits: list[Edit]) -> list[Path]:
    """Write the edits atomically; refuse (DocsError) a file whose text changed since the edit was planned."""
    for edit in edits:
        if _digest(edit.path.read_text()) != edit.digest:
            raise DocsError(f"{edit.path}: changed since it was read; not overwritten (run again)")
    for edit in edits:
        atomic_write(edit.path, edit.new_text.encode())
    return [e.path for e in edits]


def refresh_docs(root: Path | str, runbooks: Iterable[str] | None = None) -> list[Path]:
    """Rewrite claim literals from the records (only those of `runbooks` if given); returns the files written."""
    return apply_edits(plan_refresh(root, runbooks))
