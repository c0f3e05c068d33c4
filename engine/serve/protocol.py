"""The OpenAI request models: what a request may say, checked before anything runs (a bad field -> 422 with its
name), and the bodies of the answers (completion, chat completion, their stream chunks).

Unknown OpenAI fields are ignored, as other servers do. `seed` is a signed 64-bit integer (vLLM's range); text fields
must be valid Unicode: JSON can carry a lone surrogate ("\\ud800"), which no tokenizer can encode.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode: lone surrogate {text[e.start]!r} at position {e.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # SGLang/vLLM extension; 0 and -1 disable it
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # SGLang/vLLM extension: fixed-length outputs for benchmarks

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: Text | list[int] = Field(min_length=1)


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


# ------------------------------------------------------------------------------------------------ answers

def completion_body(rid: str, created: int, model: str, chat: bool, text: str, finish_reason: str,
                    meta_info: dict[str, Any], usage: dict[str, int]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "meta_info": meta_info}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice |= {"text": text, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage}


def chunk_choice(chat: bool, text: str, finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
    body = {"delta": {"content": text}} if chat else {"text": text, "logprobs": None}
    return {"index": 0, **body, "finish_reason": finish_reason, **extra}


def role_choice() -> dict[str, Any]:
    """A chat stream's first chunk announces the assistant's role."""
    return {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}


def chunk_body(rid: str, created: int, model: str, chat: bool, choices: list[dict[str, Any]],
               **extra: Any) -> dict[str, Any]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}
