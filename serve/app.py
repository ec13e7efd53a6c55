"""The Ray Serve app: an OpenAI-compatible HTTP server over one speculative engine per replica.

The only module of ``serve`` that imports Ray (STYLE section 2, item 1). Each replica loads the
target, its tokenizer and the drafter, profiles SPS(B) when the scheduler needs it (SPEC 6), and
drives one :class:`serve.engine.SpecEngine` through :class:`serve.async_engine.AsyncSpecEngine`
(the one decoding loop every caller shares, STYLE item 8).

Start it from a Ray Serve config file (``applications[].import_path: serve.app:build_app``, the
``args`` block validated by :class:`ServeConfig`)::

    serve run infra/configs/serve_quickstart.yaml

or from Python: ``serve.start(http_options=...); serve.run(build_app({...}))``.

Routes (OpenAI API reference; bodies in :mod:`serve.openai_protocol`):

* ``POST /v1/completions``, ``POST /v1/chat/completions``: JSON, or server-sent events
  (``data: {chunk}\\n\\n`` ... ``data: [DONE]\\n\\n``) with ``"stream": true``. Chat messages are
  rendered with the tokenizer's chat template and ``chat_template_kwargs`` (the same variables
  the training data used, SPEC 8: no template or thinking-mode mismatch).
* ``GET /v1/models``; ``GET /health`` (200 with queue counts, 503 when the engine is dead).

Errors are ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad field (named in
``param``; pydantic errors mapped; text that is not valid Unicode, a number beyond int64, NaN or
infinity included) or a body that is not JSON in UTF-8, 404 ``model_not_found``, 413
``context_length_exceeded`` when prompt + max_tokens exceed the model length (OpenAI answers 400
with the same code; 413 is this server's choice so clients can tell it from a malformed request),
429 ``queue_full`` with ``Retry-After`` when the engine's waiting queue is full (requests are
refused, never queued without bound), 503 ``engine_dead``. A client that disconnects cancels its
request in the engine.

Metrics (``ray.serve.metrics``, exported to Prometheus by Ray; names get Ray's ``ray_`` prefix and
counters a ``_total`` suffix): see :class:`ServeMetrics`.
"""

import asyncio
import logging
import os
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve import metrics as serve_metrics
from ray.serve.deployment import Application
from starlette.exceptions import HTTPException

from .async_engine import (AsyncSpecEngine, EngineSnapshot, RequestStream, copy_stats,
                           rounds_by_verified_length, stats_delta)
from .config import ServeConfig, _is_path
from .detokenize import token_bytes
from .errors import EngineDeadError, RequestError
from .metrics import SpecDecodeStats
from .openai_protocol import (SSE_DONE, APIError, AssistantMessage, ChatChoice, ChatChunkChoice,
                              ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                              CompletionChoice, CompletionRequest, CompletionResponse,
                              DeltaMessage, ModelCard, ModelList, Usage, chat_logprobs,
                              completion_logprobs, new_id, now_s, sse, validation_error)
from .requests import EngineRequest, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


def load_engine(cfg: ServeConfig):
    """Load target, tokenizer and drafter and build the :class:`SpecEngine` (no Ray).

    The SPS(B) table is measured (or reused from ``<drafter>/sps_profile.json`` when its hardware
    fingerprint matches) only for the dspark and async schedulers; ``engine.sps_profile: off``
    assumes SPS constant.

    Returns:
        the engine (its ``tokenizer`` attribute set).
    Raises:
        FileNotFoundError: target or drafter missing (path named).
        ValueError: the drafter was trained for another target (each mismatch named), or the
            scheduler needs a confidence head the drafter lacks.
        RuntimeError: the config asks for a GPU and this process sees none.
    """
    import torch

    from .builder import build_engine, load_models
    from .paths import resolve

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device = cfg.torch_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"this replica asked for num_gpus={cfg.num_gpus} but sees no CUDA device "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
                           f"torch {torch.__version__}, CUDA build: {torch.version.cuda})")
    target = resolve(cfg.target) if _is_path(cfg.target) else cfg.target
    models = load_models(target, cfg.dtype, resolve(cfg.drafter) if cfg.drafter else None,
                         allow_name_mismatch=cfg.allow_target_name_mismatch, device=device,
                         storage_options=cfg.storage_options)
    start = time.perf_counter()
    engine = build_engine(models, cfg.engine)
    if engine.sps is not None:
        logger.info("SPS(B) and drafter cost ready in %.1f s", time.perf_counter() - start)
    return engine


