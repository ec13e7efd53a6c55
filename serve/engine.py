"""The speculative decoding engine with continuous batching (SPEC sections 5 and 6).

One engine serves every caller: the Ray Serve app, offline evaluation and the benchmarks all drive
:meth:`SpecEngine.step`. A step:

1. admits waiting requests and takes their next prompt chunks under a token budget (chunked
   prefill: a long prompt is split over several steps, so the running requests keep decoding
   meanwhile); the chunks run in the same packed target pass as step 4, and when a prompt is
   complete its first token, the anchor, is sampled;
2. plans the drafting (``serve/draft_planner.py``, dspark/async): from each request's past rounds,
   which requests the drafter drafts for and how deep, and which verify a free prompt-lookup
   draft instead, so that the drafter's cost is paid only where it raises the step's tokens/s;
3. drafts those blocks in one batched drafter call, turns the drafter's confidence logits into
   calibrated c_k and asks the scheduler (``serve/scheduler.py``) for each request's
   verification length l_r;
4. verifies [anchor, x_1..x_{l_r}] of every request in one packed target forward pass (the
   prompt chunks of step 1 ride in it);
5. rejection-samples each request with its own temperature, top_p and RNG (lossless), commits
   accepted + 1 tokens, applies EOS / stop tokens / stop strings / max_tokens exactly, and keeps
   only the committed positions in the request's target and drafter caches.

Requests join and leave between steps; a finished or aborted request's caches are dropped.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from drafters.sampling import PositionNoise, draw, gumbel_argmax, warped_probs

from . import scheduler as sched
from .config import EngineConfig
from .detokenize import IncrementalDetokenizer
from .draft_planner import AcceptanceEstimate, DraftCostTable, RequestOptions, plan_drafts
from .errors import RequestError, RequestFailedError
from .lookup import NgramIndex
from .metrics import SpecDecodeStats, request_spec_details
from .rejection import verify_coupled, verify_greedy, verify_sampled
from .requests import EngineRequest, RequestOutput, TokenLogprob
from .target_runner import TargetKV, TargetRunner

logger = logging.getLogger(__name__)


@dataclass
class RoundRecord:
    """One verification round of one request: ``drafted`` tokens proposed, ``verified`` l of them
    sent to the target, ``accepted`` n, ``committed`` tokens emitted (n + 1, or fewer when a stop
    or the token budget ends the round), the step's draft and verify seconds, and the raw
    confidence logits z_1..z_drafted (None without a confidence head)."""

    drafted: int
    verified: int
    accepted: int
    committed: int
    draft_s: float
    verify_s: float
    confidence_logits: list[float] | None = None
    source: str | None = None  # "model" (the drafter), "lookup" (prompt lookup) or None


@dataclass
class _PendingContext:
    """Committed positions not yet in the drafter's context (extended lazily, right before the
    request is next drafted for, so a step that drafts nothing costs no drafter work)."""

    features: list = field(default_factory=list)  # [n_i, m*H_t] each
    start: int = 0  # position of the first pending row
    tokens: list = field(default_factory=list)  # the token after each pending position


@dataclass
class _Request:
    req: EngineRequest
    gen: torch.Generator
    detok: IncrementalDetokenizer | None
    kv: TargetKV = field(default_factory=TargetKV)
    draft_state: object = None
    anchor: int = -1
    pos: int = 0  # position of the anchor (committed, not yet run through the target)
    prefilled: int = 0  # prompt tokens already in the target cache (chunked prefill)
    pending: _PendingContext = field(default_factory=_PendingContext)
    model_acc: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    lookup_acc: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    lookup: NgramIndex | None = None
    skipped: int = 0  # steps since the planner last let the drafter draft for this request
    backoff: int = 1  # steps until the next probe
    output: list = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    rounds: list = field(default_factory=list)
    arrival_s: float = 0.0
    first_token_s: float | None = None


@dataclass
class _Pace:
    """Slowly forgetting averages of decoding steps (no prefill in them): seconds per step,
    tokens committed per running request per step, and tokens verified per step (B)."""

    step_s: float | None = None
    tokens_per_step: float = 1.0
    batch_tokens: float = 1.0
    decay: float = 0.9

    def observe(self, step_s: float, tokens_per_step: float, batch_tokens: int) -> None:
        if self.step_s is None:
            self.step_s, self.tokens_per_step, self.batch_tokens = (step_s, tokens_per_step,
                                                                    float(batch_tokens))
            return
        d = self.decay
        self.step_s = d * self.step_s + (1 - d) * step_s
        self.tokens_per_step = d * self.tokens_per_step + (1 - d) * tokens_per_step
        self.batch_tokens = d * self.batch_tokens + (1 - d) * batch_tokens


class SpecEngine:
    """Speculative decoding engine.

    Args:
        target: :class:`TargetRunner` over the target model.
        drafter: a drafter (``drafters.loading.load_drafter``) reading the runner's layers, or
            None (target-only decoding).
        eos_token_ids: tokens that end generation (included in the output).
        config: :class:`EngineConfig`.
        tokenizer: for output text and stop strings (None: token ids only).
        sps: the SPS(B) table the dspark and async schedulers need.
        draft_cost: the drafter's profiled cost (``serve.profiling.engine_profiles``) for goodput
            planning; None = drafting counts as free (the planner still skips requests Algorithm
            1 would not verify).
    Raises:
        ValueError: drafter/target layer mismatch, or a confidence-based scheduler without a
            drafter confidence head or without an SPS table.
    """

    def __init__(self, target: TargetRunner, drafter, eos_token_ids: list[int],
                 config: EngineConfig | None = None, tokenizer=None,
                 sps: sched.SPSTable | None = None, draft_cost: DraftCostTable | None = None):
        self.config = config or EngineConfig()
        if drafter is not None and list(drafter.config.target_layer_ids) != target.layer_ids:
            raise ValueError(f"drafter reads target layers {drafter.config.target_layer_ids}, "
                             f"runner provides {target.layer_ids}")
        name = self.config.scheduler if drafter is not None else "none"
        if name in sched.NEEDS_CONFIDENCE and not getattr(drafter.config, "confidence_head", False):
            raise ValueError(f"scheduler {name!r} needs a drafter with a confidence head "
                             f"({drafter.config.drafter_type} has none): use 'fixed' or 'none'")
        self.scheduler_name = name
        self.target, self.drafter, self.tokenizer, self.sps = target, drafter, tokenizer, sps
        self.draft_cost = draft_cost
        self.plans = drafter is not None and self.config.plans_drafts
        self._probe_credit = 0.0  # seconds of drafter time probes may still spend (probe_budget)
        # the drafter's engine-wide realized acceptance, greedy and sampled: a new request's
        # prior, so that with a drafter that accepts little here every newcomer does not start at
        # 1/2 and pay for drafts until its own rounds say no (slowly forgetting: ~50 rounds).
        # Prompt lookup keeps the neutral prior: its drafts cost nothing to propose.
        self._drafter_prior = [AcceptanceEstimate(decay=0.98), AcceptanceEstimate(decay=0.98)]
        self.lookup_n = self.config.prompt_lookup_max_ngram if self.plans else 0
        if drafter is not None:  # looked up once, not per request per step
            param = next(drafter.parameters())
            self._draft_device, self._draft_dtype = param.device, param.dtype
        self.eos = set(eos_token_ids)
        self.gamma = 0 if drafter is None else self.config.draft_length(drafter.config.block_size)
        self._scheduler = sched.scheduler_for(name, sps=sps, gamma=max(self.gamma, 1),
                                              threshold=self.config.threshold,
                                              max_batch_tokens=self.config.max_batch_tokens)
        wanted_len = self.config.max_model_len or target.model.config.max_position_embeddings
        # the whole KV pool now, never grown under load (serve/kv_pool.py); a request may use
        # what a slot holds, less the draft block its last verification writes past its end
        pool = target.preallocate(self.config.max_num_requests, wanted_len + self.gamma + 1,
                                  int(self.config.kv_cache_memory_gib * 2**30))
        self.max_model_len = min(wanted_len, pool["capacity"] - self.gamma - 1)
        if self.max_model_len < 16:
            raise ValueError(
                f"engine.kv_cache_memory_gib {self.config.kv_cache_memory_gib} holds "
                f"{pool['capacity']} positions per slot for {pool['slots']} slots "
                f"(engine.max_num_requests): a model length of {self.max_model_len} tokens; raise "
                "the budget or lower max_num_requests")
        if self.max_model_len < wanted_len:
            logger.warning("engine.kv_cache_memory_gib %.2f holds %d slots of %d positions: the "
                           "model length is %d tokens, not %d (raise the budget or lower "
                           "max_num_requests)", self.config.kv_cache_memory_gib, pool["slots"],
                           pool["capacity"], self.max_model_len, wanted_len)
        self.waiting: deque[_Request] = deque()
        self.prefilling: list[_Request] = []  # admitted, prompt partly in the cache
        self.running: list[_Request] = []
        self.stats = SpecDecodeStats()
        self._stale: deque[list[list[float]]] = deque(maxlen=2)  # confidences of past steps
        # measured decode speed for admission under speed floors: seconds per decoding step and
        # tokens committed per request per step (slowly forgetting averages), and that step's B
        self._pace = _Pace()

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; it is prefilled at the next step.

        Raises:
            RequestError: empty or too-long prompt (413), bad parameters (400), duplicate id, or
                a full queue (429).
        """
        p = request.params = request.params.normalized()
        if not request.prompt_ids:
            raise RequestError("the prompt is empty", field="prompt")
        if len(request.prompt_ids) + p.max_tokens > self.max_model_len:
            raise RequestError(f"prompt ({len(request.prompt_ids)} tokens) + max_tokens "
                               f"({p.max_tokens}) exceeds the model length {self.max_model_len} "
                               "(engine.max_model_len, or what engine.kv_cache_memory_gib holds)",
                               status=413, field="max_tokens")
        vocab = self.target.model.config.vocab_size
        if any(t >= vocab for t in p.stop_token_ids):
            raise RequestError(f"stop_token_ids must be below the vocabulary size {vocab}",
                               field="stop_token_ids")
        if p.stop and self.tokenizer is None:
            raise RequestError("stop strings need an engine with a tokenizer", field="stop")
        if len(self.waiting) >= self.config.max_waiting + max(
                0, self.config.max_num_requests - self.num_running):
            raise RequestError("the server is at capacity; retry later", status=429)
        if any(r.req.request_id == request.request_id
               for r in (*self.waiting, *self.prefilling, *self.running)):
            raise RequestError(f"duplicate request id {request.request_id!r}", field="request_id")
        seed = p.seed if p.seed is not None else random.getrandbits(63)
        detok = (IncrementalDetokenizer(self.tokenizer, request.prompt_ids, tuple(p.stop),
                                        min_tokens=p.min_tokens)
                 if self.tokenizer is not None else None)
        self.waiting.append(_Request(request, torch.Generator().manual_seed(seed), detok,
                                     arrival_s=time.perf_counter()))

    def abort(self, request_id: str) -> bool:
        """Drop a request (e.g. client disconnect); its caches are freed. Returns whether it
        existed."""
        for queue in (self.waiting, self.prefilling, self.running):
            for r in list(queue):
                if r.req.request_id == request_id:
                    queue.remove(r)
                    r.kv.release()
                    return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Admitted requests: decoding or still prefilling."""
        return len(self.running) + len(self.prefilling)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()  # no autograd bookkeeping at all: a few % per step on CPU
    def step(self) -> list[RequestOutput]:
        """Run one engine step (admit + one speculative round for the running requests).

        Returns:
            one :class:`RequestOutput` per request that emitted tokens or finished.
        """
        start = time.perf_counter()
        decoding = list(self.running)
        while (self.waiting and self.num_running < self.config.max_num_requests
               and self._floors_allow_one_more()):
            self.prefilling.append(self.waiting.popleft())
        # the prompt chunks ride in the verification pass (one packed pass a step: a separate
        # prefill pass would pay a pass's fixed cost again whenever a request arrives)
        chunks = self._prefill_chunks() if self.prefilling else []
        batch_before = self.stats.batch_tokens
        outputs, prefill_outs = (self._decode(decoding, chunks) if decoding
                                 else ([], self._prefill_forward(chunks)))
        if decoding and not chunks:  # a pure decoding step: what a running request gets
            committed = sum(len(o.new_token_ids) for o in outputs)
            self._pace.observe(time.perf_counter() - start, committed / len(decoding),
                               self.stats.batch_tokens - batch_before)
        if chunks:
            outputs += self._prefill_finish(chunks, prefill_outs)
        self.stats.steps += 1
        return outputs

    def _floor(self, r: _Request) -> float | None:
        """The request's per-user speed floor (tokens/s): its own, else the engine's."""
        own = r.req.min_tokens_per_s
        return own if own is not None else self.config.min_tokens_per_s

    def _floors_allow_one_more(self) -> bool:
        """Admission under speed floors: admit the next waiting request only while the measured
        per-request speed, rescaled to one more request's batch by SPS(B) (the step time grows as
        1 / SPS), stays at or above every floor among the running requests and the newcomer.
        Always true without floors, without a measurement yet, or with nothing running."""
        floors = [f for f in map(self._floor, (*self.running, *self.prefilling, self.waiting[0]))
                  if f is not None]
        pace = self._pace
        if not floors or not self.running or pace.step_s is None:
            return True
        running = len(self.running) + len(self.prefilling)
        batch = pace.batch_tokens * (running + 1) / max(len(self.running), 1)
        step_s = pace.step_s
        if self.sps is not None:
            now = self.sps.sps(min(max(1, round(pace.batch_tokens)), self.sps.max_tokens))
            then = self.sps.sps(min(max(1, round(batch)), self.sps.max_tokens))
            step_s *= now / then
        else:  # no profile: time proportional to the batch (pessimistic while memory-bound)
            step_s *= batch / max(pace.batch_tokens, 1.0)
        return pace.tokens_per_step / step_s >= max(floors)

    def _prefill_chunks(self) -> list[tuple[_Request, int]]:
        """(request, prompt tokens to run now) in admission order, within the step's prefill
        token budget; a prompt longer than what is left is cut (the rest follows next step)."""
        budget, chunks = self.config.max_prefill_tokens, []
        for r in self.prefilling:
            if budget <= 0:
                break
            take = min(len(r.req.prompt_ids) - r.prefilled, budget)
            chunks.append((r, take))
            budget -= take
        return chunks

    def _prefill_inputs(self, chunks: list[tuple[_Request, int]]):
        """(caches, prompt tokens, logits modes) of this step's prefill chunks; reserves each new
        request's whole length in the KV pool first (decoding never grows it)."""
        for r, _ in chunks:
            if r.prefilled == 0:
                self.target.reserve(r.kv, len(r.req.prompt_ids) + r.req.params.max_tokens
                                    + self.gamma + 1)
        return ([r.kv for r, _ in chunks],
                [r.req.prompt_ids[r.prefilled:r.prefilled + take] for r, take in chunks],
                ["last" if r.prefilled + take == len(r.req.prompt_ids) else "none"
                 for r, take in chunks])

    def _prefill_forward(self, chunks: list[tuple[_Request, int]]) -> list:
        """A pass of prefill chunks alone (a step with nothing to decode)."""
        if not chunks:
            return []
        caches, tokens, modes = self._prefill_inputs(chunks)
        return self.target.forward_batch(caches, tokens, with_features=self.drafter is not None,
                                         logits=modes)

    def _prefill_finish(self, chunks: list[tuple[_Request, int]], outs) -> list[RequestOutput]:
        """Commit the prefill chunks' pass outputs: a complete prompt samples its first token and
        joins the running requests; the drafter's pending context grows chunk by chunk."""
        speculate = self.drafter is not None and self.gamma > 0
        completes = [r.prefilled + take == len(r.req.prompt_ids) for r, take in chunks]
        results = []
        for (r, take), done, o in zip(chunks, completes, outs):
            start = r.prefilled
            try:
                o.keep(take)
                r.prefilled += take
                if speculate and r.draft_state is None:
                    r.draft_state = self.drafter.new_draft_state()
                    r.backoff = self.config.probe_interval
                    r.model_acc = AcceptanceEstimate(
                        prior=self._drafter_prior[r.req.params.temperature > 0].alpha)
                if not done:  # the drafter's context grows chunk by chunk too
                    if speculate:
                        self._add_pending(r, start, o.features,
                                          r.req.prompt_ids[start + 1:r.prefilled + 1])
                    continue
                self.prefilling.remove(r)
                n = len(r.req.prompt_ids)
                tok = self._sample_one(r, o.logits[-1])
                r.anchor, r.pos = tok, n
                r.first_token_s = time.perf_counter()
                if speculate:
                    self._add_pending(r, start, o.features, r.req.prompt_ids[start + 1:] + [tok])
                    if self.lookup_n:
                        r.lookup = NgramIndex(r.req.prompt_ids + [tok], self.lookup_n,
                                              self.config.prompt_lookup_min_ngram)
                results.append(self._with_details(
                    r, self._commit(r, [tok], self._logprobs(r, o.logits[-1:], [tok]))))
            except Exception as err:  # noqa: BLE001 - this request fails, the engine goes on
                results.append(self._fail(r, err, "prefill"))
                continue
            if r.finish_reason is None:
                self.running.append(r)
        return results

    def _fail(self, r: _Request, err: Exception, where: str) -> RequestOutput:
        """End one request whose own processing raised; the others are untouched (its caches are
        dropped with it)."""
        logger.exception("request %s failed during %s; the engine continues", r.req.request_id,
                         where)
        for queue in (self.prefilling, self.running):
            if r in queue:
                queue.remove(r)
        r.finish_reason = "error"
        r.kv.release()
        self.stats.failed_requests += 1
        error = RequestFailedError(f"the request failed during {where}: {type(err).__name__}: {err}")
        return RequestOutput(r.req.request_id, [], "", True, "error", len(r.req.prompt_ids),
                             len(r.output), error)

    def _caps(self, reqs: list[_Request]) -> list[int]:
        """The most draft tokens each request may verify: gamma, one less than its remaining
        budget (a fully accepted block adds a bonus token), and the drafter's context limit."""
        if self.scheduler_name == "none":
            return [0] * len(reqs)
        limit = self.drafter.config.max_position_embeddings
        out = []
        for r in reqs:
            room = r.req.params.max_tokens - len(r.output) - 1
            l = max(0, min(self.gamma, room))
            out.append(0 if r.pos + l >= limit else l)  # beyond its context: target-only steps
        return out

    def _add_pending(self, r: _Request, start: int, features: torch.Tensor,
                     next_tokens: list[int]) -> None:
        """Queue committed positions start.. (their target features [n, m*H_t] and the token
        after each) for the drafter's context."""
        if not r.pending.features:
            r.pending.start = start
        # a copy: a slice would keep the whole packed batch output of this step alive
        r.pending.features.append(features.to(device=self._draft_device, dtype=self._draft_dtype,
                                              copy=True))
        r.pending.tokens += next_tokens

    def _flush_pending(self, r: _Request) -> None:
        """Extend the request's draft context with everything committed since its last draft."""
        p = r.pending
        if not p.features:
            return
        dev = self._draft_device
        feats = torch.cat(p.features)[None]
        n = feats.shape[1]
        self.drafter.extend_context(r.draft_state, feats,
                                    torch.arange(p.start, p.start + n, device=dev)[None],
                                    torch.tensor(p.tokens, device=dev)[None])
        r.pending = _PendingContext()

    def _plan(self, reqs: list[_Request], caps: list[int]):
        """Per request: (source, depth, lookup tokens, predicted confidences of a lookup draft,
        probed) from the goodput planner, or gamma from the drafter for every request without it."""
        if not self.plans:
            return [("model" if c > 0 else None, c, [], [], False) for c in caps]
        options, looks = [], []
        for r, cap in zip(reqs, caps):
            look = r.lookup.propose(cap) if r.lookup is not None and cap > 0 else []
            looks.append(look)
            options.append(RequestOptions(cap, r.model_acc.alpha if cap > 0 else None, len(look),
                                          r.lookup_acc.alpha, probe_due=r.skipped >= r.backoff,
                                          pending=len(r.pending.tokens)))
        sampled = any(r.req.params.temperature > 0 for r in reqs)
        plan = plan_drafts(options, self.sps, self.draft_cost, sampled,
                           self.config.max_batch_tokens, probe_allowance_s=self._probe_credit,
                           min_gain=self.config.min_draft_gain)
        # the budget grows by its share of a target-only step of this batch (a prediction, so
        # the plan stays a function of the past only), up to one full-depth call for everyone
        ceiling = (self.draft_cost.seconds(len(reqs), self.draft_cost.max_depth, sampled)
                   if self.draft_cost is not None else 0.0)
        self._probe_credit = min(ceiling, self._probe_credit - plan.probe_cost_s
                                 + self.config.probe_budget / self.sps.sps(len(reqs)))
        return [(plan.sources[i], plan.depths[i], looks[i], plan.lookup_confidences[i],
                 plan.probed[i]) for i in range(len(reqs))]

    def _decode(self, reqs: list[_Request], chunks: list[tuple[_Request, int]]):
        """One speculative round for the running ``reqs``, the prefill ``chunks`` packed into the
        same target pass; returns (their outputs, the chunks' pass outputs)."""
        t0 = time.perf_counter()
        caps = self._caps(reqs)
        plan = self._plan(reqs, caps)
        tokens = [list(look[:depth]) if src == "lookup" else [] for src, depth, look, _, _ in plan]
        probs: list = [None] * len(reqs)
        conf_logits: list = [None] * len(reqs)
        confidences = [list(conf) for _, _, _, conf, _ in plan]
        drafting = [i for i, (src, depth, _, _, _) in enumerate(plan) if src == "model" and depth]
        failed: dict[int, Exception] = {}
        if drafting:
            depths = [plan[i][1] for i in drafting]
            rows = [reqs[i] for i in drafting]
            dev = self._draft_device
            anchors = torch.tensor([r.anchor for r in rows], device=dev)
            positions = torch.tensor([r.pos for r in rows], device=dev)
            temps = torch.tensor([r.req.params.temperature for r in rows])
            top_p = torch.tensor([r.req.params.top_p for r in rows])
            gens = [self._noise(r) or r.gen for r in rows]
            try:
                props = [self._propose(rows, anchors, positions, depths, temps, gens, top_p)]
                owners = [list(range(len(rows)))]
            except Exception:  # noqa: BLE001 - find the request(s) at fault, row by row
                logger.exception("batched drafting failed; retrying its %d rows one by one",
                                 len(rows))
                props, owners = [], []
                for j, r in enumerate(rows):
                    sl = slice(j, j + 1)
                    try:
                        props.append(self._propose([r], anchors[sl], positions[sl], depths[sl],
                                                   temps[sl], gens[sl], top_p[sl]))
                        owners.append([j])
                    except Exception as err:  # noqa: BLE001 - only this request fails
                        failed[drafting[j]] = err
            for prop, js in zip(props, owners):
                for jj, j in enumerate(js):
                    i, d = drafting[j], depths[j]
                    tokens[i] = prop.tokens[jj, :d].tolist()
                    if prop.probs is not None:
                        probs[i] = prop.probs[jj, :d]
                    if prop.confidence_logits is not None:
                        z = prop.confidence_logits[jj, :d]
                        conf_logits[i] = z.tolist()
                        confidences[i] = self.drafter.calibrated_confidence(z.float()).tolist()
        results = []
        if failed:
            for i in sorted(failed, reverse=True):
                results.append(self._fail(reqs[i], failed[i], "drafting"))
                for seq in (reqs, tokens, probs, conf_logits, confidences, plan, caps):
                    del seq[i]
            if not reqs:
                return results, self._prefill_forward(chunks)
        lengths = self._schedule(confidences, [len(t) for t in tokens],
                                 [self._floor(r) for r in reqs])
        t1 = time.perf_counter()
        verify_in = [[r.anchor] + tokens[i][:lengths[i]] for i, r in enumerate(reqs)]
        caches, prompt_tokens, modes = self._prefill_inputs(chunks) if chunks else ([], [], [])
        outs = self.target.forward_batch([r.kv for r in reqs] + caches, verify_in + prompt_tokens,
                                         with_features=self.drafter is not None,
                                         logits=["all"] * len(reqs) + modes)
        outs, prefill_outs = outs[:len(reqs)], outs[len(reqs):]
        self.stats.batch_tokens += sum(len(v) for v in verify_in)
        for i, (r, o) in enumerate(zip(reqs, outs)):
            try:
                out = self._finish_round(r, o, lengths[i], plan[i], tokens[i], probs[i],
                                         conf_logits[i], confidences[i], caps[i], t0, t1)
            except Exception as err:  # noqa: BLE001 - this request fails, the engine goes on
                out = self._fail(r, err, "verification")
            results.append(out)
        self._stale.append(confidences)
        return results, prefill_outs

    def _propose(self, rows: list[_Request], anchors, positions, depths: list[int], temps, gens,
                 top_p):
        """One drafter call for ``rows`` (their pending context extended first)."""
        for r in rows:
            self._flush_pending(r)
        if len(rows) == 1:
            return self.drafter.propose_block(rows[0].draft_state, anchors, positions, depths[0],
                                              temps, gens, top_p)
        # each row draws only its own depth's worth of randomness: a request's output never
        # depends on who else is in the batch
        return self.drafter.propose_block_batch([r.draft_state for r in rows], anchors, positions,
                                                max(depths), temps, gens, top_p,
                                                torch.tensor(depths))

    def _finish_round(self, r: _Request, o, l: int, plan_row, row_tokens: list[int], row_probs,
                      row_conf_logits, row_confidences: list[float], cap: int, t0: float,
                      t1: float) -> RequestOutput:
        """Verify, commit and book-keep one request's round (everything that is its own)."""
        source, probed = plan_row[0], plan_row[4]
        draft = torch.tensor(row_tokens[:l], dtype=torch.long)
        n, nxt = self._verify(r, draft, None if row_probs is None else row_probs[:l], o.logits,
                              one_hot=source == "lookup")
        committed = draft[:n].tolist() + [nxt]
        before = len(r.output)
        out = self._commit(r, committed, self._logprobs(r, o.logits[:n + 1], committed))
        kept = len(r.output) - before
        t2 = time.perf_counter()
        r.rounds.append(RoundRecord(len(row_tokens), l, min(n, kept), kept, t1 - t0, t2 - t1,
                                    row_conf_logits, source if row_tokens else None))
        self.stats.record_round(len(row_tokens), l, min(n, kept), kept)
        if r.finish_reason is not None:
            self.running.remove(r)
            return self._with_details(r, out)
        self._learn(r, source, cap, row_confidences, l, n, probed)
        # keep the anchor and the accepted drafts; rejected positions never enter a cache
        o.keep(n + 1)
        if self.drafter is not None:
            self._add_pending(r, r.pos, o.features[:n + 1], committed)
        if r.lookup is not None:
            r.lookup.extend(committed)
        r.anchor, r.pos = nxt, r.pos + n + 1
        return out

    def _learn(self, r: _Request, source, cap: int, confidences: list[float], verified: int,
               accepted: int, probed: bool) -> None:
        """Update the request's acceptance estimates and probe back-off after a round (planner).

        Both sources learn from what verification saw (accepted n of l verified: n successes in
        n + [n < l] trials). A drafter round the scheduler did not verify (l = 0) still informs
        the drafter's alpha through its calibrated confidences (expected successes sum_j a_j over
        expected trials sum_j a_{j-1}). Realized outcomes come first because a confidence head
        calibrated on other data can be optimistic on this request's domain (measured: chat at
        T = 1), and an optimistic alpha keeps paying for drafts that are rejected. Realized
        drafter outcomes also feed the engine-wide prior that requests admitted later start
        from."""
        if not self.plans:
            return
        if source == "model":
            if verified:
                r.model_acc.update(accepted, accepted + (accepted < verified))
                self._drafter_prior[r.req.params.temperature > 0].update(  # realized only
                    accepted, accepted + (accepted < verified))
            elif confidences:
                survival, reach = 1.0, 0.0
                for c in confidences:
                    reach += survival
                    survival *= c
                r.model_acc.update(reach - 1.0 + survival, reach)
            r.skipped = 0
            r.backoff = (min(2 * r.backoff, self.config.max_probe_interval) if probed
                         else self.config.probe_interval)
        elif source == "lookup":
            if verified:
                r.lookup_acc.update(accepted, accepted + (accepted < verified))
        elif cap > 0:
            r.skipped += 1

    def _schedule(self, confidences: list[list[float]], caps: list[int],
                  floors: list[float | None] | None = None) -> list[int]:
        """Per-request verification lengths from the configured policy, clipped to the drafts.

        Rows without confidences (a drafter without a confidence head, under fixed or none) are
        given placeholder ones: those policies read only the row lengths."""
        rows = [c if len(c) == n else [1.0] * n for c, n in zip(confidences, caps)]
        stale = None
        if self.scheduler_name == "async":  # capacity from two steps earlier (section 5.2)
            stale = self._stale[0] if len(self._stale) == 2 else None
            if stale is not None and not any(stale):
                # nothing was drafted then (the planner skipped the drafter): like the warm-up,
                # Algorithm 1 on the current confidences (the choice depends on the past only)
                stale = None
        lengths = [min(l, c) for l, c in zip(self._scheduler(rows, stale), caps)]
        if (floors and any(f is not None for f in floors) and self.sps is not None
                and self.scheduler_name in sched.NEEDS_CONFIDENCE):
            # requests predicted below their speed floor get verification first (lossless)
            lengths = sched.hold_speed_floors([row[:c] for row, c in zip(rows, caps)], lengths,
                                              self.sps, floors, self.config.max_batch_tokens)
        return lengths

    def _verify(self, r: _Request, draft: torch.Tensor, draft_probs, logits: torch.Tensor,
                one_hot: bool = False):
        """Rejection-sample the round; ``one_hot``: the draft is deterministic (prompt lookup),
        so its draft distribution puts probability 1 on each drafted token."""
        p = r.req.params
        logits = self._mask_early_stops(r, logits)
        if p.temperature <= 0:
            return verify_greedy(draft, logits)
        target_probs = self._target_probs(r, logits)
        noise = self._noise(r)
        if noise is not None:  # a seeded request: the same output under any plan
            return verify_coupled(draft, target_probs, noise)
        if one_hot:
            draft_probs = torch.zeros_like(target_probs[:draft.numel()])
            draft_probs[torch.arange(draft.numel()), draft.to(draft_probs.device)] = 1.0
        elif draft_probs is None:
            draft_probs = target_probs[:0]
        return verify_sampled(draft, draft_probs, target_probs, r.gen)

    def _noise(self, r: _Request) -> PositionNoise | None:
        """The position-keyed noise a seeded sampled request draws with when a drafter is
        loaded (``drafters.sampling.PositionNoise``), starting at its next output position; None
        for the others. Target-only decoding keeps one uniform per token from the request's own
        stream (``draw``): without drafting, that stream is consumed the same way under any load,
        and it costs a fraction of a Gumbel draw over the vocabulary."""
        p = r.req.params
        if (p.seed is None or p.temperature <= 0 or self.drafter is None
                or self.config.seeded_sampling != "load_invariant"):
            return None
        return PositionNoise(p.seed, len(r.output), self.target.model.config.vocab_size)

    def _sample_one(self, r: _Request, logits: torch.Tensor) -> int:
        p = r.req.params
        logits = self._mask_early_stops(r, logits[None])
        if p.temperature <= 0:
            return int(logits[0].argmax())
        probs = self._target_probs(r, logits)
        noise = self._noise(r)
        if noise is not None:
            return gumbel_argmax(probs[0], noise.gumbel(0))
        return draw(probs[0], r.gen)

    def _target_probs(self, r: _Request, logits: torch.Tensor) -> torch.Tensor:
        """The request's warped target distribution, fp32 [rows, V] (temperature, min_p, top_k,
        top_p: ``drafters.sampling.warped_probs``)."""
        p, rows, dev = r.req.params, logits.shape[0], logits.device
        return warped_probs(logits, torch.full((rows,), p.temperature, device=dev),
                            torch.full((rows,), p.top_p, device=dev),
                            torch.full((rows,), p.top_k, device=dev, dtype=torch.long)
                            if p.top_k else None,
                            torch.full((rows,), p.min_p, device=dev) if p.min_p else None)

    def _mask_early_stops(self, r: _Request, logits: torch.Tensor) -> torch.Tensor:
        """min_tokens: the target may not emit EOS or a stop token id at the rows [rows, V] whose
        token would be output number < min_tokens (row j emits output number len(output) + j).
        Masking the target's own distribution keeps verification exact."""
        p = r.req.params
        masked = min(logits.shape[0], p.min_tokens - len(r.output))
        if masked <= 0:
            return logits
        banned = torch.tensor(sorted(self.eos | set(p.stop_token_ids)), dtype=torch.long,
                              device=logits.device)
        if banned.numel() == 0:
            return logits
        logits = logits.clone()
        logits[:masked, banned] = float("-inf")
        return logits

    def _logprobs(self, r: _Request, logits: torch.Tensor, tokens: list[int]):
        """TokenLogprob of each token (row j of ``logits`` [len(tokens), V] predicted tokens[j]),
        from the raw target logits of the verification pass; None unless the request asked."""
        k = r.req.params.logprobs
        if k is None:
            return None
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = lp[torch.arange(len(tokens), device=lp.device),
                    torch.tensor(tokens, device=lp.device)].tolist()
        if k:
            values, ids = lp.topk(k, dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        else:
            tops = [()] * len(tokens)
        return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops)]

    def _commit(self, r: _Request, tokens: list[int], logprobs=None) -> RequestOutput:
        """Append committed tokens, ending exactly at EOS / a stop token (included), a stop string
        (excluded from the text; tokens after the one completing it are dropped) or max_tokens;
        ``logprobs`` (one per token, or None) are trimmed alike."""
        p = r.req.params
        room = p.max_tokens - len(r.output)
        keep = tokens[:room]
        reason = "length" if len(tokens) >= room else None
        for i, tok in enumerate(keep):
            if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
                keep, reason = keep[:i + 1], "stop"
                break
        text = ""
        if r.detok is not None:
            res = r.detok.add(keep)
            text = res.text
            if res.stopped:
                keep, reason = keep[:res.num_tokens_kept], "stop"
            elif reason is not None:
                text += r.detok.finish()
        r.output += keep
        r.text += text
        r.finish_reason = reason
        if reason is not None:  # its KV slot serves the next request now, not at collection
            r.kv.release()
        return RequestOutput(r.req.request_id, keep, text, reason is not None, reason,
                             len(r.req.prompt_ids), len(r.output),
                             logprobs=None if logprobs is None else logprobs[:len(keep)])

    @staticmethod
    def _with_details(r: _Request, out: RequestOutput) -> RequestOutput:
        """A finished output carries the request's speculation summary when it asked."""
        if out.finished and r.req.return_spec_details:
            out.spec_details = request_spec_details(r.rounds)
        return out

    def generate(self, requests: list[EngineRequest]) -> list["Completion"]:
        """Offline use: add ``requests``, step until all finish, return them in order.

        Raises:
            RequestError: a request is rejected by :meth:`add_request`.
        """
        start = time.perf_counter()
        states = []
        for req in requests:
            self.add_request(req)
            states.append(self.waiting[-1])
        while any(s.finish_reason is None for s in states):
            self.step()
        end = time.perf_counter()
        return [Completion(s.req.request_id, s.output, s.text, s.finish_reason, s.rounds,
                           s.first_token_s - s.arrival_s, end - start) for s in states]


@dataclass
class Completion:
    """A finished request (offline :meth:`SpecEngine.generate`): tokens (EOS included when it
    ended the output), text, finish_reason, rounds, time to first token and total seconds."""

    request_id: str
    tokens: list[int]
    text: str
    finish_reason: str
    rounds: list[RoundRecord]
    first_token_s: float
    total_s: float
