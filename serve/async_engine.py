"""An asyncio front end for one :class:`serve.engine.core.SpecEngine` (no Ray; the Serve app and any
other asyncio server use it).

The engine is single-threaded by contract (vLLM v1's ``EngineCore`` busy loop plus
``AsyncLLM`` output queues, reduced to one process): a background thread owns the
:class:`SpecEngine` and is the only caller of ``add_request`` / ``abort`` / ``step``. Event-loop
code talks to it through a command queue that the thread drains between steps, so engine calls
never race and a slow step never blocks the event loop:

* ``add_request`` enqueues an "add" command and awaits its verdict, so a rejection
  (:class:`RequestError` with ``.status``: 400 bad parameter, 413 prompt + max_tokens beyond the
  model length, 429 queue full) raises before any output is streamed;
* outputs of each step are handed to the per-request ``asyncio.Queue`` of their stream through one
  ``loop.call_soon_threadsafe`` per step;
* closing or cancelling a stream before it finished (client disconnect) enqueues an "abort": the
  engine drops the request and frees its caches at the next step boundary;
* when ``step()`` raises, the engine is dead: every in-flight and queued request fails with
  :class:`EngineDeadError`, later requests are refused with it and :meth:`check_health` raises it
  (SPEC/STYLE section 2 item 14: fatal errors are typed, the step failure is logged with a summary,
  never prompt text).

The thread sleeps on an event while no request is unfinished. After every step it publishes an
immutable :class:`EngineSnapshot` (queue length, running requests, a copy of the raw
:class:`SpecDecodeStats` counters) that any thread may read; metrics exporters turn differences of
successive snapshots into counter increments (:func:`stats_delta`,
:func:`rounds_by_verified_length`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from .engine.errors import EngineDeadError, RequestError
from .heap import HeapTrimmer
from .engine.metrics import SpecDecodeStats
from .engine.requests import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state published by the engine thread after each step (read from any thread).

    num_waiting: requests queued for admission (the queue length, requests); num_running: requests
    being decoded (requests); num_finished / num_aborted / num_rejected: requests since start that
    finished, were aborted (client gone) or were refused by ``add_request``; stats: a copy of the
    engine's raw counters; dead: the engine loop failed; time_s: ``time.monotonic()`` of the
    snapshot (s).
    """

    num_waiting: int = 0
    num_running: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_rejected: int = 0
    stats: SpecDecodeStats = dataclasses.field(default_factory=SpecDecodeStats)
    dead: bool = False
    time_s: float = 0.0
    kv_pool: dict = dataclasses.field(default_factory=dict)  # the target KV pool's state


def copy_stats(stats: SpecDecodeStats) -> SpecDecodeStats:
    return dataclasses.replace(stats, verified_per_position=list(stats.verified_per_position),
                               accepted_per_position=list(stats.accepted_per_position),
                               reached_per_position=list(stats.reached_per_position))


def stats_delta(prev: SpecDecodeStats, cur: SpecDecodeStats) -> SpecDecodeStats:
    """Counters accumulated between two snapshots of one engine (``cur - prev``, per field and per
    position; positions that appeared since ``prev`` count from 0)."""

    def sub(a: list, b: list) -> list:
        return [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]

    scalars = {f.name: getattr(cur, f.name) - getattr(prev, f.name)
               for f in dataclasses.fields(SpecDecodeStats) if f.type in ("int", int)}
    return SpecDecodeStats(**scalars,
                           verified_per_position=sub(cur.verified_per_position,
                                                     prev.verified_per_position),
                           accepted_per_position=sub(cur.accepted_per_position,
                                                     prev.accepted_per_position),
                           reached_per_position=sub(cur.reached_per_position,
                                                    prev.reached_per_position))


def rounds_by_verified_length(delta: SpecDecodeStats) -> dict[int, int]:
    """How many rounds verified exactly l draft tokens (l = the scheduler's verification budget of
    one request in one step, SPEC 6), recovered exactly from the counters: rounds with l >= k is
    ``verified_per_position[k - 1]`` and rounds with l >= 0 is ``rounds``.

    Returns:
        {l: rounds}, only non-zero counts.
    """
    at_least = [delta.rounds, *delta.verified_per_position]
    out = {}
    for length, count in enumerate(at_least):
        exact = count - (at_least[length + 1] if length + 1 < len(at_least) else 0)
        if exact > 0:
            out[length] = exact
    return out


