"""OpenAI-compatible request and error models for ``/v1/completions`` and
``/v1/chat/completions`` (pydantic v2; no Ray, no torch); the response bodies are
:mod:`serve.openai_responses`.

Source: OpenAI API reference, "Completions" (legacy) and "Chat Completions" (create, the chat
completion object, the chunk object, streaming) and "Error codes"; vLLM's
``entrypoints/openai/protocol.py`` for the shape of a self-hosted server.

Field policy (checked against the official ``openai`` Python client 3.57, which sends only the
arguments the caller passes, no extra fields by default):

* supported: ``model``, ``prompt`` / ``messages``, ``max_tokens`` (chat also
  ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
  ``stream_options.include_usage``, ``n`` (only 1), ``user``, and vLLM's extra sampling fields
  ``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids`` (all lossless under
  speculative decoding: they shape the target's distribution, which verification samples from);
* ``null`` in any optional field means its default (the OpenAI API marks them nullable);
* accepted and ignored (no effect on decoding): ``store``, ``metadata``, ``service_tier``,
  ``prompt_cache_key``, ``safety_identifier``, ``parallel_tool_calls``;
* ``logprobs`` (completions: 0-20 alternatives; chat: ``logprobs`` + ``top_logprobs`` 0-20): the
  target's log probabilities of the emitted tokens, from the verification pass (raw model
  distribution, as vLLM's default);
* accepted only at their neutral value, else 400 naming the field: ``frequency_penalty``,
  ``presence_penalty`` (0), ``logit_bias`` (empty), ``echo`` / ``suffix`` / ``best_of``,
  ``tools`` (empty) / ``tool_choice`` ("none"), ``response_format`` (``{"type": "text"}``);
* anything else: 400 ``Unrecognized request argument supplied: <field>`` (the message the OpenAI
  API itself answers with), so a typo such as ``max_token`` never silently falls back to a
  default.

Errors are ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status of
:class:`APIError`. Usage counts only emitted tokens (SPEC section 8): ``completion_tokens`` is the
engine's ``num_generated_tokens`` after stop trimming, never more than ``max_tokens``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from .engine.errors import EngineDeadError, RequestError
from .engine.requests import INT64_MAX, INT64_MIN

MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's chat limit; serve.engine.requests.MAX_LOGPROBS)
MAX_STOP_STRINGS = 4  # OpenAI: "Up to 4 sequences where the API will stop generating"

# HTTP status -> OpenAI error "type"
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable"}


# ------------------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered as an OpenAI JSON error body.

    Args:
        status: HTTP status (400 bad request, 404 unknown model, 413 prompt + max_tokens beyond
            the model length, 429 engine queue full, 503 engine dead).
        message: human-readable cause, naming the offending field.
        param: the request field at fault (dotted path), or None.
        code: machine-readable code (``model_not_found``, ``context_length_exceeded``,
            ``queue_full``, ``engine_dead``, ``invalid_value``).
        type: OpenAI error type; default from the status (:data:`ERROR_TYPES`).
        headers: extra response headers (``Retry-After`` on 429).
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None,  # noqa: A002 (OpenAI name)
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "server_error" if status >= 500
                                            else "invalid_request_error")

    def body(self) -> dict:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _loc_to_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def _surrogate_at(text: str) -> int | None:
    """Index of the first lone surrogate in ``text``, else None: the only characters a Python
    string can hold that UTF-8 cannot encode (JSON's ``"\\ud800"`` escape decodes to one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def invalid_text_error(body: Any) -> APIError | None:
    """A 400 naming the first string of a parsed JSON body, a value or a field name at any depth,
    that is not valid Unicode; None when every string is. No tokenizer, chat template or UTF-8
    response can carry such text, and an error message that echoes it cannot even be sent, so it
    is refused before anything reads it. Iterative: the depth is the JSON parser's, not ours."""
    def error(path: tuple, what: str, text: str, i: int) -> APIError:
        # the param itself must be sendable: a surrogate in a field name written as its escape
        param = ".".join(str(p).encode("utf-8", "backslashreplace").decode("utf-8")
                         for p in path) or None
        return APIError(400, f"{param or 'request body'}: {what} is not valid Unicode (a lone "
                        f"surrogate, U+{ord(text[i]):04X}, at character {i})", param=param,
                        code="invalid_value")

    stack: list[tuple[tuple, Any]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key in value:
                if isinstance(key, str) and (i := _surrogate_at(key)) is not None:
                    return error(path + (key,), "the field name", key, i)
            stack.extend(reversed([(path + (k,), v) for k, v in value.items()]))
        elif isinstance(value, list):
            stack.extend(reversed([(path + (n,), v) for n, v in enumerate(value)]))
        elif isinstance(value, str) and (i := _surrogate_at(value)) is not None:
            return error(path, "text", value, i)
    return None


def validation_error(errors: list[dict]) -> APIError:
    """Map pydantic / FastAPI validation errors to one 400 :class:`APIError` naming the first
    offending field (all problems are listed in the message)."""
    messages, first_param = [], None
    for err in errors:
        param = _loc_to_param(tuple(err.get("loc", ())))
        kind = err.get("type", "")
        if kind == "extra_forbidden":
            msg = f"Unrecognized request argument supplied: {param}"
        elif kind == "json_invalid":
            where = err.get("loc", ())[-1:]
            msg = (f"request body is not valid JSON: {err.get('ctx', {}).get('error', '')}"
                   + (f" (at character {where[0]})" if where and where[0] != "body" else ""))
            param = None
        else:
            text = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            msg = f"{param}: {text}" if param else text
        if first_param is None:
            first_param = param
        messages.append(msg)
    return APIError(400, "; ".join(messages) or "invalid request", param=first_param,
                    code="invalid_value")


def from_validation_error(err: ValidationError) -> APIError:
    return validation_error(err.errors())


def request_error(err: RequestError, chat: bool) -> APIError:
    """Map an engine :class:`RequestError` to its OpenAI error (status kept)."""
    param = err.field
    if param == "prompt" and chat:
        param = "messages"
    code = {413: "context_length_exceeded", 429: "queue_full",
            500: "request_failed"}.get(err.status, "invalid_value")
    headers = {"Retry-After": "1"} if err.status == 429 else None
    return APIError(err.status, str(err), param=param, code=code, headers=headers)


def dead_error(err: EngineDeadError) -> APIError:
    """The 503 an engine that died answers with."""
    return APIError(503, f"the engine is dead: {err}", code="engine_dead")


# ------------------------------------------------------------------------------------ requests
class _NullMeansDefault(BaseModel):
    """The OpenAI API marks optional request fields nullable and clients send ``null`` for "use
    the default": an explicit null of an optional field is read as the field left out. A required
    field stays required (``"model": null`` is still a 400 naming it)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and not fields[k].is_required())}


class StreamOptions(_NullMeansDefault):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, description="Send a last chunk with usage (tokens) and "
                                "no choices before ``data: [DONE]``.")


class _SamplingFields(_NullMeansDefault):
    """Fields shared by both endpoints (OpenAI semantics, defaults filled by the server).

    Integers are int64 (the width vLLM and torch give them; a larger JSON number is a 400 naming
    its field, never an overflow deeper down); NaN and infinities (JSON parsers accept ``NaN``,
    ``Infinity`` and ``1e309``) are refused in every number field."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(description="Served model name (GET /v1/models).")
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX, description="Cap on generated "
                                   "tokens; None = the server's default_max_tokens, clipped to "
                                   "the model length.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; default 1.0.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus mass; default 1.0.")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="Seeds the request's "
                             "own RNG (reproducible sampling on the same server build).")
    stop: str | list[str] | None = Field(None, description="Up to 4 strings that end the output "
                                         "(not included).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, description="Choices per request; only 1 is supported.")
    user: str | None = Field(None, max_length=256, description="End-user id (metrics tag).")
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX, description="Keep the k most likely "
                              "tokens; -1 or 0 = all (default), as does a k at or above the "
                              "vocabulary size (vLLM).")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Drop tokens below min_p times "
                                "the most likely token's probability; default 0.")
    min_tokens: int | None = Field(None, ge=0, le=INT64_MAX, description="EOS, stop_token_ids "
                                   "and stop strings cannot end the output before this many "
                                   "tokens (vLLM); default 0.")
    ignore_eos: bool | None = Field(None, description="Keep generating after EOS; default false.")
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = Field(
        None, max_length=64, description="Token ids that end the output (included).")
    min_tokens_per_s: float | None = Field(None, gt=0, le=1e9, description="This request's "
                                           "per-user speed floor in tokens/s (verification goes "
                                           "to requests below their floor first); default: the "
                                           "engine's min_tokens_per_s.")
    # this server's extension (SGLang returns the like in its meta_info)
    return_spec_details: bool | None = Field(None, description="Add `spec_details`, the "
                                             "request's speculation summary, to the response (the "
                                             "final chunk when streaming), and vLLM's "
                                             "`metrics.speculative_decoding` (the usage chunk "
                                             "when streaming); default false.")
    # accepted only at their neutral values
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # accepted and ignored
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """Raised as :class:`APIError` rather than a pydantic error: it names the string at
        fault, a field name included, which a pydantic error location cannot."""
        err = invalid_text_error(data) if isinstance(data, dict) else None
        if err is not None:
            raise err
        return data

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v not in (None, 0, 0.0):
            raise ValueError("penalties are not supported by this server (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by this server")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """Alternatives per emitted token to return log probabilities for; None = no logprobs."""
        return None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body: one prompt (text, or token ids), one choice."""

    prompt: str | list[str] | list[int] = Field(description="Text, a one-element list of text, "
                                                "or token ids.")
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError(f"only one prompt per request is supported, got {len(v)}")
            return v[0]
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported by this server")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, v):
        if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {v}")
        return v

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported by this server")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v):
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of ``messages``. ``developer`` is rendered as ``system`` (OpenAI's rename);
    content may be a string or a list of text parts (joined); ``name`` is accepted and dropped."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {"role": "system" if self.role == "developer" else self.role,
                "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body: rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX, description="Newer name "
                                              "of max_tokens; wins when both are given.")
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_range(cls, v, info: ValidationInfo):
        if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {v}")
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tools are not supported by this server")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v):
        if v not in (None, "none", "auto"):
            raise ValueError("tool_choice is not supported by this server (only 'none' or 'auto')")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v is not None and v.get("type") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]