# ------------------------------------------------------------------------------------- metrics
TTFT_BUCKETS_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120]
LATENCY_BUCKETS_S = [0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640]
TPOT_BUCKETS_S = [0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5]
TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class ServeMetrics:
    """Replica metrics through ``ray.serve.metrics`` (deployment/replica/application tags added by
    Serve; Prometheus names get Ray's ``ray_`` prefix). Engine counters are exported as
    differences of :class:`EngineSnapshot` taken periodically on the replica's event loop, so the
    engine thread never touches a metric. ``infra/grafana/dspark_serve.json`` charts them.

    Speculative decoding under vLLM's names (``vllm:`` becomes ``vllm_``: Ray metric names cannot
    hold a colon): ``vllm_spec_decode_num_drafts`` (rounds that proposed drafts),
    ``vllm_spec_decode_num_draft_tokens`` (draft tokens sent to verification: vLLM verifies every
    draft token, DSpark's scheduler may verify fewer than it drafted),
    ``vllm_spec_decode_num_accepted_tokens`` and ``vllm_spec_decode_num_accepted_tokens_per_pos``
    (tag ``position``, 0-based as vLLM's); acceptance rate = accepted / draft tokens.
    DSpark's own: ``dspark_drafted_tokens`` (all proposed), ``dspark_committed_tokens`` (bonus
    included), ``dspark_rounds``, ``dspark_engine_steps``, ``dspark_failed_requests``,
    ``dspark_verified_tokens_per_position`` (tag ``position``, 1-based; accepted / verified per
    position = accept_rate@k over the rounds verifying k, SPEC 5), histogram
    ``dspark_verification_budget_tokens`` (l_r per request per step, SPEC 6; buckets at k + 0.5).
    Request level (vLLM's names): ``vllm_e2e_request_latency_seconds``,
    ``vllm_time_to_first_token_seconds``, ``vllm_time_per_output_token_seconds`` (after the first
    token), ``vllm_request_prompt_tokens``, ``vllm_request_generation_tokens``,
    ``vllm_request_success`` (Prometheus: ``ray_vllm_request_success_total``, tag
    ``finished_reason``: stop, length, abort, error).
    Gauges: ``dspark_num_waiting_requests``, ``dspark_num_running_requests``,
    ``dspark_engine_alive`` (1/0). Every tag takes a bounded set of values (no free-form user
    label).

    Ray 2.60's OpenTelemetry recorder reports a histogram's ``_sum`` from bucket midpoints, so
    read the bucket counts (exact), not ``_sum / _count``.
    """

    COUNTERS = {"drafted_rounds": "vllm_spec_decode_num_drafts",
                "verified_tokens": "vllm_spec_decode_num_draft_tokens",
                "accepted_tokens": "vllm_spec_decode_num_accepted_tokens",
                "drafted_tokens": "dspark_drafted_tokens",
                "committed_tokens": "dspark_committed_tokens",
                "rounds": "dspark_rounds", "steps": "dspark_engine_steps",
                "failed_requests": "dspark_failed_requests"}
    FINISH_REASONS = ("stop", "length", "abort", "error")

    def __init__(self, gamma: int):
        m = serve_metrics
        self.counters = {field: m.Counter(name, description=f"SpecDecodeStats.{field} (raw).")
                         for field, name in self.COUNTERS.items()}
        self.accepted_pos = m.Counter("vllm_spec_decode_num_accepted_tokens_per_pos",
                                      tag_keys=("position",),
                                      description="Accepted draft tokens at position k (0-based).")
        self.verified_pos = m.Counter("dspark_verified_tokens_per_position", tag_keys=("position",),
                                      description="Rounds that verified draft position k (1-based).")
        self.budget = m.Histogram("dspark_verification_budget_tokens",
                                  description="Draft tokens verified per request per step.",
                                  boundaries=[k + 0.5 for k in range(max(gamma, 1) + 1)])
        self.e2e = m.Histogram("vllm_e2e_request_latency_seconds", boundaries=LATENCY_BUCKETS_S,
                               description="Request arrival to its last token (s).")
        self.ttft = m.Histogram("vllm_time_to_first_token_seconds", boundaries=TTFT_BUCKETS_S,
                                description="Request arrival to first token (s).")
        self.tpot = m.Histogram("vllm_time_per_output_token_seconds", boundaries=TPOT_BUCKETS_S,
                                description="Seconds per output token after the first.")
        self.prompt_tokens = m.Histogram("vllm_request_prompt_tokens", boundaries=TOKEN_BUCKETS,
                                         description="Prompt tokens per request.")
        self.generation_tokens = m.Histogram("vllm_request_generation_tokens",
                                             boundaries=TOKEN_BUCKETS,
                                             description="Generated tokens per request.")
        self.finished = m.Counter("vllm_request_success", tag_keys=("finished_reason",),
                                  description="Finished requests by finish reason.")
        self.waiting = m.Gauge("dspark_num_waiting_requests", description="Engine queue length.")
        self.running = m.Gauge("dspark_num_running_requests", description="Requests decoding.")
        self.alive = m.Gauge("dspark_engine_alive", description="1 while the engine is healthy.")
        self._prev = SpecDecodeStats()
        self.exported = SpecDecodeStats()  # totals pushed so far (for /health and tests)

    def update(self, snap: EngineSnapshot) -> None:
        """Push the counter increments since the previous call and set the gauges."""
        delta = stats_delta(self._prev, snap.stats)
        self._prev = snap.stats
        for field, counter in self.counters.items():
            value = getattr(delta, field)
            if value > 0:
                counter.inc(value)
        for k, (v, a) in enumerate(zip(delta.verified_per_position, delta.accepted_per_position)):
            if v > 0:
                self.verified_pos.inc(v, tags={"position": str(k + 1)})
            if a > 0:
                self.accepted_pos.inc(a, tags={"position": str(k)})
        for length, count in rounds_by_verified_length(delta).items():
            for _ in range(count):
                self.budget.observe(length)
        self.waiting.set(snap.num_waiting)
        self.running.set(snap.num_running)
        self.alive.set(0 if snap.dead else 1)
        self.exported = copy_stats(snap.stats)


