"""The Ray Serve app over HTTP on a local Ray, with a tiny random Qwen3 target (SmolLM2's
tokenizer and chat template) and a tiny DSpark drafter: the official ``openai`` client streams,
greedy output is token-identical to target-only greedy decoding (SPEC 5), usage counts emitted
tokens only (SPEC 8), validation / overload / unknown-model errors are OpenAI JSON bodies, and a
client that disconnects frees its engine slot. The first tests drive :class:`AsyncSpecEngine`
in-process (no Ray): cancellation aborts, a failing step kills the engine loudly."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time

import httpx
import pytest
import torch

from tests.tiny import tiny_drafter

pytestmark = [pytest.mark.slow, pytest.mark.ray]

MODEL = "tiny-dspark"
TEMPLATE_KWARGS = {"enable_thinking": False}
MESSAGES = [{"role": "user", "content": "What is 2 plus 3? Answer briefly."}]


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """One intra-op thread: tiny models are fastest so, and OpenMP spinning on a shared 2-core
    machine makes a 2-thread reference decode ~50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    from serve.engine.target_loading import load_target

    return load_target(str(tiny_target_dir), "float32")


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    from serve.engine.target_loading import load_tokenizer

    return load_tokenizer(str(tiny_target_dir))


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, tiny_target, tiny_target_dir):
    out = tmp_path_factory.mktemp("tiny_drafter")
    drafter = tiny_drafter(tiny_target, layer_ids=(1, 3), block_size=4)
    drafter.config.target_name_or_path = str(tiny_target_dir)  # trained "for" this target
    drafter.save_pretrained(out)
    return out


def greedy_reference(model, prompt_ids: list[int], max_tokens: int, eos: int) -> list[int]:
    """Target-only greedy decoding, full recompute per token (no cache, no engine), fp32."""
    ids = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            tok = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
            if tok == eos:
                break
    return out


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# ------------------------------------------------------------------- AsyncSpecEngine, no Ray
def _local_engine(tiny_target, tiny_target_dir, tokenizer, drafter_dir, **cfg):
    from drafters.loading import load_drafter
    from serve.async_engine import AsyncSpecEngine
    from serve.engine.config import EngineConfig
    from serve.engine.core import SpecEngine
    from serve.engine.target_runner import TargetRunner

    drafter = load_drafter(drafter_dir, tiny_target, str(tiny_target_dir))
    engine = SpecEngine(TargetRunner(tiny_target, drafter.config.target_layer_ids), drafter,
                        [tokenizer.eos_token_id],
                        EngineConfig(scheduler="fixed", sps_profile="off", **cfg), tokenizer)
    return AsyncSpecEngine(engine, num_threads=1)


def test_async_engine_cancel_aborts_and_step_failure_kills(tiny_target, tiny_target_dir, tokenizer,
                                                           drafter_dir):
    from serve.engine.errors import EngineDeadError, RequestError
    from serve.engine.requests import EngineRequest, SamplingParams

    eng = _local_engine(tiny_target, tiny_target_dir, tokenizer, drafter_dir, max_num_requests=1,
                        max_waiting=0)
    prompt = tokenizer("Count to ten:")["input_ids"]

    async def scenario():
        # a complete request streams outputs that add up to the final count
        outs = [o async for o in eng.generate(EngineRequest(
            "a", prompt, SamplingParams(max_tokens=6, temperature=0.0)))]
        assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 6
        # a second request while one runs: refused with 429 before streaming starts
        long = eng.generate(EngineRequest("b", prompt, SamplingParams(max_tokens=400)))
        first = await long.__anext__()
        assert first.new_token_ids
        with pytest.raises(RequestError) as err:
            await eng.add_request(EngineRequest("c", prompt, SamplingParams(max_tokens=4)))
        assert err.value.status == 429
        await long.aclose()  # client disconnect
        for _ in range(200):
            if eng.snapshot().num_running == 0 and eng.snapshot().num_aborted == 1:
                break
            await asyncio.sleep(0.01)
        assert (eng.snapshot().num_running, eng.snapshot().num_aborted) == (0, 1)
        # a failing step: the in-flight request fails, health and new requests report it
        calls = {"n": 0}
        real_step = eng.engine.step

        def failing_step():
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("simulated device failure")
            return real_step()

        eng.engine.step = failing_step
        with pytest.raises(EngineDeadError, match="simulated device failure"):
            async for _ in eng.generate(EngineRequest("d", prompt, SamplingParams(max_tokens=50))):
                pass
        with pytest.raises(EngineDeadError):
            eng.check_health()
        with pytest.raises(EngineDeadError):
            await eng.add_request(EngineRequest("e", prompt, SamplingParams(max_tokens=4)))
        assert eng.snapshot().dead

    asyncio.run(scenario())
    eng.shutdown()


