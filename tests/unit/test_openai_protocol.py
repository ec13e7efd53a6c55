"""OpenAI request validation (field policy, error bodies naming the field) and response shapes
that the official ``openai`` client parses (serve/openai_protocol.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from serve.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                   from_validation_error)
from serve.openai_responses import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                    ChatCompletionChunk, ChatCompletionResponse, CompletionChoice,
                                    CompletionResponse, DeltaMessage, ModelCard, ModelList, Usage,
                                    sse)

MSG = [{"role": "user", "content": "hi"}]


def _error(cls, **body) -> APIError:
    with pytest.raises(ValidationError) as err:
        cls.model_validate(body)
    return from_validation_error(err.value)


def test_defaults_and_accepted_forms():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": MSG})
    assert (req.requested_max_tokens(), req.temperature, req.stream) == (None, None, False)
    assert req.stop_strings() == ()
    req = ChatCompletionRequest.model_validate({
        "model": "m", "stop": "###", "max_tokens": 9, "max_completion_tokens": 7,
        "stream": True, "stream_options": {"include_usage": True}, "user": "u1",
        "frequency_penalty": 0, "store": False, "metadata": {"k": "v"},
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "be "},
                                                       {"type": "text", "text": "brief"}]},
                     {"role": "user", "content": "hi", "name": "ann"}]})
    assert req.stop_strings() == ("###",) and req.requested_max_tokens() == 7 and req.include_usage
    assert req.template_messages() == [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "hi"}]
    comp = CompletionRequest.model_validate({"model": "m", "prompt": ["only one"]})
    assert comp.prompt == "only one"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]


@pytest.mark.parametrize("body, param, words", [
    ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"n": 3}, "n", "only n=1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", "not supported"),
    ({"tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "text"),
    ({"max_tokenz": 5}, "max_tokenz", "Unrecognized request argument supplied: max_tokenz"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "Input should be"),
    ({"messages": []}, "messages", "at least 1"),
])
def test_chat_validation_errors_name_the_field(body, param, words):
    err = _error(ChatCompletionRequest, **{"model": "m", "messages": MSG, **body})
    assert err.status == 400 and err.param == param and words in err.message, err.message
    payload = err.body()["error"]
    assert set(payload) == {"message", "type", "param", "code"}
    assert payload["type"] == "invalid_request_error"


def test_missing_fields_and_completion_only_options():
    assert _error(ChatCompletionRequest, model="m").param == "messages"
    assert _error(ChatCompletionRequest, messages=MSG).param == "model"
    assert _error(CompletionRequest, model="m").param == "prompt"
    assert _error(CompletionRequest, model="m", prompt=["a", "b"]).param == "prompt"
    for field, value in (("echo", True), ("logprobs", 21), ("best_of", 2), ("suffix", "x")):
        assert _error(CompletionRequest, model="m", prompt="p", **{field: value}).param == field


def test_status_maps_to_openai_error_types():
    assert APIError(429, "full", code="queue_full").body()["error"]["type"] == "rate_limit_error"
    assert APIError(503, "dead").body()["error"]["type"] == "service_unavailable"
    assert APIError(413, "long", param="max_tokens").body()["error"]["param"] == "max_tokens"


def test_responses_parse_with_the_official_client_types():
    types = pytest.importorskip("openai.types")
    chat_types = pytest.importorskip("openai.types.chat")
    usage = Usage.of(7, 3)
    assert usage.total_tokens == 10
    chat = ChatCompletionResponse(id="chatcmpl-1", created=1, model="m", usage=usage, choices=[
        ChatChoice(message=AssistantMessage(content="hey"), finish_reason="stop")])
    parsed = chat_types.ChatCompletion.model_validate(chat.model_dump())
    assert parsed.choices[0].message.content == "hey" and parsed.usage.completion_tokens == 3
    chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[
        ChatChunkChoice(delta=DeltaMessage(content="he"))])
    line = sse(chunk)
    assert line.startswith("data: ") and line.endswith("\n\n")
    parsed = chat_types.ChatCompletionChunk.model_validate(json.loads(line[6:]))
    assert parsed.choices[0].delta.content == "he" and parsed.object == "chat.completion.chunk"
    comp = CompletionResponse(id="cmpl-1", created=1, model="m", usage=usage,
                              choices=[CompletionChoice(text="x", finish_reason="length")])
    assert types.Completion.model_validate(comp.model_dump()).choices[0].finish_reason == "length"
    models = ModelList(data=[ModelCard(id="m", created=1)]).model_dump()
    assert types.Model.model_validate(models["data"][0]).id == "m"


@pytest.mark.parametrize("cls, base", [(ChatCompletionRequest, {"messages": MSG}),
                                       (CompletionRequest, {"prompt": "hi"})])
def test_null_optional_fields_mean_their_defaults_on_both_endpoints(cls, base):
    """Clients send null for "default" (the OpenAI API marks these fields nullable)."""
    nulls = {name: None for name, f in cls.model_fields.items()
             if not f.is_required() and name not in base}
    req = cls.model_validate({"model": "m", **base, **nulls})
    default = cls.model_validate({"model": "m", **base})
    assert req == default and req.stream is False and req.n == 1
    opts = cls.model_validate({"model": "m", **base, "stream": True,
                               "stream_options": {"include_usage": None}})
    assert opts.stream and not opts.include_usage
    assert _error(cls, model=None, **base).param == "model"  # required stays required


def test_vllm_sampling_fields_parse_and_are_checked():
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": MSG, "top_k": 20, "min_p": 0.05, "min_tokens": 3,
        "ignore_eos": True, "stop_token_ids": [7, 9]})
    assert (req.top_k, req.min_p, req.min_tokens, req.ignore_eos, req.stop_token_ids) == \
        (20, 0.05, 3, True, [7, 9])
    assert _error(ChatCompletionRequest, model="m", messages=MSG, top_k=-2).param == "top_k"
    assert _error(CompletionRequest, model="m", prompt="p", min_p=1.5).param == "min_p"
    assert _error(CompletionRequest, model="m", prompt="p", min_tokens=-1).param == "min_tokens"


def test_logprobs_requests_and_responses_parse_with_the_official_client_types():
    from openai.types import completion as completion_types
    from openai.types.chat import chat_completion as chat_types

    from serve.openai_responses import chat_logprobs, completion_logprobs
    from serve.engine.requests import TokenLogprob

    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "logprobs": True,
                                                 "top_logprobs": 2})
    assert chat.requested_logprobs() == 2
    assert ChatCompletionRequest.model_validate(
        {"model": "m", "messages": MSG}).requested_logprobs() is None
    err = _error(ChatCompletionRequest, model="m", messages=MSG, top_logprobs=2)
    assert err.param == "top_logprobs" and "logprobs: true" in err.message
    assert CompletionRequest.model_validate({"model": "m", "prompt": "p",
                                             "logprobs": 0}).requested_logprobs() == 0
    assert _error(CompletionRequest, model="m", prompt="p", logprobs=21).param == "logprobs"
    items = [TokenLogprob(5, -0.1, ((5, -0.1), (6, -2.5))), TokenLogprob(7, -1.0, ((8, -0.7),))]
    text = {5: "he", 6: "ha", 7: "llo", 8: "lp"}.__getitem__
    resp = ChatCompletionResponse(
        id="x", created=1, model="m", usage=Usage.of(1, 2),
        choices=[ChatChoice(message=AssistantMessage(content="hello"),
                            logprobs=chat_logprobs(items, text, lambda t: text(t).encode()),
                            finish_reason="stop")])
    parsed = chat_types.ChatCompletion.model_validate(resp.model_dump())
    content = parsed.choices[0].logprobs.content
    assert [c.token for c in content] == ["he", "llo"] and content[1].logprob == -1.0
    assert content[0].top_logprobs[1].token == "ha" and content[0].bytes == [104, 101]
    comp = CompletionResponse(id="x", created=1, model="m", usage=Usage.of(1, 2), choices=[
        CompletionChoice(text="hello", logprobs=completion_logprobs(items, text),
                         finish_reason="stop")])
    lp = completion_types.Completion.model_validate(comp.model_dump()).choices[0].logprobs
    assert lp.tokens == ["he", "llo"] and lp.text_offset == [0, 2]
    assert lp.top_logprobs[0] == {"he": -0.1, "ha": -2.5}
    assert lp.top_logprobs[1] == {"llo": -1.0, "lp": -0.7}  # the sampled token is always there


def test_logprobs_entries_keep_raw_bytes_and_every_alternative():
    """Chat: ``bytes`` come from the token-bytes function (not the UTF-8 of the text, which is
    U+FFFD for a piece of a character) and alternatives with equal texts stay separate entries;
    legacy completions key alternatives by text (vLLM's format), so those share a key holding the
    likelier logprob."""
    from serve.openai_responses import chat_logprobs, completion_logprobs
    from serve.engine.requests import TokenLogprob

    text = {1: "\ufffd", 2: "\ufffd", 3: "\ufffd", 4: "x"}.__getitem__
    raw = {1: b"\xe6\x97", 2: b"\xa5", 3: b"\x80", 4: b"x"}.__getitem__
    items = [TokenLogprob(1, -0.5, ((1, -0.5), (3, -1.5), (4, -2.0))),
             TokenLogprob(2, -0.1, ((2, -0.1), (4, -3.0)))]
    chat = chat_logprobs(items, text, raw).content
    assert b"".join(bytes(e.bytes) for e in chat) == "日".encode()
    assert [(e.token, e.bytes) for e in chat[0].top_logprobs] == [
        ("\ufffd", [0xE6, 0x97]), ("\ufffd", [0x80]), ("x", [ord("x")])]
    legacy = completion_logprobs(items, text)
    assert legacy.top_logprobs == [{"\ufffd": -0.5, "x": -2.0}, {"\ufffd": -0.1, "x": -3.0}]


@pytest.mark.parametrize("cls, base", [(ChatCompletionRequest, {"messages": MSG}),
                                       (CompletionRequest, {"prompt": "hi"})])
def test_numbers_are_int64_and_finite_in_every_field(cls, base):
    big = 2**63
    for field in ("max_tokens", "top_k", "min_tokens", "seed"):
        assert _error(cls, model="m", **base, **{field: big}).param == field
    assert _error(cls, model="m", **base, stop_token_ids=[1, big]).param == "stop_token_ids.1"
    for field in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty"):
        for value in (float("nan"), float("inf"), -float("inf")):
            err = _error(cls, model="m", **base, **{field: value})
            assert err.param == field and "finite" in err.message, err.message
    assert cls.model_validate({"model": "m", **base, "top_k": big - 1}).top_k == big - 1


@pytest.mark.parametrize("body, param", [
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": ["a\udfffb"]}, "prompt.0"),
    ({"prompt": "ok", "stop": ["x", "\ud800"]}, "stop.1"),
    ({"prompt": "ok", "user": "\ud800"}, "user"),
    ({"prompt": "ok", "metadata": {"\ud800": "v"}}, "metadata.\\ud800"),
    ({"prompt": "ok", "\ud800x": 1}, "\\ud800x"),
])
def test_text_that_is_not_unicode_is_an_error_naming_it(body, param):
    """Raised as the APIError itself (not a pydantic error): the param names the string, a field
    name written as its escape so that the error body can be sent."""
    with pytest.raises(APIError) as err:
        CompletionRequest.model_validate({"model": "m", **body})
    assert err.value.status == 400 and err.value.param == param
    json.dumps(err.value.body(), ensure_ascii=False).encode("utf-8")  # sendable
    with pytest.raises(APIError) as err:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]})
    assert err.value.param == "messages.0.content.0.text"