class RequestStream:
    """The outputs of one request, as an async iterator of :class:`RequestOutput` that ends after
    the output with ``finished=True``.

    Raises (from iteration):
        EngineDeadError: the engine failed while the request was in flight.
    """

    def __init__(self, owner: AsyncSpecEngine, request: EngineRequest,
                 loop: asyncio.AbstractEventLoop):
        self.request_id = request.request_id
        self.num_prompt_tokens = len(request.prompt_ids)
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._admitted: asyncio.Future = loop.create_future()
        self._done = False

    @property
    def finished(self) -> bool:
        """The last output was delivered, the stream failed, or it was aborted."""
        return self._done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def abort(self) -> None:
        """Stop the request (idempotent, non-blocking, callable from any thread or a finalizer):
        the engine drops it and frees its caches at the next step boundary."""
        if not self._done:
            self._done = True
            self._owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    def __del__(self):  # a stream dropped unfinished (e.g. a cancelled handler) is aborted
        try:
            self.abort()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -------------------------------------------------- called on the event loop (thread-safe hop)
    def _deliver(self, item) -> None:
        self._queue.put_nowait(item)

    def _resolve_admission(self, error: BaseException | None) -> None:
        if self._admitted.done():
            return
        if error is None:
            self._admitted.set_result(None)
        else:
            self._admitted.set_exception(error)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _deliver_all(pairs: list) -> None:
    for stream, item in pairs:
        stream._deliver(item)


def _resolve_all(pairs: list) -> None:
    for stream, error in pairs:
        stream._resolve_admission(error)