def test_stats_delta_recovers_the_verification_budget_histogram():
    from serve.async_engine import rounds_by_verified_length, stats_delta
    from serve.engine.metrics import SpecDecodeStats

    before, after = SpecDecodeStats(), SpecDecodeStats()
    before.record_round(4, 2, 1, 2)
    for drafted, verified, accepted in [(4, 2, 1), (4, 0, 0), (4, 4, 4), (4, 3, 0)]:
        after.record_round(drafted, verified, accepted, accepted + 1)
    after.record_round(4, 2, 1, 2)  # the round `before` already counted
    delta = stats_delta(before, after)
    assert (delta.rounds, delta.verified_tokens, delta.accepted_tokens) == (4, 9, 5)
    assert rounds_by_verified_length(delta) == {0: 1, 2: 1, 3: 1, 4: 1}


# ------------------------------------------------------------------------------ the Serve app
def test_quickstart_serve_config_is_a_valid_serve_config():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from pipeline.storage import project_root
    from serve.app import ServeConfig, build_app

    path = project_root() / "infra" / "configs" / "serve_quickstart.yaml"
    raw = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(raw)
    assert (schema.http_options.host, schema.http_options.port) == ("127.0.0.1", 8000)
    (app,) = schema.applications
    assert app.import_path == "serve.app:build_app"
    cfg = ServeConfig.model_validate(app.args)
    assert cfg.engine.scheduler == "dspark" and cfg.drafter == "runs/quickstart/calibrate/drafter"
    build_app(app.args)  # builds the Application without loading anything
    with pytest.raises(ValueError, match="max_num_request"):
        build_app({**app.args, "engine": {"max_num_request": 4}})


def test_gpu_serve_config_reserves_a_gpu_and_a_replica_without_one_fails_loudly(monkeypatch):
    import torch
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from pipeline.storage import project_root
    from serve.app import ServeConfig, build_app
    from serve.replica import load_engine

    raw = yaml.safe_load((project_root() / "infra" / "configs" / "serve_gpu.yaml").read_text())
    (app,) = ServeDeploySchema.model_validate(raw).applications
    cfg = ServeConfig.model_validate(app.args)
    assert cfg.num_gpus == 1 and cfg.torch_device() == "cuda"
    bound = build_app(app.args)
    assert bound._bound_deployment.ray_actor_options["num_gpus"] == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine's truth anyway
    with pytest.raises(RuntimeError, match="num_gpus=1.0 but sees no CUDA device"):
        load_engine(cfg)
    with pytest.raises(ValueError, match="needs num_gpus > 0"):
        ServeConfig.model_validate({**app.args, "num_gpus": 0, "device": "cuda"})