class _RequestTimer:
    """Request-level metrics of one request, measured on the event loop."""

    def __init__(self, metrics: ServeMetrics, num_prompt_tokens: int, arrival_s: float):
        self.metrics, self.arrival_s = metrics, arrival_s
        self.num_prompt_tokens = num_prompt_tokens
        self.first_s: float | None = None
        self.first_tokens = 0
        self.last_s = arrival_s
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.new_token_ids and self.first_s is None:
            self.first_s, self.first_tokens = now, out.num_generated_tokens
            self.metrics.ttft.observe(now - self.arrival_s)
        self.last_s = now

    def finish(self, last: RequestOutput | None, reason: str | None = None) -> None:
        """Record the finished request once; ``reason`` overrides (a client that went away is an
        abort, a failed request an error)."""
        if self.done:
            return
        self.done = True
        reason = reason or (last.finish_reason if last is not None and last.finished else "abort")
        if reason not in ServeMetrics.FINISH_REASONS:
            reason = "error"
        m = self.metrics
        m.finished.inc(1, tags={"finished_reason": reason})
        m.prompt_tokens.observe(self.num_prompt_tokens)
        m.generation_tokens.observe(last.num_generated_tokens if last is not None else 0)
        m.e2e.observe(self.last_s - self.arrival_s)
        if last is None or self.first_s is None:
            return
        tokens, seconds = last.num_generated_tokens - self.first_tokens, self.last_s - self.first_s
        if tokens > 0 and seconds > 0:
            m.tpot.observe(seconds / tokens)


# ---------------------------------------------------------------------------------------- app
api = FastAPI(title="dspark-ray", description="OpenAI-compatible speculative decoding (DSpark).")


@api.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    err = validation_error(list(exc.errors()))
    return JSONResponse(err.body(), status_code=err.status)


@api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException):
    """FastAPI's and Starlette's own errors as OpenAI error objects, not ``{"detail": ...}``: a
    body that fails before validation (not UTF-8, nesting deeper than the JSON parser goes, an
    integer of more digits than Python converts), an unknown route or method."""
    cause = exc.__cause__
    if exc.status_code == 400 and cause is not None:
        err = APIError(400, f"the request body cannot be read as JSON in UTF-8: "
                       f"{type(cause).__name__}: {cause}", code="invalid_value")
    else:
        err = APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                       headers=exc.headers)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


