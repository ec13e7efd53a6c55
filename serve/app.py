"""The Ray Serve app: an OpenAI-compatible HTTP server over one speculative engine per replica.

The only module of ``serve`` that imports Ray (STYLE section 2, item 1). Each replica loads the
target, its tokenizer and the drafter, profiles SPS(B) when the scheduler needs it (SPEC 6), and
drives one :class:`serve.engine.core.SpecEngine` through :class:`serve.async_engine.AsyncSpecEngine`
(the one decoding loop every caller shares, STYLE item 8).

Start it from a Ray Serve config file (``applications[].import_path: serve.app:build_app``, the
``args`` block validated by :class:`ServeConfig`)::

    serve run infra/configs/serve_quickstart.yaml

or from Python: ``serve.start(http_options=...); serve.run(build_app({...}))``.

Routes (OpenAI API reference; bodies in :mod:`serve.openai_protocol` and :mod:`serve.openai_responses`):

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
counters a ``_total`` suffix): see :class:`serve.app_metrics.ServeMetrics`.
"""

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.deployment import Application
from starlette.exceptions import HTTPException

from .app_metrics import RequestTimer, ServeMetrics
from .async_engine import AsyncSpecEngine, RequestStream, copy_stats
from .config import ServeConfig
from .engine.chat import render_prompt_ids
from .engine.detokenize import token_bytes
from .engine.errors import EngineDeadError, RequestError
from .engine.requests import EngineRequest, SamplingParams
from .openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    dead_error,
    request_error,
    validation_error,
)
from .openai_responses import (
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    Usage,
    chat_logprobs,
    completion_logprobs,
    new_id,
    now_s,
    sse,
)
from .replica import load_engine
from .vllm_app import build_vllm_app

logger = logging.getLogger(__name__)


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
        self.metrics = ServeMetrics(engine.num_speculative_tokens)
        self._pump_task: asyncio.Task | None = None
        logger.info("serving %s: target %s, drafter %s, scheduler %s, num_speculative_tokens %d",
                    self.model_name, self.cfg.target, self.cfg.drafter, engine.scheduler_name,
                    engine.num_speculative_tokens)

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
        """Engine counters for operators and tests (DeploymentHandle call). The serving cap in
        effect is ``num_speculative_tokens``, also still under its old key ``gamma``
        (deprecated: read ``num_speculative_tokens``)."""
        snap = self.engine.snapshot()
        cap = self.engine.engine.num_speculative_tokens
        return {"num_waiting": snap.num_waiting, "num_running": snap.num_running,
                "num_finished": snap.num_finished, "num_aborted": snap.num_aborted,
                "num_rejected": snap.num_rejected, "dead": snap.dead,
                "scheduler": self.engine.engine.scheduler_name,
                "num_speculative_tokens": cap, "gamma": cap,
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
            raise dead_error(err) from err
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
                spec_decode_metrics=self._spec_decode_metrics(body),
                min_tokens_per_s=body.min_tokens_per_s))
        except RequestError as err:
            raise request_error(err, chat) from err
        except EngineDeadError as err:
            raise dead_error(err) from err
        timer = RequestTimer(self.metrics, len(prompt_ids), arrival_s)
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
                spec_details=last.spec_details, metrics=last.metrics).model_dump()
        return CompletionResponse(
            id=request_id, created=created, model=self.model_name, usage=usage,
            choices=[CompletionChoice(text=text, finish_reason=last.finish_reason,
                                      logprobs=completion_logprobs(logprobs, self._token_text)
                                      if wants else None)],
            spec_details=last.spec_details, metrics=last.metrics).model_dump()

    def _spec_decode_metrics(self, body) -> str:
        """The level of vLLM's per-request stats this request gets: the deployment's, at least
        ``summary`` for a request that set ``return_spec_details``."""
        level = self.cfg.per_request_spec_decode_metrics
        return "summary" if level == "none" and body.return_spec_details else level

    async def _collect(self, stream: RequestStream, timer: RequestTimer, chat: bool):
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
            raise dead_error(err) from err
        except RequestError as err:  # this request failed alone inside the engine
            timer.finish(last, "error")
            raise request_error(err, chat) from err
        finally:
            stream.abort()  # no-op once finished
            timer.finish(last)
        return "".join(pieces), last, logprobs

    def _token_text(self, token_id: int) -> str:
        """One token's text (logprobs entries)."""
        return self.tokenizer.decode([token_id])

    async def _chat_events(self, stream: RequestStream, request_id: str, created: int,
                           include_usage: bool, timer: RequestTimer):
        def chunk(delta: DeltaMessage, finish_reason=None, usage=None, choices=True,
                  logprobs=None, spec_details=None, metrics=None):
            return sse(ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, usage=usage,
                choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason,
                                         logprobs=logprobs)]
                if choices else [], spec_details=spec_details, metrics=metrics))

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
                yield chunk(DeltaMessage(), choices=False, metrics=last.metrics,
                            usage=Usage.of(stream.num_prompt_tokens, last.num_generated_tokens))
            yield SSE_DONE
        except EngineDeadError as err:
            yield sse(dead_error(err).body())
            yield SSE_DONE
        except RequestError as err:  # this request failed alone: an error event, then done
            timer.finish(last, "error")
            yield sse(request_error(err, True).body())
            yield SSE_DONE
        finally:
            stream.abort()  # client gone (cancelled / closed generator): free the engine slot
            timer.finish(last)

    async def _completion_events(self, stream: RequestStream, request_id: str, created: int,
                                 include_usage: bool, timer: RequestTimer):
        def chunk(text: str, finish_reason=None, usage=None, choices=True, logprobs=None,
                  spec_details=None, metrics=None):
            return sse(CompletionResponse(
                id=request_id, created=created, model=self.model_name, usage=usage,
                choices=[CompletionChoice(text=text, finish_reason=finish_reason,
                                          logprobs=logprobs)]
                if choices else [], spec_details=spec_details, metrics=metrics))

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
                yield chunk("", choices=False, metrics=last.metrics,
                            usage=Usage.of(stream.num_prompt_tokens, last.num_generated_tokens))
            yield SSE_DONE
        except EngineDeadError as err:
            yield sse(dead_error(err).body())
            yield SSE_DONE
        except RequestError as err:
            timer.finish(last, "error")
            yield sse(request_error(err, False).body())
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

        return build_vllm_app(cfg)
    max_ongoing = cfg.max_ongoing_requests or (cfg.engine.max_num_requests
                                               + cfg.engine.max_waiting + 16)
    return SpecServer.options(max_ongoing_requests=max_ongoing,
                              ray_actor_options={"num_cpus": cfg.num_cpus,
                                                 "num_gpus": cfg.num_gpus}
                              ).bind(cfg.model_dump(mode="json"))