@pytest.fixture(scope="module")
def server(ray_local, tiny_target_dir, drafter_dir):
    """The app on 127.0.0.1:<free port>: dspark scheduler, 2 requests decoded together, no
    waiting queue (max_waiting 0), so a third concurrent request is refused with 429. Goodput
    planning is off: it decides from costs profiled at start-up, and on a loaded CI machine it
    may rightly draft for no request at all, while these tests check the speculative path's
    output, counters and metrics (the planner has its own tests)."""
    from ray import serve

    from serve.app import build_app

    args = {"target": str(tiny_target_dir), "drafter": str(drafter_dir), "dtype": "float32",
            "served_model_name": MODEL, "num_threads": 1, "metrics_interval_s": 0.2,
            "chat_template_kwargs": TEMPLATE_KWARGS,
            "engine": {"scheduler": "dspark", "max_num_requests": 2, "max_waiting": 0,
                       "max_batch_tokens": 16, "sps_repeats": 1, "draft_planning": "off"}}
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="dspark", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    yield base
    serve.shutdown()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60) as client:
        yield client


def _engine_state() -> dict:
    from ray import serve

    return serve.get_app_handle("dspark").engine_state.remote().result()


def test_openai_client_streams_chat(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0.7, seed=1, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    assert text and finishes in (["length"], ["stop"])
    assert chunks[-1].choices == [] and 1 <= chunks[-1].usage.completion_tokens <= 12
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    # the same client, non-streaming
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                     temperature=0)
    assert resp.object == "text_completion" and resp.usage.completion_tokens <= 5


def test_greedy_http_output_is_target_greedy_and_usage_counts_emitted_tokens(
        http, tiny_target, tokenizer):
    from serve.engine.chat import render_prompt_ids

    n = 24
    prompt_ids = render_prompt_ids(tokenizer, MESSAGES, TEMPLATE_KWARGS)
    ref = greedy_reference(tiny_target, prompt_ids, n, tokenizer.eos_token_id)
    ref_text = _decode(tokenizer, ref)
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ref_text}
    assert choice["finish_reason"] == ("stop" if ref[-1] == tokenizer.eos_token_id else "length")
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ref),
                             "total_tokens": len(prompt_ids) + len(ref)}
    # streamed greedy completion of a raw prompt: same text as the reference
    prompt = "The capital of France is"
    ref2 = greedy_reference(tiny_target, tokenizer(prompt)["input_ids"], n, tokenizer.eos_token_id)
    with http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    data = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    text = "".join(d["choices"][0]["text"] for d in data if d["choices"])
    assert text == _decode(tokenizer, ref2)
    assert data[-1]["usage"]["completion_tokens"] == len(ref2)
    # a stop string inside the output: text cut before it, usage <= the uncut count (SPEC 8)
    assert len(ref_text) >= 6
    stop = ref_text[len(ref_text) // 2:][:3]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                "max_tokens": n, "temperature": 0, "stop": [stop]})
    body = r.json()
    assert body["choices"][0]["message"]["content"] == ref_text[:ref_text.find(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert 1 <= body["usage"]["completion_tokens"] <= len(ref)
    # the speculative path ran (drafts proposed) and the metrics pump exported the counters
    deadline = time.time() + 5
    while time.time() < deadline:
        state = _engine_state()
        if state["exported_stats"]["drafted_tokens"] == state["stats"]["drafted_tokens"] > 0:
            break
        time.sleep(0.2)
    assert state["scheduler"] == "dspark" and state["stats"]["drafted_tokens"] > 0
    assert state["exported_stats"]["drafted_tokens"] == state["stats"]["drafted_tokens"]


@pytest.mark.parametrize("payload, status, param", [
    ({"temperature": 5}, 400, "temperature"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"messages": None}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"n": 2}, 400, "n"),
    ({"top_p": 0}, 400, "top_p"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokenz": 5}, 400, "max_tokenz"),  # unknown fields are named, never ignored
    ({"top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs: true
    ({"min_tokens": 9}, 400, "min_tokens"),  # above max_tokens
    ({"presence_penalty": 1.0}, 400, "presence_penalty"),
    ({"model": "gpt-4o"}, 404, "model"),
    ({"max_tokens": 5000}, 413, "max_tokens"),  # tiny target: 1024 positions
])
def test_invalid_requests_get_openai_error_bodies(http, payload, status, param):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **payload}
    body = {k: v for k, v in body.items() if v is not None}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert param in err["message"] or status == 404


def test_null_fields_logprobs_and_vllm_sampling_fields_over_http(server, http):
    """Fields sent as null mean their defaults; logprobs come back parsed by the official client,
    one per emitted token; top_k / min_p / min_tokens / ignore_eos are accepted end to end."""
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0,
        "stream": None, "top_p": None, "stop": None, "stream_options": None, "user": None})
    assert r.status_code == 200, r.text
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy
    comp = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4,
                                     temperature=1.0, logprobs=1, seed=3,
                                     extra_body={"top_k": 5, "min_p": 0.01, "min_tokens": 4,
                                                 "ignore_eos": True})
    assert comp.usage.completion_tokens == 4 and len(comp.choices[0].logprobs.tokens) == 4


