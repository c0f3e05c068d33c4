"""Regenerate a conversation data set's answers with the target, through any OpenAI-compatible server (SGLang's at
scale): EAGLE drafters learn best from the target's own outputs.

Input and output are SpecForge's conversation JSONL, `{"id": ..., "conversations": [{"role", "content"}, ...]}`.
Every assistant turn is answered anew by the target, turn by turn, with the conversation so far (its own earlier
answers included) as context; other roles are kept. Rows are appended as they finish, so a run of days that stops
resumes where it was (`regenerate` skips ids already in the output); failed rows go to `<output>.errors.jsonl`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from engine.errors import EngineError

ROLES = ("system", "user", "assistant")


@dataclass
class RegenStats:
    written: int  # rows written by this call
    failed: int
    skipped: int  # already in the output (an earlier, interrupted run)

    @property
    def total(self) -> int:
        return self.written + self.skipped


def read_conversations(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` rows, checked: an id, and messages of known roles with at least one user turn."""
    rows: list[dict[str, Any]] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise EngineError(f"cannot read {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if limit is not None and len(rows) >= limit:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            msgs = row["conversations"]
            ok = isinstance(row["id"], (str, int)) and isinstance(msgs, list) and all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in msgs)
        except (json.JSONDecodeError, KeyError, TypeError):
            ok = False
        if not ok or not any(m["role"] == "user" for m in msgs):
            raise EngineError(f"{path}, line {n}: expected {{\"id\", \"conversations\": [{{\"role\": "
                              f"system|user|assistant, \"content\": str}}, ...]}} with a user turn")
        rows.append(row)
    if not rows:
        raise EngineError(f"no conversations in {path}")
    return rows


def _done_ids(path: Path) -> set[str]:
    """Ids already written; a last line cut by a crash is dropped so that appending starts on a fresh line."""
    if not path.exists():
        return set()
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        path.write_text(text, encoding="utf-8")
    return {str(json.loads(line)["id"]) for line in text.splitlines() if line.strip()}


async def _answer(client: httpx.AsyncClient, model: str, messages: list[dict[str, str]], max_tokens: int,
                  temperature: float) -> str:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    r = await client.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise EngineError(f"HTTP {r.status_code}: {r.text[:200]}")
    return r.json()["choices"][0]["message"]["content"] or ""


async def _regenerate_row(client: httpx.AsyncClient, model: str, row: dict[str, Any], max_tokens: int,
                          temperature: float) -> dict[str, Any]:
    out: list[dict[str, str]] = []
    for m in row["conversations"]:
        if m["role"] != "assistant":
            out.append({"role": m["role"], "content": m["content"]})
        elif out and out[-1]["role"] == "user":  # the source's answer to this turn: the target answers instead
            out.append({"role": "assistant", "content": await _answer(client, model, out, max_tokens, temperature)})
        else:  # an assistant turn that answers nothing (an opening line): kept as context
            out.append({"role": "assistant", "content": m["content"]})
    if out[-1]["role"] == "user":  # a last user turn the source left unanswered
        out.append({"role": "assistant", "content": await _answer(client, model, out, max_tokens, temperature)})
    return {"id": row["id"], "conversations": out}


async def _run(url: str, rows: list[dict[str, Any]], dst: Path, *, max_tokens: int, temperature: float,
               concurrency: int, model: str | None, timeout_s: float) -> tuple[int, int]:
    errors = dst.with_name(dst.name + ".errors.jsonl")
    written = failed = 0
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s,
                                 limits=httpx.Limits(max_connections=concurrency + 1)) as client:
        if model is None:
            r = await client.get("/v1/models")
            model = r.json()["data"][0]["id"] if r.status_code == 200 else "default"
        with open(dst, "a", encoding="utf-8") as out, open(errors, "a", encoding="utf-8") as err:
            async def one(row: dict[str, Any]) -> None:
                nonlocal written, failed
                async with gate:
                    try:
                        new = await _regenerate_row(client, model, row, max_tokens, temperature)
                    except (EngineError, httpx.HTTPError, KeyError, IndexError, ValueError) as e:
                        err.write(json.dumps({"id": row["id"], "error": f"{type(e).__name__}: {e}"}) + "\n")
                        failed += 1
                        return
                out.write(json.dumps(new, ensure_ascii=False) + "\n")
                out.flush()  # one complete line per finished row: a crash loses at most the rows in flight
                written += 1

            await asyncio.gather(*(one(r) for r in rows))
    return written, failed


def regenerate(url: str, src: str | Path, dst: str | Path, *, limit: int | None = None, max_tokens: int = 2048,
               temperature: float = 0.0, concurrency: int = 64, model: str | None = None,
               timeout_s: float = 1800.0) -> RegenStats:
    """Regenerate the first `limit` conversations of `src` into `dst` (appending; ids already there are skipped)."""
    if concurrency < 1 or max_tokens < 1:
        raise EngineError("need concurrency >= 1 and max_tokens >= 1")
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    rows = read_conversations(src, limit)
    done = _done_ids(dst)
    todo = [r for r in rows if str(r["id"]) not in done]
    coro = _run(url, todo, dst, max_tokens=max_tokens, temperature=temperature, concurrency=concurrency,
                model=model, timeout_s=timeout_s)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        written, failed = asyncio.run(coro)
    else:  # a Jupyter kernel runs a loop already
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            written, failed = pool.submit(asyncio.run, coro).result()
    return RegenStats(written=written, failed=failed, skipped=len(rows) - len(todo))
