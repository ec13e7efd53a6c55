"""The speculative decoding engine with continuous batching (SPEC sections 5 and 6).

One engine serves every caller: the Ray Serve app, offline evaluation and the benchmarks all drive
:meth:`SpecEngine.step`. A step:

1. **admits** waiting requests (``serve/engine/admission.py``) and takes their next prompt chunks under a
   token budget (chunked prefill, ``serve/engine/prefill.py``); the chunks run in the same packed
   target pass as step 4, and when a prompt is complete its first token, the anchor, is sampled;
2. **plans** each running request's row of the :class:`~serve.engine.step_plan.StepPlan`: the most it
   may verify, and whether the drafter drafts for it and how many tokens or it verifies a free
   prompt-lookup draft instead (``serve/engine/step_plan.py`` over
   ``serve/engine/draft_planner.py``), so that the drafter's cost is paid only where it raises the
   step's tokens/s;
3. **proposes**: the drafter drafts those rows in one batched call (``serve/engine/drafting.py``), its
   confidence logits become calibrated c_k, and the scheduler
   (``serve/engine/scheduler_registry.py``) sets each row's verification length l_r;
4. **verifies** [anchor, x_1..x_{l_r}] of every request in one packed target forward pass (the
   prompt chunks of step 1 ride in it) and rejection-samples each request with its own
   temperature, top_p and RNG, losslessly (``serve/engine/verification.py``);
5. **commits** accepted + 1 tokens, applies EOS / stop tokens / stop strings / max_tokens exactly
   (``serve/engine/commit.py``), and keeps only the committed positions in the request's target and
   drafter caches.

Requests join and leave between steps; a finished or aborted request's caches are dropped.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from .admission import FLOOR_MARGIN, Pace, check_request, observed_speed, size_kv_pool
from .commit import commit_tokens, with_spec_details
from .config import EngineConfig
from .draft_planner import DraftCostTable
from .drafting import Drafting
from .errors import RequestError, RequestFailedError
from .lookup import NgramIndex
from .metrics import SpecDecodeStats
from .prefill import PrefillChunk, prefill_chunks, prefill_forward, prefill_inputs
from .request_state import Completion, RequestState, RoundRecord
from .requests import EngineRequest, RequestOutput
from .scheduler_registry import scheduler_entry
from .sps import SPSTable
from .step_plan import PlanRow, StepPlan, StepPlanner
from .target_runner import TargetRunner
from .verification import Verifier, token_logprobs

__all__ = ["SpecEngine", "RoundRecord", "Completion"]

logger = logging.getLogger(__name__)


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
        draft_cost: the drafter's profiled cost (``serve.engine.profiling.engine_profiles``) for goodput
            planning; None = drafting counts as free (the planner still skips requests Algorithm
            1 would not verify).
    Raises:
        ValueError: drafter/target layer mismatch, or a confidence-based scheduler without a
            drafter confidence head or without an SPS table.
    """

    def __init__(self, target: TargetRunner, drafter, eos_token_ids: list[int],
                 config: EngineConfig | None = None, tokenizer=None,
                 sps: SPSTable | None = None, draft_cost: DraftCostTable | None = None):
        self.config = config or EngineConfig()
        if drafter is not None and list(drafter.config.target_layer_ids) != target.layer_ids:
            raise ValueError(f"drafter reads target layers {drafter.config.target_layer_ids}, "
                             f"runner provides {target.layer_ids}")
        name = self.config.scheduler if drafter is not None else "none"
        if (scheduler_entry(name).reads_confidence
                and not getattr(drafter.config, "confidence_head", False)):
            raise ValueError(f"scheduler {name!r} needs a drafter with a confidence head "
                             f"({drafter.config.drafter_type} has none): use 'fixed' or 'none'")
        self.scheduler_name = name
        self.target, self.drafter, self.tokenizer, self.sps = target, drafter, tokenizer, sps
        self.draft_cost = draft_cost
        # called with "sps" or "draft_cost" when the engine's own steps corrected that profile
        # (the builder marks the stored file to be profiled again; serve/engine/cost_check.py)
        self.on_profile_correction = None
        plans = drafter is not None and self.config.plans_drafts
        self.lookup_n = self.config.prompt_lookup_max_ngram if plans else 0
        self.drafting = Drafting(drafter) if drafter is not None else None
        self.eos = set(eos_token_ids)
        # the serving cap in effect: draft tokens per round at most (0 without a drafter)
        self.num_speculative_tokens = (
            0 if drafter is None else self.config.speculative_tokens(drafter.config.block_size))
        self.planner = StepPlanner(
            self.config, name, self.num_speculative_tokens,
            None if drafter is None else drafter.config.max_position_embeddings, sps, draft_cost,
            plans)
        self.verifier = Verifier(self.eos, target.model.config.vocab_size, drafter is not None
                                 and self.config.seeded_sampling == "load_invariant")
        self.max_model_len = size_kv_pool(target, self.config, self.num_speculative_tokens)
        self.waiting: deque[RequestState] = deque()
        self.prefilling: list[RequestState] = []  # admitted, prompt partly in the cache
        self.running: list[RequestState] = []
        self.stats = SpecDecodeStats()
        # measured decode speed for admission under speed floors: seconds per decoding step,
        # tokens committed per request per step, that step's B (decoding and prompt-chunk
        # tokens) and the requests decoding in it (slowly forgetting averages)
        self._pace = Pace()

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; it is prefilled at the next step.

        Raises:
            RequestError: empty or too-long prompt (413), bad parameters (400), duplicate id, or
                a full queue (429).
        """
        request.params = request.params.normalized()
        check_request(request, self.max_model_len, self.target.model.config.vocab_size,
                      self.tokenizer is not None)
        if len(self.waiting) >= self.config.max_waiting + max(
                0, self.config.max_num_requests - self.num_running):
            raise RequestError("the server is at capacity; retry later", status=429)
        if any(r.req.request_id == request.request_id
               for r in (*self.waiting, *self.prefilling, *self.running)):
            raise RequestError(f"duplicate request id {request.request_id!r}", field="request_id")
        self.waiting.append(RequestState.create(request, self.tokenizer))

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
        """Run one engine step: admit, then plan -> propose -> verify -> commit one speculative
        round for the running requests, the admitted prompts' chunks riding in its target pass.

        Returns:
            one :class:`RequestOutput` per request that emitted tokens or finished.
        """
        start = time.perf_counter()
        self.target.attention = self.config.attention  # the runner may serve other engines too
        decoding = list(self.running)
        self._admit()
        # the prompt chunks ride in the verification pass (one packed pass a step: a separate
        # prefill pass would pay a pass's fixed cost again whenever a request arrives)
        chunks = (prefill_chunks(self.prefilling, self._prefill_budget(len(decoding)))
                  if self.prefilling else [])
        batch_before = self.stats.batch_tokens
        if not decoding:
            self.planner.break_cycle()  # an idle gap or a prefill-only step: no decoding cycle
        outputs, prefill_outs = (self._decode(decoding, chunks) if decoding
                                 else ([], self._prefill_forward(chunks)))
        committed = sum(len(o.new_token_ids) for o in outputs)
        if chunks:
            outputs += self._prefill_finish(chunks, prefill_outs)
        if decoding:
            # what a running request gets, prompt chunks riding in its steps included: a pace
            # of pure decoding steps alone overrated the speed under arrivals (measured: a
            # 12 tokens/s floor admitted 16 streams whose slowest decoded at 6.8)
            self._pace.observe(time.perf_counter() - start, committed / len(decoding),
                               self.stats.batch_tokens - batch_before,
                               sum(c.take for c in chunks), len(decoding))
        self.stats.steps += 1
        return outputs

    def _admit(self) -> None:
        """Move waiting requests to prefilling while slots are free and the floors allow."""
        while (self.waiting and self.num_running < self.config.max_num_requests
               and self._floors_allow_one_more()):
            self.prefilling.append(self.waiting.popleft())

    def _prefill_budget(self, num_decoding: int) -> int:
        """Prompt tokens this step carries: ``max_prefill_tokens``, or under a deployment floor
        what keeps the decoding requests' step within it
        (:meth:`serve.engine.admission.Pace.prefill_budget`)."""
        most = self.config.max_prefill_tokens
        floor = self.config.min_tokens_per_s
        if floor is None:
            return most
        return self._pace.prefill_budget(floor, num_decoding, most, self.sps)

    def _floor(self, r: RequestState) -> float | None:
        """The request's per-user speed floor (tokens/s): its own, else the engine's."""
        own = r.req.min_tokens_per_s
        return own if own is not None else self.config.min_tokens_per_s

    def _planning_floors(self, reqs: list[RequestState]) -> list[float | None]:
        """The speeds (tokens/s) drafting and verification aim each request at: its floor plus
        ``FLOOR_MARGIN`` (the floor is what its slowest steps must give; requests spread around
        the predicted pace, as admission's margin says), None without a floor."""
        return [None if (f := self._floor(r)) is None else f * (1 + FLOOR_MARGIN) for r in reqs]

    def _floors_allow_one_more(self) -> bool:
        """Admission under the deployment's speed floor (``engine.min_tokens_per_s``): no running
        request's own speed so far within ``FLOOR_MARGIN`` of it, and the pace rescaled to one
        more request above it (:meth:`serve.engine.admission.Pace.allows_one_more`). A request's own floor orders
        verification only: admission reading clients' floors would let one client with an
        unreachable floor keep everyone else waiting."""
        floor = self.config.min_tokens_per_s
        if floor is not None:  # a running request already near its floor: no newcomer yet
            now = time.perf_counter()
            for r in self.running:
                speed = observed_speed(len(r.output), r.first_token_s, now)
                if speed is not None and speed < floor * (1 + FLOOR_MARGIN):
                    return False
        return self._pace.allows_one_more([floor] if floor is not None else [],
                                          self.num_running, self.sps)

    def _decode(self, reqs: list[RequestState], chunks: list[PrefillChunk]):
        """One speculative round for the running ``reqs``: plan -> propose -> verify -> commit,
        the prefill ``chunks`` packed into the same target pass; returns (their outputs, the
        chunks' pass outputs)."""
        riding = sum(c.take for c in chunks)
        floors = self._planning_floors(reqs)
        plan_start = time.perf_counter()
        self.planner.start_cycle(plan_start)
        plan = self.planner.plan(reqs, plan_start, riding=riding,
                                 floors=floors if any(f is not None for f in floors) else None)
        draft_start = time.perf_counter()
        outputs = self._propose(plan)
        draft_s = self._elapsed(draft_start) if plan.predicted_draft_s else 0.0
        if not plan.rows:  # every request failed while drafting
            return outputs, self._prefill_forward(chunks)
        self.planner.schedule(plan, self._planning_floors([row.request for row in plan.rows]),
                              riding=riding)
        plan.verify_start_s = time.perf_counter()
        outs, prefill_outs = self._target_pass(plan, chunks)
        # the profiles checked against this step (a prompt chunk in the pass: not comparable)
        verify_tokens = 0 if chunks else sum(row.length + 1 for row in plan.rows)
        verify_s = self._elapsed(plan.verify_start_s)
        self._check_costs(plan, draft_s, verify_tokens, verify_s)
        for i in reversed(range(len(outs))):  # a request whose own target pass raised fails alone
            if isinstance(outs[i], Exception):
                outputs.append(self._fail(plan.rows[i].request, outs[i], "the target pass"))
                del plan.rows[i], outs[i]
        try:  # every sampled request's target distribution at once
            dists = self.verifier.target_distributions([row.request for row in plan.rows],
                                                       [o.logits for o in outs])
        except Exception:  # noqa: BLE001 - each request then warps its own, and fails alone
            logger.debug("batched target distributions failed; warping per request",
                         exc_info=True)
            dists = [None] * len(outs)
        for row, o, dist in zip(plan.rows, outs, dists):
            try:
                outputs.append(self._verify_and_commit(row, o, plan, dist))
            except Exception as err:  # noqa: BLE001 - this request fails, the engine goes on
                outputs.append(self._fail(row.request, err, "verification"))
        self.planner.end_cycle(plan, draft_s, verify_s)
        self.planner.remember(plan)
        return outputs, prefill_outs

    def _elapsed(self, start: float) -> float:
        """Seconds since ``start`` (perf_counter) once the device's queued work is done (on CUDA
        a pass returns before its kernels finish; only then is the time comparable with the
        profiles', which synchronize)."""
        if self.planner.checks_costs and self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
        return time.perf_counter() - start

    def _check_costs(self, plan: StepPlan, draft_s: float, verify_tokens: int,
                     verify_s: float) -> None:
        """The profiles against this step's measured drafter call and target pass
        (``StepPlanner.check_costs``); advisory, so any error in it is logged once and turns the
        check off rather than failing the step's requests."""
        if not self.planner.checks_costs:
            return
        try:
            for name in self.planner.check_costs(plan, draft_s, verify_tokens, verify_s):
                self.sps, self.draft_cost = self.planner.sps, self.planner.draft_cost
                if self.on_profile_correction is not None:
                    self.on_profile_correction(name)
        except Exception:  # noqa: BLE001 - the check must never cost a request
            logger.warning("the profile check failed and is off for this engine", exc_info=True)
            self.planner.checks_costs = False

    def _propose(self, plan: StepPlan) -> list[RequestOutput]:
        """Draft the plan's drafter rows; a request whose drafting raises fails and leaves the
        plan (its output is returned), the others go on."""
        failed = self.drafting.propose(plan.rows, self.verifier.noise) if self.drafting else {}
        outputs = []
        for i in sorted(failed, reverse=True):
            outputs.append(self._fail(plan.rows[i].request, failed[i], "drafting"))
            del plan.rows[i]
        return outputs

    def _target_pass(self, plan: StepPlan, chunks: list[PrefillChunk]):
        """One packed target pass over every row's [anchor, x_1..x_l] (logits at every position)
        and the prefill chunks; returns (the rows' outputs, the chunks' outputs), an exception in
        place of the output of a request whose own pass raised
        (:meth:`TargetRunner.forward_isolated`)."""
        verify_in = [[row.request.anchor] + row.tokens[:row.length] for row in plan.rows]
        block_tokens = self.num_speculative_tokens + 1  # the draft block written past the end
        caches, prompt_tokens, modes = (prefill_inputs(self.target, chunks, block_tokens)
                                        if chunks else ([], [], []))
        outs = self.target.forward_isolated([row.request.kv for row in plan.rows] + caches,
                                            verify_in + prompt_tokens,
                                            with_features=self.drafter is not None,
                                            logits=["all"] * len(plan.rows) + modes)
        self.stats.batch_tokens += sum(len(v) for v in verify_in)
        return outs[:len(plan.rows)], outs[len(plan.rows):]

    def _verify_and_commit(self, row: PlanRow, o, plan: StepPlan,
                           target_probs: torch.Tensor | None = None) -> RequestOutput:
        """Verify, commit and book-keep one request's round (everything that is its own); ``o``
        is its part of the target pass, ``target_probs`` its target distribution if computed
        with the step's others (``Verifier.target_distributions``)."""
        r, l = row.request, row.length
        draft = torch.tensor(row.tokens[:l], dtype=torch.long)
        n, nxt = self.verifier.verify(r, draft, None if row.probs is None else row.probs[:l],
                                      o.logits, one_hot=row.source == "lookup",
                                      target_probs=target_probs)
        committed = draft[:n].tolist() + [nxt]
        before = len(r.output)
        out = commit_tokens(r, committed, self.eos, token_logprobs(r, o.logits[:n + 1], committed))
        kept = len(r.output) - before
        t2 = time.perf_counter()
        r.rounds.append(RoundRecord(len(row.tokens), l, min(n, kept), kept,
                                    plan.verify_start_s - plan.start_s, t2 - plan.verify_start_s,
                                    row.confidence_logits, row.source if row.tokens else None))
        self.stats.record_round(len(row.tokens), l, min(n, kept), kept)
        if r.finish_reason is not None:
            self.running.remove(r)
            return with_spec_details(r, out, self.num_speculative_tokens)
        self.planner.learn(row, n)
        # keep the anchor and the accepted drafts; rejected positions never enter a cache
        o.keep(n + 1)
        if self.drafting is not None:
            self.drafting.add_pending(r, r.pos, o.features[:n + 1], committed)
        if r.lookup is not None:
            r.lookup.extend(committed)
        r.anchor, r.pos = nxt, r.pos + n + 1
        return out

    # ------------------------------------------------------------------ prefill
    def _prefill_forward(self, chunks: list[PrefillChunk]) -> list:
        """The chunks' target pass in a step with nothing to decode (``[]`` without chunks)."""
        return prefill_forward(self.target, chunks, self.num_speculative_tokens + 1,
                               self.drafter is not None)

    def _prefill_finish(self, chunks: list[PrefillChunk], outs) -> list[RequestOutput]:
        """Commit the prefill chunks' pass outputs: a complete prompt samples its first token and
        joins the running requests; the drafter's pending context grows chunk by chunk."""
        speculate = self.drafter is not None and self.num_speculative_tokens > 0
        results = []
        for chunk, o in zip(chunks, outs):
            r, take, done = chunk.request, chunk.take, chunk.completes
            start = r.prefilled
            try:
                if isinstance(o, Exception):  # its own target pass raised
                    raise o
                o.keep(take)
                r.prefilled += take
                if speculate and r.draft_state is None:
                    r.draft_state = self.drafter.new_draft_state()
                    self.planner.start(r)
                if not done:  # the drafter's context grows chunk by chunk too
                    if speculate:
                        self.drafting.add_pending(r, start, o.features,
                                                  r.req.prompt_ids[start + 1:r.prefilled + 1])
                    continue
                self.prefilling.remove(r)
                tok = self.verifier.sample_one(r, o.logits[-1])
                r.anchor, r.pos = tok, len(r.req.prompt_ids)
                r.first_token_s = time.perf_counter()
                if speculate:
                    self.drafting.add_pending(r, start, o.features,
                                              r.req.prompt_ids[start + 1:] + [tok])
                    if self.lookup_n:
                        r.lookup = NgramIndex(r.req.prompt_ids + [tok], self.lookup_n,
                                              self.config.prompt_lookup_min_ngram)
                results.append(with_spec_details(r, commit_tokens(
                    r, [tok], self.eos, token_logprobs(r, o.logits[-1:], [tok])),
                    self.num_speculative_tokens))
            except Exception as err:  # noqa: BLE001 - this request fails, the engine goes on
                results.append(self._fail(r, err, "prefill"))
                continue
            if r.finish_reason is None:
                self.running.append(r)
        return results

    def _fail(self, r: RequestState, err: Exception, where: str) -> RequestOutput:
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

    def generate(self, requests: list[EngineRequest]) -> list[Completion]:
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
        # a request that failed before its first token has no time to it (nan)
        return [Completion(s.req.request_id, s.output, s.text, s.finish_reason, s.rounds,
                           float("nan") if s.first_token_s is None
                           else s.first_token_s - s.arrival_s, end - start) for s in states]