def test_malformed_json_and_empty_prompt(http):
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type":
                                                                      "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "", "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_models_and_health(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_overload_is_refused_with_429_not_queued(server):
    """max_num_requests 2, max_waiting 0: of 5 concurrent long requests at most 2 run."""
    results: list = []

    def one():
        with httpx.Client(base_url=server, timeout=120) as c:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Tell me a story",
                                                "max_tokens": 120, "temperature": 1.0})
            results.append((r.status_code, r.json(), r.headers.get("retry-after")))

    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(code for code, _, _ in results)
    assert set(codes) <= {200, 429} and 1 <= codes.count(200) and codes.count(429) >= 2, codes
    for code, body, retry in results:
        if code == 429:
            assert body["error"]["code"] == "queue_full" and retry == "1"
        else:
            assert body["usage"]["completion_tokens"] <= 120


def test_client_disconnect_aborts_the_request(server, http):
    aborted_before = _engine_state()["num_aborted"]
    with httpx.Client(base_url=server, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": MESSAGES, "max_tokens": 900, "temperature": 1.0,
                "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(4)]  # role chunk, blank line, a content chunk
            assert got[0].startswith("data: ")
    # closed after a few chunks: the engine drops the request and frees its slot
    deadline = time.time() + 15
    while time.time() < deadline:
        state = _engine_state()
        if state["num_running"] == 0 and state["num_aborted"] > aborted_before:
            break
        time.sleep(0.1)
    assert state["num_aborted"] == aborted_before + 1 and state["num_running"] == 0
    assert http.get("/health").json()["num_running"] == 0
    # the KV pool was sized at start-up and the aborted request's slot is free again
    pool = state["kv_pool"]
    assert pool["free_slots"] == pool["slots"] and pool["reallocations"] == 0


def test_spec_details_over_http_when_asked(http):
    """``return_spec_details``: the response (the final chunk when streaming) carries the request's
    speculation summary, consistent with its usage; a request that did not ask gets the plain
    OpenAI object."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    plain = http.post("/v1/chat/completions", json=body).json()
    assert "spec_details" not in plain and "metrics" not in plain
    for path, extra in (("/v1/chat/completions", {}),
                        ("/v1/completions", {"prompt": "Once upon a time", "messages": None})):
        req = {**body, **extra, "return_spec_details": True}
        req = {k: v for k, v in req.items() if v is not None}
        out = http.post(path, json=req).json()
        d = out["spec_details"]
        generated = out["usage"]["completion_tokens"]
        assert sum(d["accept_histogram"]) == d["rounds"] >= 1
        assert (d["accept_length"] or 0) * d["rounds"] == pytest.approx(generated - 1)
        assert d["draft_tokens_accepted"] <= d["draft_tokens_verified"] <= d["draft_tokens_proposed"]
        assert d["engine_ttft_s"] >= 0 and d["engine_decode_tokens_per_s"] > 0
        # vLLM's per-request stats beside them (vLLM PR #48915's summary shape)
        v = out["metrics"]["speculative_decoding"]
        assert set(v) == {"mean_acceptance_length", "draft_acceptance_rate",
                          "acceptance_histogram", "num_spec_steps", "num_accepted_draft_tokens",
                          "num_draft_tokens", "num_spec_tokens"}
        assert v["num_accepted_draft_tokens"] == d["draft_tokens_accepted"]
        assert v["num_draft_tokens"] == d["draft_tokens_verified"]
        assert v["num_spec_steps"] == d["drafted_rounds"] == sum(v["acceptance_histogram"])
        with http.stream("POST", path, json={**req, "stream": True}) as r:
            events = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        carrying = [e for e in events if "spec_details" in e]
        assert len(carrying) == 1 and carrying[0]["choices"][0]["finish_reason"] == "length"
        assert not any("metrics" in e for e in events)  # vLLM's ride the usage chunk only
        with http.stream("POST", path, json={**req, "stream": True,
                                             "stream_options": {"include_usage": True}}) as r:
            events = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        assert [e["choices"] for e in events if "metrics" in e] == [[]]
        assert events[-1]["metrics"]["speculative_decoding"]["num_spec_tokens"] == \
            v["num_spec_tokens"] and "usage" in events[-1]
        # (not compared with d: a separate decode of the same request)
        streamed = carrying[0]["spec_details"]
        assert sum(streamed["accept_histogram"]) == streamed["rounds"] >= 1
        assert (streamed["accept_length"] or 0) * streamed["rounds"] == pytest.approx(
            generated - 1)


def _prometheus_totals(names: tuple[str, ...]) -> dict[str, float]:
    """Each metric of ``names`` summed over its label sets, scraped from this node's Prometheus
    endpoint (Ray's metrics agent; absent metrics read 0)."""
    import ray

    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def test_prometheus_token_counters_equal_the_served_usage_sums(http):
    """``ray_vllm_prompt_tokens_total`` / ``ray_vllm_generation_tokens_total`` grow by exactly
    the ``usage`` of the requests served, streamed or not (the histograms' ``_sum`` does not:
    Ray estimates it from bucket midpoints)."""
    report_s = int(os.environ.get("RAY_metrics_report_interval_ms", 10_000)) / 1000
    names = ("ray_vllm_prompt_tokens_total", "ray_vllm_generation_tokens_total")
    before, deadline = _prometheus_totals(names), time.time() + 60
    while time.time() < deadline:  # earlier tests' requests exported: two reads apart agree
        time.sleep(3 * report_s)
        now = _prometheus_totals(names)
        if now == before:
            break
        before = now
    prompt = generated = 0
    for i, (path, stream) in enumerate([("/v1/chat/completions", False),
                                        ("/v1/completions", True),
                                        ("/v1/chat/completions", True),
                                        ("/v1/completions", False)]):
        req = {"model": MODEL, "max_tokens": 5 + 3 * i, "temperature": 1.0, "seed": i}
        req.update({"messages": MESSAGES} if "chat" in path
                   else {"prompt": "Once upon a time " * (i + 1)})
        if stream:
            req.update(stream=True, stream_options={"include_usage": True})
            with http.stream("POST", path, json=req) as r:
                usage = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                         if line.startswith("data: {")][-1]["usage"]
        else:
            usage = http.post(path, json=req).json()["usage"]
        prompt, generated = prompt + usage["prompt_tokens"], generated + usage["completion_tokens"]
    expected = {names[0]: before[names[0]] + prompt, names[1]: before[names[1]] + generated}
    while time.time() < deadline + 30 and _prometheus_totals(names) != expected:
        time.sleep(report_s)
    assert _prometheus_totals(names) == expected and prompt > 0 and generated > 0