class AsyncSpecEngine:
    """Runs one :class:`SpecEngine` in a background thread and serves it to asyncio code.

    Args:
        engine: the engine; from now on only this object's thread may call it.
        num_threads: torch intra-op threads, set inside the engine thread (None: unchanged).
        name: the thread's name (logs).
        heap_trim_interval_s: seconds between returns of the allocator's free memory to the OS
            (:class:`serve.heap.HeapTrimmer`), done by the engine thread between steps; 0: never.
    """

    def __init__(self, engine, num_threads: int | None = None, name: str = "spec-engine",
                 heap_trim_interval_s: float = 0.0):
        self.engine = engine
        self._num_threads = num_threads
        self.heap = HeapTrimmer(heap_trim_interval_s)
        self._commands: collections.deque = collections.deque()
        # orders "dead / stopping" checks with enqueues; re-entrant because a stream finalizer
        # (RequestStream.__del__ -> abort) may run inside a locked block during GC
        self._cmd_lock = threading.RLock()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._dead: EngineDeadError | None = None
        self._stopping = False
        self._counts = {"finished": 0, "aborted": 0, "rejected": 0, "failed": 0}  # engine thread
        self._snapshot = EngineSnapshot(time_s=time.monotonic())
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------ public (any loop)
    @property
    def max_model_len(self) -> int:
        """Prompt + max_tokens limit in tokens (immutable engine setting)."""
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def add_request(self, request: EngineRequest) -> RequestStream:
        """Submit ``request`` and wait until the engine accepted it (one step at most).

        Returns:
            its :class:`RequestStream`.
        Raises:
            RequestError: refused by :meth:`SpecEngine.add_request` (``.status`` 400 / 413 / 429).
            EngineDeadError: the engine failed or was shut down.
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request, loop)
        self._enqueue(("add", request, stream))
        try:
            await asyncio.shield(stream._admitted)
        except asyncio.CancelledError:
            # the abort is queued behind the add, so the request never runs
            stream._admitted.add_done_callback(_retrieve)
            stream.abort()
            raise
        except BaseException:
            stream._done = True  # refused: nothing to abort
            raise
        return stream

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of ``request`` (one per engine step with new tokens; the last has
        ``finished=True``). Closing or cancelling the iterator early aborts the request.

        Raises:
            RequestError / EngineDeadError: as :meth:`add_request`, before the first output;
            EngineDeadError: the engine failed mid-request.
        """
        stream = await self.add_request(request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request by id (non-blocking; takes effect at the next step boundary)."""
        with self._cmd_lock:
            if self._dead is not None or self._stopping:
                return
            self._commands.append(("abort", request_id))
        self._wake.set()

    def check_health(self) -> None:
        """Raises:
            EngineDeadError: a step failed, or the engine thread is gone."""
        if self._dead is not None:
            raise _fresh(self._dead)
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread has exited")

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def snapshot(self) -> EngineSnapshot:
        """The state after the latest step (thread-safe; an immutable object)."""
        return self._snapshot

    @property
    def num_waiting(self) -> int:
        return self._snapshot.num_waiting

    @property
    def num_running(self) -> int:
        return self._snapshot.num_running

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; in-flight requests fail with EngineDeadError."""
        with self._cmd_lock:
            self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    # --------------------------------------------------------------------------- engine thread
    def _enqueue(self, command: tuple) -> None:
        with self._cmd_lock:
            if self._dead is not None:
                raise _fresh(self._dead)
            if self._stopping:
                raise EngineDeadError("the engine is shut down")
            self._commands.append(command)
        self._wake.set()

    def _run(self) -> None:
        if self._num_threads:
            import torch

            torch.set_num_threads(self._num_threads)
        try:
            while True:
                self._wake.clear()
                self._drain_commands()
                if self._stopping:
                    self._fail_all(EngineDeadError("the engine is shut down"))
                    return
                if not self.engine.has_unfinished():
                    self._publish()
                    self.heap.maybe_trim(idle=True)
                    self._wake.wait()
                    continue
                self._dispatch(self.engine.step())
                self._publish()
                self.heap.maybe_trim()
        except BaseException as err:  # noqa: BLE001 - any step failure kills the engine
            logger.exception("engine step failed (scheduler=%s, running=%d, waiting=%d, step=%d)",
                             getattr(self.engine, "scheduler_name", "?"),
                             self.engine.num_running, self.engine.num_waiting,
                             self.engine.stats.steps)
            dead = EngineDeadError(f"the engine failed: {type(err).__name__}: {err}")
            dead.__cause__ = err
            self._fail_all(dead)

    def _drain_commands(self) -> None:
        admitted: dict = {}
        while True:
            try:
                command = self._commands.popleft()
            except IndexError:
                break
            if command[0] == "add":
                _, request, stream = command
                try:
                    self.engine.add_request(request)
                except Exception as err:  # noqa: BLE001 - returned to the caller, engine lives on
                    self._counts["rejected"] += 1
                    admitted.setdefault(stream._loop, []).append((stream, err))
                    continue
                self._streams[request.request_id] = stream
                admitted.setdefault(stream._loop, []).append((stream, None))
            else:  # ("abort", request_id)
                self._streams.pop(command[1], None)
                if self.engine.abort(command[1]):
                    self._counts["aborted"] += 1
        for loop, pairs in admitted.items():
            _call_soon(loop, _resolve_all, pairs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self._counts["failed" if out.error is not None else "finished"] += 1
            if stream is not None:
                # a request that failed alone raises its own error to its caller only
                by_loop.setdefault(stream._loop, []).append(
                    (stream, out.error if out.error is not None else out))
        for loop, pairs in by_loop.items():
            _call_soon(loop, _deliver_all, pairs)

    def _publish(self) -> None:
        e = self.engine
        self._snapshot = EngineSnapshot(e.num_waiting, e.num_running, self._counts["finished"],
                                        self._counts["aborted"], self._counts["rejected"],
                                        copy_stats(e.stats), self._dead is not None,
                                        time.monotonic(), e.target.kv_pool_state())

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._cmd_lock:
            if isinstance(error, EngineDeadError) and not self._stopping:
                self._dead = error
            pending, self._commands = list(self._commands), collections.deque()
        self._publish()  # before anyone hears of the failure, the snapshot says so
        admissions: dict = {}
        for command in pending:
            if command[0] == "add":
                admissions.setdefault(command[2]._loop, []).append((command[2], _fresh(error)))
        for loop, pairs in admissions.items():
            _call_soon(loop, _resolve_all, pairs)
        by_loop: dict = {}
        for stream in self._streams.values():
            by_loop.setdefault(stream._loop, []).append((stream, _fresh(error)))
        self._streams.clear()
        for loop, pairs in by_loop.items():
            _call_soon(loop, _deliver_all, pairs)


def _fresh(error: EngineDeadError) -> EngineDeadError:
    """A new exception per raise site (one instance raised in many tasks would pile up
    tracebacks), chained to the original failure."""
    copy = EngineDeadError(str(error))
    copy.__cause__ = error.__cause__ or error
    return copy


def _call_soon(loop: asyncio.AbstractEventLoop, fn, pairs: list) -> None:
    try:
        loop.call_soon_threadsafe(fn, pairs)
    except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
        pass


__all__ = ["AsyncSpecEngine", "EngineSnapshot", "RequestStream", "RequestError",
           "EngineDeadError", "stats_delta", "rounds_by_verified_length", "copy_stats"]