@api.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception):
    """A bug, not the client's fault: 500 with the JSON error body (Starlette still logs it)."""
    err = APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")
    return JSONResponse(err.body(), status_code=500)


def _request_error(err: RequestError, chat: bool) -> APIError:
    """Map an engine :class:`RequestError` to its OpenAI error (status kept)."""
    param = err.field
    if param == "prompt" and chat:
        param = "messages"
    code = {413: "context_length_exceeded", 429: "queue_full",
            500: "request_failed"}.get(err.status, "invalid_value")
    headers = {"Retry-After": "1"} if err.status == 429 else None
    return APIError(err.status, str(err), param=param, code=code, headers=headers)


def _dead_error(err: EngineDeadError) -> APIError:
    return APIError(503, f"the engine is dead: {err}", code="engine_dead")


@serve.deployment(name="SpecServer", health_check_period_s=10, health_check_timeout_s=30,
                  graceful_shutdown_timeout_s=10)
@serve.ingress(api)
class SpecServer:
    """One replica: an :class:`AsyncSpecEngine` behind the OpenAI routes.

    Args:
        config: a :class:`ServeConfig` as a dict.
        engine: a built :class:`SpecEngine` (tokenizer set) to serve instead of the one the
            config names: the routes driven in-process, without Ray (tests).
    Raises:
        ValueError / FileNotFoundError: from :func:`load_engine` (the replica fails to start).
    """

    def __init__(self, config: dict, engine=None):
        self.cfg = ServeConfig.model_validate(config)
        engine = engine if engine is not None else load_engine(self.cfg)
        self.engine = AsyncSpecEngine(engine, num_threads=self.cfg.num_threads,
                                     heap_trim_interval_s=self.cfg.heap_trim_interval_s)
        self.tokenizer = engine.tokenizer
        self._token_bytes = token_bytes(self.tokenizer)
        self.vocab_size = engine.target.model.config.vocab_size
        self.model_name = self.cfg.model_name()
        self.created = now_s()
        self.metrics = ServeMetrics(engine.gamma)
        self._pump_task: asyncio.Task | None = None
        logger.info("serving %s: target %s, drafter %s, scheduler %s, gamma %d",
                    self.model_name, self.cfg.target, self.cfg.drafter, engine.scheduler_name,
                    engine.gamma)

    # --------------------------------------------------------------------------- lifecycle
    def _ensure_pump(self) -> None:
        """Start the periodic metrics export on the replica's event loop (once)."""
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        while True:
            try:
                self.metrics.update(self.engine.snapshot())
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                logger.exception("metrics export failed")
            await asyncio.sleep(self.cfg.metrics_interval_s)

    async def check_health(self) -> None:
        """Ray Serve's replica health check: raises EngineDeadError once the engine died, so
        Serve replaces the replica."""
        self._ensure_pump()
        self.engine.check_health()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout_s=5.0)

    async def engine_state(self) -> dict:
        """Engine counters for operators and tests (DeploymentHandle call)."""
        snap = self.engine.snapshot()
        return {"num_waiting": snap.num_waiting, "num_running": snap.num_running,
                "num_finished": snap.num_finished, "num_aborted": snap.num_aborted,
                "num_rejected": snap.num_rejected, "dead": snap.dead,
                "scheduler": self.engine.engine.scheduler_name, "gamma": self.engine.engine.gamma,
                "kv_pool": snap.kv_pool,
                "stats": vars(copy_stats(snap.stats)),
                "exported_stats": vars(copy_stats(self.metrics.exported))}

    # ------------------------------------------------------------------------------ routes
    @api.get("/health")
    async def health(self):
        """200 ``{"status": "ok", num_waiting, num_running, ..., kv_pool}``; 503 once the engine
        died. ``kv_pool``: the target KV pool's slots, free slots, positions per slot, bytes and
        growths since start-up."""
        self._ensure_pump()
        try:
            self.engine.check_health()
        except EngineDeadError as err:
            raise _dead_error(err) from err
        snap = self.engine.snapshot()
        return {"status": "ok", "model": self.model_name, "num_waiting": snap.num_waiting,
                "num_running": snap.num_running, "num_finished": snap.num_finished,
                "num_aborted": snap.num_aborted, "num_rejected": snap.num_rejected,
                "kv_pool": snap.kv_pool}

    @api.get("/v1/models")
    async def models(self):
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                         root=self.cfg.target)]).model_dump()

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        """OpenAI ``POST /v1/completions`` (one prompt, one choice)."""
        arrival_s = time.perf_counter()
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = self.tokenizer(body.prompt)["input_ids"]
        else:
            prompt_ids = list(body.prompt)
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"prompt: token ids {bad[:5]} outside the vocabulary "
                               f"[0, {self.vocab_size})", param="prompt", code="invalid_value")
        return await self._serve(body, prompt_ids, chat=False, arrival_s=arrival_s)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        """OpenAI ``POST /v1/chat/completions`` rendered with the chat template (one choice)."""
        arrival_s = time.perf_counter()
        self._check_model(body.model)
        from .chat import render_prompt_ids

        try:
            prompt_ids = render_prompt_ids(self.tokenizer, body.template_messages(),
                                           self.cfg.chat_template_kwargs)
        except Exception as err:  # noqa: BLE001 - jinja errors raised by the template itself
            raise APIError(400, f"messages: the chat template cannot render them: {err}",
                           param="messages", code="invalid_value") from err
        return await self._serve(body, prompt_ids, chat=True, arrival_s=arrival_s)

    # ----------------------------------------------------------------------------- helpers
    def _check_model(self, model: str) -> None:
        self._ensure_pump()
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.model_name}` (GET /v1/models).", param="model",
                           code="model_not_found")

    def _sampling_params(self, body, num_prompt: int, chat: bool) -> SamplingParams:
        limit = self.engine.max_model_len
        if num_prompt >= limit:
            raise APIError(413, f"the prompt has {num_prompt} tokens; the model length is {limit}",
                           param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:
            max_tokens = min(self.cfg.default_max_tokens, limit - num_prompt)
        return SamplingParams(max_tokens=max_tokens,
                              temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                              stop=body.stop_strings(), top_k=body.top_k or 0,
                              min_p=body.min_p or 0.0, min_tokens=body.min_tokens or 0,
                              ignore_eos=bool(body.ignore_eos),
                              stop_token_ids=tuple(body.stop_token_ids or ()),
                              logprobs=body.requested_logprobs())

    async def _serve(self, body, prompt_ids: list[int], chat: bool, arrival_s: float):
        params = self._sampling_params(body, len(prompt_ids), chat)
        request_id = new_id("chatcmpl" if chat else "cmpl")
        try:
            stream = await self.engine.add_request(EngineRequest(
                request_id, prompt_ids, params,
                return_spec_details=bool(body.return_spec_details),
                min_tokens_per_s=body.min_tokens_per_s))
        except RequestError as err:
            raise _request_error(err, chat) from err
        except EngineDeadError as err:
            raise _dead_error(err) from err
        timer = _RequestTimer(self.metrics, len(prompt_ids), arrival_s)
        created = now_s()
        if body.stream:
            events = (self._chat_events if chat else self._completion_events)(
                stream, request_id, created, body.include_usage, timer)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        text, last, logprobs = await self._collect(stream, timer, chat)
        usage = Usage.of(stream.num_prompt_tokens, last.num_generated_tokens)
        wants = params.logprobs is not None
        if chat:
            return ChatCompletionResponse(
                id=request_id, created=created, model=self.model_name, usage=usage,
                choices=[ChatChoice(message=AssistantMessage(content=text),
                                    logprobs=chat_logprobs(logprobs, self._token_text,
                                                           self._token_bytes)
                                    if wants else None,
                                    finish_reason=last.finish_reason)],
                spec_details=last.spec_details).model_dump()
        return CompletionResponse(
            id=request_id, created=created, model=self.model_name, usage=usage,
            choices=[CompletionChoice(text=text, finish_reason=last.finish_reason,
                                      logprobs=completion_logprobs(logprobs, self._token_text)
                                      if wants else None)],
            spec_details=last.spec_details).model_dump()

    async def _collect(self, stream: RequestStream, timer: _RequestTimer, chat: bool):
        """All of a request's text, its last output and its token logprobs (when asked); a
        cancelled handler (client gone) aborts it."""
        pieces, last, logprobs = [], None, []
        try:
            async for out in stream:
                timer.observe(out)
                pieces.append(out.new_text)
                logprobs += out.logprobs or []
                last = out
        except EngineDeadError as err:
            raise _dead_error(err) from err
        except RequestError as err:  # this request failed alone inside the engine
            timer.finish(last, "error")
            raise _request_error(err, chat) from err
        finally:
            stream.abort()  # no-op once finished
            timer.finish(last)
        return "".join(pieces), last, logprobs

    def _token_text(self, token_id: int) -> str:
        """One token's text (logprobs entries)."""
        return self.tokenizer.decode([token_id])

    async def _chat_events(self, stream: RequestStream, request_id: str, created: int,
                           include_usage: bool, timer: _RequestTimer):
        def chunk(delta: DeltaMessage, finish_reason=None, usage=None, choices=True,
                  logprobs=None, spec_details=None):
            return sse(ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, usage=usage,
                choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason,
                                         logprobs=logprobs)]
                if choices else [], spec_details=spec_details))

        last = None
        try:
            yield chunk(DeltaMessage(role="assistant", content=""))
            async for out in stream:
                timer.observe(out)
                last = out
                if out.new_text or out.logprobs:
                    yield chunk(DeltaMessage(content=out.new_text),
                                logprobs=chat_logprobs(out.logprobs, self._token_text,
                                                       self._token_bytes)
                                if out.logprobs is not None else None)
                if out.finished:
                    yield chunk(DeltaMessage(), finish_reason=out.finish_reason,
                                spec_details=out.spec_details)
            if include_usage and last is not None:
                yield chunk(DeltaMessage(), choices=False,
                            usage=Usage.of(stream.num_prompt_tokens, last.num_generated_tokens))
            yield SSE_DONE
        except EngineDeadError as err:
            yield sse(_dead_error(err).body())
            yield SSE_DONE
        except RequestError as err:  # this request failed alone: an error event, then done
            timer.finish(last, "error")
            yield sse(_request_error(err, True).body())
            yield SSE_DONE
        finally:
            stream.abort()  # client gone (cancelled / closed generator): free the engine slot
            timer.finish(last)

    async def _completion_events(self, stream: RequestStream, request_id: str, created: int,
                                 include_usage: bool, timer: _RequestTimer):
        def chunk(text: str, finish_reason=None, usage=None, choices=True, logprobs=None,
                  spec_details=None):
            return sse(CompletionResponse(
                id=request_id, created=created, model=self.model_name, usage=usage,
                choices=[CompletionChoice(text=text, finish_reason=finish_reason,
                                          logprobs=logprobs)]
                if choices else [], spec_details=spec_details))

        last, offset = None, 0
        try:
            async for out in stream:
                timer.observe(out)
                last = out
                if out.new_text or out.finished or out.logprobs:
                    lp = None
                    if out.logprobs is not None:
                        lp = completion_logprobs(out.logprobs, self._token_text, offset)
                        offset += sum(len(t) for t in lp.tokens)
                    yield chunk(out.new_text, finish_reason=out.finish_reason, logprobs=lp,
                                spec_details=out.spec_details)
            if include_usage and last is not None:
                yield chunk("", choices=False,
                            usage=Usage.of(stream.num_prompt_tokens, last.num_generated_tokens))
            yield SSE_DONE
        except EngineDeadError as err:
            yield sse(_dead_error(err).body())
            yield SSE_DONE
        except RequestError as err:
            timer.finish(last, "error")
            yield sse(_request_error(err, False).body())
            yield SSE_DONE
        finally:
            stream.abort()
            timer.finish(last)


def build_app(args: dict) -> Application:
    """The Serve application for ``serve run`` (``import_path: serve.app:build_app``).

    Args:
        args: the config file's ``args`` block, a :class:`ServeConfig` as a dict.
    Raises:
        pydantic.ValidationError (a ValueError): an invalid or unknown field (each named).
        ImportError: ``backend: vllm`` without vLLM installed (``serve/vllm_app.py``).
    """
    cfg = ServeConfig.model_validate(args)
    if cfg.backend == "vllm":  # the same config, served by vLLM through ray.serve.llm
        from .vllm_app import build_vllm_app

        return build_vllm_app(cfg)
    max_ongoing = cfg.max_ongoing_requests or (cfg.engine.max_num_requests
                                               + cfg.engine.max_waiting + 16)
    return SpecServer.options(max_ongoing_requests=max_ongoing,
                              ray_actor_options={"num_cpus": cfg.num_cpus,
                                                 "num_gpus": cfg.num_gpus}
                              ).bind(cfg.model_dump(mode="json"))
