"""Chat messages -> one prompt string: a checkpoint's Jinja chat template, rendered by transformers' sandboxed
renderer (what `apply_chat_template` runs: immutable sandbox, `raise_exception`, `strftime_now`, loop controls, a
`tojson` that does not HTML-escape), or, without a template, "<|role|>\\ncontent\\n" lines and "<|assistant|>\\n".
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import EngineError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # what apply_chat_template passes templates


def _tokenizer_config(target: str | None) -> dict[str, Any]:
    cfg = Path(target) / "tokenizer_config.json" if target else None
    if cfg is None or not cfg.is_file():
        return {}
    try:
        data = json.loads(cfg.read_text())
    except (ValueError, OSError) as e:
        raise EngineError(f"{cfg}: unreadable ({e})") from None
    return data if isinstance(data, dict) else {}


def load_chat_template(target: str | None) -> str | None:
    """A Jinja chat template shipped with a checkpoint (chat_template.jinja or tokenizer_config.json), if any."""
    if not target:
        return None
    if (Path(target) / "chat_template.jinja").is_file():
        return (Path(target) / "chat_template.jinja").read_text()
    tpl = _tokenizer_config(target).get("chat_template")
    return tpl if isinstance(tpl, str) else None


def load_special_tokens(target: str | None) -> dict[str, str]:
    """bos_token, eos_token, ... of tokenizer_config.json (strings or {"content": ...}): templates print them."""
    out = {}
    for name, value in _tokenizer_config(target).items():
        if name in SPECIAL_TOKENS:
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[name] = value
    return out


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    def render(self, messages: list[dict[str, str]]) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template([messages], chat_template=self.source, add_generation_prompt=True,
                                            **self.special_tokens)
        return rendered[0]


def compile_chat_template(source: str | None, special_tokens: dict[str, str] | None = None) -> ChatTemplate | None:
    """A checkpoint template, checked now so that one that does not compile fails at startup, not on every chat
    request; None: the built-in format."""
    if source is None:
        return None
    from jinja2 import TemplateSyntaxError

    template = ChatTemplate(source, dict(special_tokens or {}))
    try:
        template.render([])  # compiles (and caches) the template first
    except TemplateSyntaxError as e:
        raise EngineError(f"the chat template does not compile: {e}") from None
    except Exception:  # an empty conversation may well be refused by the template: only its syntax matters here
        pass
    return template


def render_chat(messages: list[dict[str, str]], template: ChatTemplate | None = None) -> str:
    if template is None:
        return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
    return template.render(messages)
