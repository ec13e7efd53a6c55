"""The OpenAI routes of ``serve/app.py`` in-process (issue 24, item 4: what real clients hit): the
FastAPI app over ASGI with a replica built around an engine here, no Ray. The target is a bigram
model whose greedy text is a known cycle of tokens with the real SmolLM2 tokenizer, so stop
strings, min_tokens and logprobs bytes have exact expectations on both endpoints, streamed or not.
Bad input of every kind is a 4xx OpenAI error object naming the field, never a 500 or FastAPI's
``{"detail": ...}``."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

MODEL = "bigram"
# The target's greedy text after the prompt: this cycle, over and over. Every token is distinct (a
# bigram model has one successor per token); the CJK and the emoji are split inside characters.
CYCLE_TEXT = " one two three four 日本語 😀 five six"
PROMPT = "Count:"
MESSAGES = [{"role": "user", "content": "Count"}]
FFFD = "\ufffd"


@torch.no_grad()
def bigram_target(successor: dict[int, int], ties: dict[int, list[int]], vocab_size: int):
    """A Qwen3 whose next token depends on the current token alone: attention and MLP outputs are
    zero, so the last hidden state is the normed embedding h(a) of the current token, and the LM
    head row of successor[a] holds 10 h(a) / |h(a)|^2 (logit 10; other rows score about
    10 cos(h(a), h(b)), far below). ``ties[a]``: tokens scored 5 after a (ranks 2, 3, ...)."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                      eos_token_id=1, pad_token_id=0, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg).eval()
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    h = model.model.norm(model.model.embed_tokens.weight)
    unit = h / (h * h).sum(-1, keepdim=True)
    head = torch.zeros(vocab_size, cfg.hidden_size)
    for a, b in successor.items():
        head[b] += 10 * unit[a]
    for a, tied in ties.items():
        for t in tied:
            head[t] += 5 * unit[a]
    model.lm_head.weight.copy_(head)
    return model.requires_grad_(False)


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def cycle(tok):
    ids = tok.encode(CYCLE_TEXT, add_special_tokens=False)
    assert len(set(ids)) == len(ids)
    return ids


@pytest.fixture(scope="module")
def tied(tok, cycle):
    """Three single-byte tokens (0x81-0x83): distinct candidates whose text alone is U+FFFD."""
    ids = [tok.convert_tokens_to_ids(c) for c in "ģĤĥ"]
    assert all(tok.decode([t]) == FFFD for t in ids) and not set(ids) & set(cycle)
    return ids


def _replica_dependency(api):
    """The dependency Ray Serve put on the routes' ``self`` (nested routers walked: FastAPI keeps
    included ones apart)."""
    routers = [api.router]
    while routers:
        for route in routers.pop().routes:
            if hasattr(route, "original_router"):
                routers.append(route.original_router)
            elif "self" in inspect.signature(getattr(route, "endpoint", lambda: None)).parameters:
                return inspect.signature(route.endpoint).parameters["self"].default.dependency
    raise AssertionError("no class-based route in serve.app.api")


@pytest.fixture(scope="module")
def client(tok, cycle, tied):
    """A TestClient over ``serve.app.api`` whose routes are served by a ``SpecServer`` built here
    (Ray Serve's class-based view injects the replica through one dependency: overridden)."""
    from starlette.testclient import TestClient

    from serve import app as serve_app
    from serve.engine.chat import render_prompt_ids
    from serve.engine.config import EngineConfig
    from serve.engine.core import SpecEngine
    from serve.engine.target_runner import TargetRunner

    starts = {tok.encode(PROMPT)[-1], render_prompt_ids(tok, MESSAGES, {})[-1]}
    assert not starts & set(cycle)
    successor = dict(zip(cycle, cycle[1:] + cycle[:1])) | {s: cycle[0] for s in starts}
    target = bigram_target(successor, {cycle[0]: tied}, len(tok))
    engine = SpecEngine(TargetRunner(target, [0]), None, [tok.eos_token_id],
                        EngineConfig(scheduler="none", sps_profile="off"), tok)
    server_cls = serve_app.SpecServer.func_or_class.__mro__[1]  # under Serve's ingress wrapper
    server = server_cls({"target": MODEL, "served_model_name": MODEL, "num_threads": 1,
                         "metrics_interval_s": 3600}, engine=engine)
    replica = _replica_dependency(serve_app.api)
    serve_app.api.dependency_overrides[replica] = lambda: server
    try:
        with TestClient(serve_app.api, raise_server_exceptions=False) as c:
            yield c
    finally:
        serve_app.api.dependency_overrides.pop(replica, None)
        server.engine.shutdown()


