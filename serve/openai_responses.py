"""OpenAI-compatible response bodies of ``/v1/completions`` and ``/v1/chat/completions`` (full
responses, stream chunks, logprobs, usage, the model list) and the SSE framing (pydantic v2; no
Ray, no torch). Requests and errors: :mod:`serve.openai_protocol`.

Source: OpenAI API reference, "Completions" (legacy) and "Chat Completions" (the chat completion
object, the chunk object, streaming).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field


# ----------------------------------------------------------------------------------- responses
class Usage(BaseModel):
    """Token counts of one request: emitted tokens only (stop-trimmed, <= max_tokens)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


FinishReason = Literal["stop", "length"]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat ``choices[].logprobs``: one entry per emitted token."""

    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions ``choices[].logprobs``."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


def chat_logprobs(items, token_text, token_bytes) -> ChatLogprobs:
    """``items``: ``serve.engine.requests.TokenLogprob`` s; ``token_text``: id -> its text;
    ``token_bytes``: id -> its raw bytes (``serve.engine.detokenize.token_bytes``: a token holding
    part of a character has text U+FFFD but its own bytes, so the entries' bytes concatenate to the
    content's UTF-8). Every alternative is its own entry, two with the same text included."""
    def entry(tid: int, lp: float) -> dict:
        return {"token": token_text(tid), "logprob": lp, "bytes": list(token_bytes(tid))}

    return ChatLogprobs(content=[
        ChatTokenLogprob(**entry(it.token_id, it.logprob),
                         top_logprobs=[TopLogprob(**entry(t, lp)) for t, lp in it.top])
        for it in items])


def completion_logprobs(items, token_text, text_offset: int = 0) -> CompletionLogprobs:
    """Legacy form of the same; ``text_offset`` is where the first token's text starts.

    ``top_logprobs`` holds the sampled token and the k alternatives (OpenAI: "up to logprobs+1
    elements"), keyed by text as vLLM builds it: candidates with equal texts (pieces of different
    characters all read U+FFFD) share one key, so a dict may hold fewer; the legacy format has no
    room for both (chat's list has). The key keeps the likelier logprob (vLLM's dict keeps the
    one written last)."""
    out = CompletionLogprobs()
    for it in items:
        text = token_text(it.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(it.logprob)
        top: dict[str, float] = {text: it.logprob}
        for t, lp in it.top:
            key = token_text(t)
            top[key] = max(lp, top.get(key, lp))
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


def _omitted_when_none():
    """A field left out of the JSON when None, so clients that did not ask see the plain OpenAI
    object: ``spec_details`` (``serve.engine.metrics.request_spec_details``, for requests that
    set ``return_spec_details``) and vLLM's per-request ``metrics`` object,
    ``{"speculative_decoding": serve.engine.metrics.vllm_spec_decode_metrics}`` (when the
    deployment's ``per_request_spec_decode_metrics`` or ``return_spec_details`` asks; streamed on
    the usage chunk, as vLLM does)."""
    return Field(None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    """``text_completion`` object; also the streamed chunk (one delta of ``text`` per chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    spec_details: dict | None = _omitted_when_none()
    metrics: dict | None = _omitted_when_none()


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    spec_details: dict | None = _omitted_when_none()
    metrics: dict | None = _omitted_when_none()


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """``chat.completion.chunk``: the first carries ``delta.role``, then one per engine step with
    new text, then one with ``finish_reason``; with ``include_usage`` a last one with
    ``choices == []`` and ``usage``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    spec_details: dict | None = _omitted_when_none()
    metrics: dict | None = _omitted_when_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dspark-ray"
    root: str | None = Field(None, description="The target model behind the served name.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------------------------------- helpers
def new_id(prefix: str) -> str:
    """``cmpl-<hex>`` / ``chatcmpl-<hex>`` (OpenAI id shapes)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    """``created``: Unix time in whole seconds."""
    return int(time.time())


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event: ``data: <json>\\n\\n`` (None fields kept, as OpenAI sends them)."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"

    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
