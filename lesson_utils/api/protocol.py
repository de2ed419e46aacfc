"""The OpenAI API's request and response shapes, as far as the course's engine serves them, and its error shape.

A request the engine cannot serve as asked is refused by name before anything is queued: an unknown model, a field
the server does not implement (``top_p`` other than 1, ``logprobs``, ...), ``max_tokens`` or ``n`` out of range, a
negative temperature. Each refusal is an :class:`APIError` with OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` body and a 4xx status.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 8
MAX_TEMPERATURE = 2.0
# fields OpenAI clients may send that this server accepts only at their neutral value (anything else: a 400 naming it)
NEUTRAL = {
    "top_p": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "logprobs": None,
    "top_logprobs": None,
    "logit_bias": None,
    "echo": False,
    "best_of": None,
    "suffix": None,
    "tools": None,
    "tool_choice": None,
    "response_format": None,
}


@dataclass
class APIError(Exception):
    """A refused request: its HTTP status and OpenAI's error body."""

    status: int
    message: str
    param: str | None = None
    type: str = "invalid_request_error"
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are refused by name below, not as a schema error

    model: str
    max_tokens: int | None = None
    n: int = 1
    temperature: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    cache_salt: str | None = None  # vLLM's extension: prefix-cache blocks shared only under the same salt (a tenant)
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    logit_bias: dict | None = None


class CompletionRequest(_Common):
    prompt: str | list[int]
    max_tokens: int | None = 16
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None


def check_request(req: _Common, served_model: str) -> None:
    """Refuse what the engine cannot do as asked, naming the field (nothing has been queued yet)."""
    if req.model != served_model:
        raise APIError(
            404,
            f"the model `{req.model}` does not exist here; this server serves `{served_model}`",
            "model",
            code="model_not_found",
        )
    unknown = sorted(set(req.model_extra or {}))
    if unknown:
        raise APIError(400, f"unsupported parameter(s): {', '.join(unknown)}", unknown[0], code="unsupported_parameter")
    for name, neutral in NEUTRAL.items():
        value = getattr(req, name, neutral)
        if value is not None and value != neutral and not (name == "logprobs" and value is False):
            raise APIError(
                400, f"`{name}` is not supported by this server (only {neutral!r})", name, code="unsupported_parameter"
            )
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"`n` must be between 1 and {MAX_N}, got {req.n}", "n")
    if not 0 <= req.temperature <= MAX_TEMPERATURE:
        raise APIError(
            400, f"`temperature` must be between 0 and {MAX_TEMPERATURE}, got {req.temperature}", "temperature"
        )
    tokens = max_tokens_of(req)
    if tokens is not None and tokens < 1:
        field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        raise APIError(400, f"`{field}` must be at least 1, got {tokens}", field)
    for s in stops_of(req):
        if not s:
            raise APIError(400, "an empty stop string would end every answer at once", "stop")
    if req.cache_salt is not None and not req.cache_salt:
        raise APIError(400, "`cache_salt` is a non-empty string (one per tenant)", "cache_salt")


def max_tokens_of(req: _Common) -> int | None:
    """``max_completion_tokens`` (the chat API's newer name) when given, else ``max_tokens``; None: as many as fit."""
    newer = getattr(req, "max_completion_tokens", None)
    return req.max_tokens if newer is None else newer


def stops_of(req: _Common) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(rid: str, model: str, choices: list[dict], use: dict | None, chat: bool, chunk: bool) -> dict:
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if use is not None or not chunk:
        body["usage"] = use
    return body