def _post(client, chat: bool, body: dict, stream: bool = False):
    """(text, finish_reason, completion_tokens, logprobs entries) of one request."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "temperature": 0, **body,
            **({"messages": MESSAGES} if chat else {"prompt": PROMPT})}
    if not stream:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        lp = choice["logprobs"]
        return (text, choice["finish_reason"], r.json()["usage"]["completion_tokens"],
                (lp["content"] if chat else lp) if lp else None)
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices)
    finish = [c["finish_reason"] for c in choices if c["finish_reason"]]
    assert len(finish) == 1
    entries = None
    if chat and any(c["logprobs"] for c in choices):
        entries = [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
    return text, finish[0], chunks[-1]["usage"]["completion_tokens"], entries


# ----------------------------------------------------------------------- min_tokens and stops
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_min_tokens_holds_off_stop_strings_too(client, chat, stream):
    """vLLM: no stop string ends the output within the first min_tokens tokens (EOS and stop ids
    are masked there already); the first one completing after them does; max_tokens still wins."""
    text, finish, n, _ = _post(client, chat, {"max_tokens": 7}, stream)
    assert (text, finish, n) == (" one two three four 日", "length", 7)
    # " " starts every token's text: without min_tokens the first token stops the output
    assert _post(client, chat, {"max_tokens": 6, "stop": [" "]}, stream) == ("", "stop", 1, None)
    # with it, the tokens up to min_tokens are output and the next space ends it (kept: 3 tokens)
    assert _post(client, chat, {"max_tokens": 6, "stop": [" "], "min_tokens": 2},
                 stream) == (" one two", "stop", 3, None)
    # a stop string completed within min_tokens is plain output, held back text included
    assert _post(client, chat, {"max_tokens": 4, "stop": ["two t", "zzz"], "min_tokens": 4},
                 stream) == (" one two three four", "length", 4, None)
    assert _post(client, chat, {"max_tokens": 3, "stop": [" "], "min_tokens": 3},
                 stream) == (" one two three", "length", 3, None)


# ---------------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_logprobs_bytes_are_raw_and_top_logprobs_hold_k_entries(client, cycle, stream):
    """OpenAI's contract: ``bytes`` are the token's own bytes (tokens inside one character do not
    each read as U+FFFD's), so they concatenate to the content's UTF-8; ``top_logprobs: k`` gives
    k entries even where distinct candidates have the same text."""
    n = len(cycle)
    text, _, used, entries = _post(client, True, {"max_tokens": n, "logprobs": True,
                                                  "top_logprobs": 5}, stream)
    assert text == CYCLE_TEXT and used == n and len(entries) == n
    assert b"".join(bytes(e["bytes"]) for e in entries) == CYCLE_TEXT.encode()
    assert all(len(e["top_logprobs"]) == 5 for e in entries)
    # after " one": " two", then the three tied single-byte tokens, all reading U+FFFD
    second = entries[1]["top_logprobs"]
    assert second[0]["token"] == " two" and second[0]["logprob"] == entries[1]["logprob"]
    ties = second[1:4]
    assert [e["token"] for e in ties] == [FFFD] * 3
    assert sorted(e["bytes"] for e in ties) == [[0x81], [0x82], [0x83]]


def test_completion_logprobs_carry_the_sampled_token_and_key_by_text(client):
    """Legacy ``logprobs: k``: up to k + 1 entries per token, the sampled one always among them;
    keyed by text (vLLM's format), so the three U+FFFD candidates share one key."""
    _, _, n, lp = _post(client, False, {"max_tokens": 6, "logprobs": 5})
    assert len(lp["tokens"]) == n == 6
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == logprob and len(top) <= 6
    assert set(lp["top_logprobs"][1]) >= {" two", FFFD}
    _, _, _, lp0 = _post(client, False, {"max_tokens": 2, "logprobs": 0})
    assert lp0["top_logprobs"] == [{t: v} for t, v in zip(lp0["tokens"], lp0["token_logprobs"])]


# ------------------------------------------------------------------------------- bad numbers
def _raw_post(client, chat: bool, field: str, raw: str, extra: dict | None = None):
    """POST a valid body whose ``field`` holds ``raw`` JSON text as is (NaN, 1e309, 2**64...)."""
    body = {"model": MODEL, "max_tokens": 2, **({"messages": MESSAGES} if chat else
                                                 {"prompt": PROMPT}), **(extra or {}),
            field: "__RAW__"}
    content = json.dumps(body).replace('"__RAW__"', raw)
    return client.post("/v1/chat/completions" if chat else "/v1/completions", content=content,
                       headers={"content-type": "application/json"})


def _assert_openai_error(r, status: int | tuple, param: str | None):
    assert r.status_code in ((status,) if isinstance(status, int) else status), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err


BIG, HUGE = str(2**63), str(2**64 + 1)
NUMBERS = [  # (field, raw JSON value, extra fields, expected param)
    *[("top_k", v, {}, "top_k") for v in (BIG, HUGE, "-2", "1e309", "1.5")],
    *[("max_tokens", v, {}, "max_tokens") for v in (BIG, HUGE, "0", "-1", "1e309", "NaN")],
    *[("min_tokens", v, {}, "min_tokens") for v in (BIG, "-1", "3", "Infinity")],
    *[("seed", v, {}, "seed") for v in (BIG, str(-2**63 - 1), "1e309", "-Infinity")],
    *[("n", v, {}, "n") for v in (BIG, "0", "-1")],
    *[("stop_token_ids", f"[{v}]", {}, "stop_token_ids.0") for v in (BIG, "-1")],
    *[(f, v, {}, f) for f in ("temperature", "top_p", "min_p", "frequency_penalty",
                              "presence_penalty")
      for v in ("NaN", "Infinity", "-Infinity", "1e309")],
]


@pytest.mark.parametrize("field, raw, extra, param", NUMBERS,
                         ids=[f"{f}={v}" for f, v, _, _ in NUMBERS])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_numbers_out_of_range_are_400_naming_the_field(client, chat, field, raw, extra, param):
    err = _assert_openai_error(_raw_post(client, chat, field, raw, extra), 400, param)
    assert param in err["message"]


@pytest.mark.parametrize("chat, field, raw, extra, param", [
    (False, "logprobs", BIG, {}, "logprobs"),
    (False, "logprobs", "-1", {}, "logprobs"),
    (False, "prompt", f"[{BIG}]", {}, "prompt"),
    (False, "prompt", "[-1]", {}, "prompt"),
    (False, "best_of", BIG, {}, "best_of"),
    (True, "top_logprobs", BIG, {"logprobs": True}, "top_logprobs"),
    (True, "top_logprobs", "-1", {"logprobs": True}, "top_logprobs"),
    (True, "max_completion_tokens", BIG, {}, "max_completion_tokens"),
    (True, "max_completion_tokens", "1e309", {}, "max_completion_tokens"),
])
def test_endpoint_numbers_out_of_range_are_400_naming_the_field(client, chat, field, raw, extra,
                                                                 param):
    _assert_openai_error(_raw_post(client, chat, field, raw, extra), 400, param)


def test_a_top_k_beyond_the_vocabulary_keeps_every_token(client, tok):
    """vLLM's reading: a top_k the vocabulary cannot fill is no limit (its input batch clamps it to
    the vocabulary), up to int64; the output equals the unlimited one's for the same seed."""
    plain = _post(client, False, {"max_tokens": 5, "temperature": 1.0, "seed": 7})
    for k in (len(tok), len(tok) + 1, 2**63 - 1):
        assert _post(client, False, {"max_tokens": 5, "temperature": 1.0, "seed": 7,
                                     "top_k": k}) == plain


def test_the_engine_reads_any_top_k_beyond_the_vocabulary_as_no_limit():
    """Below HTTP too (evaluation and calibration call the engine directly): 2**63 failed the
    request in prefill (int64 overflow). A seed beyond int64 is refused naming it."""
    from serve.engine.config import EngineConfig
    from serve.engine.core import SpecEngine
    from serve.engine.errors import RequestError
    from serve.engine.requests import EngineRequest, SamplingParams
    from serve.engine.target_runner import TargetRunner
    from tests.unit.helpers import permuted_target

    engine = SpecEngine(TargetRunner(permuted_target(), [1, 3]), None, [],
                        EngineConfig(scheduler="none", sps_profile="off"))
    outs = [engine.generate([EngineRequest(f"k{k}", [5, 17, 33], SamplingParams(
        8, 1.0, seed=3, top_k=k))])[0].tokens for k in (0, 96, 97, 2**63, 2**70)]
    assert all(o == outs[0] for o in outs)
    for seed in (2**63, -2**63 - 1):
        with pytest.raises(RequestError, match="seed") as err:
            engine.add_request(EngineRequest("s", [1], SamplingParams(4, seed=seed)))
        assert err.value.field == "seed"


# --------------------------------------------------------------------------------- bad text
SURROGATE = "\ud800"
TEXTS = [  # (endpoint is chat, body fields, expected param)
    (False, {"prompt": SURROGATE}, "prompt"),
    (False, {"prompt": [f"ok {SURROGATE}"]}, "prompt.0"),
    (False, {"prompt": "ok", "stop": SURROGATE}, "stop"),
    (False, {"prompt": "ok", "stop": ["fine", "\udfff"]}, "stop.1"),
    (False, {"prompt": "ok", "model": SURROGATE}, "model"),
    (False, {"prompt": "ok", "user": SURROGATE}, "user"),
    (False, {"prompt": "ok", "suffix": SURROGATE}, "suffix"),
    (False, {"prompt": "ok", "metadata": {"k": SURROGATE}}, "metadata.k"),
    (False, {"prompt": "ok", "metadata": {SURROGATE: "v"}}, "metadata.\\ud800"),
    (False, {"prompt": "ok", SURROGATE: 1}, "\\ud800"),
    (True, {"messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content"),
    (True, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": SURROGATE}]}]},
     "messages.0.content.1.text"),
    (True, {"messages": [{"role": "user", "content": "hi", "name": SURROGATE}]},
     "messages.0.name"),
    (True, {"messages": MESSAGES, "stop": [SURROGATE]}, "stop.0"),
    (True, {"messages": MESSAGES, "tool_choice": SURROGATE}, "tool_choice"),
    (True, {"messages": MESSAGES, "response_format": {"type": SURROGATE}}, "response_format.type"),
]


@pytest.mark.parametrize("chat, fields, param", TEXTS, ids=[p for _, _, p in TEXTS])
def test_text_that_is_not_unicode_is_400_naming_the_field(client, chat, fields, param):
    """JSON's ``\\ud800`` escape parses to a lone surrogate, which no tokenizer or UTF-8 response
    can carry: a 400 naming the string (a field name written as its escape), whatever the field."""
    body = {"model": MODEL, "max_tokens": 2, **fields}
    r = client.post("/v1/chat/completions" if chat else "/v1/completions",
                    content=json.dumps(body), headers={"content-type": "application/json"})
    err = _assert_openai_error(r, 400, param)
    assert "lone surrogate" in err["message"]


# --------------------------------------------------------------------------------- bad bodies
@pytest.mark.parametrize("content", [
    b'{"model": "bigram", "prompt": "caf\xe9", "max_tokens": 2}',  # Latin-1, not UTF-8
    b'{"model": "bigram", "prompt": "\xff\xfe", "max_tokens": 2}',
    b"{not json",
    b'{"model": "bigram", "prompt": "x", "max_tokens": 2',
    b"[" * 100_000,  # deeper than the JSON parser recurses
    b'{"model": "bigram", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # > 4300 digits
], ids=["latin1", "bad-bytes", "not-json", "truncated", "too-deep", "too-many-digits"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_bodies_that_are_not_utf8_json_are_openai_400s(client, chat, content):
    r = client.post("/v1/chat/completions" if chat else "/v1/completions", content=content,
                    headers={"content-type": "application/json"})
    err = _assert_openai_error(r, 400, None)
    assert "JSON" in err["message"]


def test_unknown_routes_and_methods_are_openai_errors(client):
    _assert_openai_error(client.post("/v1/nothing", json={}), 404, None)
    r = client.get("/v1/completions")
    assert _assert_openai_error(r, 405, None) and "POST" in r.headers["allow"]

