"""The drafter's side of a step (SPEC 5, step 3): the request's drafter context, extended lazily
with what it committed, and one batched drafter call for the rows the plan gives the drafter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from drafters.sampling import PositionNoise

from .request_state import PendingContext, RequestState
from .step_plan import PlanRow

logger = logging.getLogger(__name__)


class Drafting:
    """Drafts with ``drafter`` (``drafters.loading.load_drafter``) for the engine's requests."""

    def __init__(self, drafter):
        self.drafter = drafter
        param = next(drafter.parameters())  # looked up once, not per request per step
        self.device, self.dtype = param.device, param.dtype

    def add_pending(self, r: RequestState, start: int, features: torch.Tensor,
                    next_tokens: list[int]) -> None:
        """Queue committed positions start.. (their target features [n, m*H_t] and the token
        after each) for the drafter's context."""
        if not r.pending.features:
            r.pending.start = start
        # a copy: a slice would keep the whole packed batch output of this step alive
        r.pending.features.append(features.to(device=self.device, dtype=self.dtype, copy=True))
        r.pending.tokens += next_tokens

    def flush(self, reqs: list[RequestState]) -> None:
        """Extend the requests' draft contexts with everything each committed since its last
        draft, in one batched drafter call (``extend_context_batch``).

        Raises:
            RuntimeError: a request's pending positions do not start where its draft context
                ends (nothing is extended then); whatever the drafter raises (requests it
                extended fully are done).
        """
        reqs = [r for r in reqs if r.pending.features]
        if not reqs:
            return
        for r in reqs:
            if r.pending.start != r.draft_state.length:  # positions would be misplaced
                raise RuntimeError(f"request {r.req.request_id}: pending context starts at "
                                   f"{r.pending.start}, its draft context holds "
                                   f"{r.draft_state.length} positions")
        try:
            self.drafter.extend_context_batch(
                [r.draft_state for r in reqs], [torch.cat(r.pending.features) for r in reqs],
                [torch.tensor(r.pending.tokens, device=self.device) for r in reqs])
        finally:
            # a call that raised may have extended some requests fully (a drafter extending
            # one request after another): theirs is done, so the row-by-row retry that follows
            # does not see them as broken
            for r in reqs:
                if r.draft_state.length == r.pending.start + len(r.pending.tokens):
                    r.pending = PendingContext()

    def propose(self, rows: list[PlanRow],
                noise: Callable[[RequestState], PositionNoise | None]) -> dict[int, Exception]:
        """Draft for the rows the plan gives the drafter (source "model", num_draft_tokens > 0)
        in one batched call, filling their ``tokens``, ``probs``, ``confidence_logits`` and calibrated
        ``confidences``. If the call raises, the rows are drafted one by one, so only the
        request(s) at fault fail.

        Args:
            rows: the step's plan rows (the others are left as they are).
            noise: a request's position-keyed noise, or None to draw from its own RNG.
        Returns:
            {index into ``rows``: the error} for the rows whose drafting raised.
        """
        drafting = [i for i, row in enumerate(rows) if row.source == "model"
                    and row.num_draft_tokens]
        failed: dict[int, Exception] = {}
        if not drafting:
            return failed
        num_draft_tokens = [rows[i].num_draft_tokens for i in drafting]
        reqs = [rows[i].request for i in drafting]
        anchors = torch.tensor([r.anchor for r in reqs], device=self.device)
        positions = torch.tensor([r.pos for r in reqs], device=self.device)
        temps = torch.tensor([r.req.params.temperature for r in reqs])
        top_p = torch.tensor([r.req.params.top_p for r in reqs])
        gens = [noise(r) or r.gen for r in reqs]
        try:
            props = [self._call(reqs, anchors, positions, num_draft_tokens, temps, gens, top_p)]
            owners = [list(range(len(reqs)))]
        except Exception:  # noqa: BLE001 - find the request(s) at fault, row by row
            logger.exception("batched drafting failed; retrying its %d rows one by one",
                             len(reqs))
            props, owners = [], []
            for j, r in enumerate(reqs):
                sl = slice(j, j + 1)
                try:
                    props.append(self._call([r], anchors[sl], positions[sl], num_draft_tokens[sl],
                                            temps[sl], gens[sl], top_p[sl]))
                    owners.append([j])
                except Exception as err:  # noqa: BLE001 - only this request fails
                    failed[drafting[j]] = err
        for prop, js in zip(props, owners):
            for jj, j in enumerate(js):
                row, d = rows[drafting[j]], num_draft_tokens[j]
                row.tokens = prop.tokens[jj, :d].tolist()
                if prop.probs is not None:
                    row.probs = prop.probs[jj, :d]
                if prop.confidence_logits is not None:
                    z = prop.confidence_logits[jj, :d]
                    row.confidence_logits = z.tolist()
                    row.confidences = self.drafter.calibrated_confidence(z.float()).tolist()
        return failed

    def _call(self, reqs: list[RequestState], anchors, positions, num_draft_tokens: list[int],
              temps, gens, top_p):
        """One drafter call for ``reqs`` (their pending context extended first)."""
        self.flush(reqs)
        if len(reqs) == 1:
            return self.drafter.propose_block(reqs[0].draft_state, anchors, positions,
                                              num_draft_tokens[0], temps, gens, top_p)
        # each row draws only its own num_draft_tokens' worth of randomness: a request's output
        # never depends on who else is in the batch
        return self.drafter.propose_block_batch([r.draft_state for r in reqs], anchors, positions,
                                                max(num_draft_tokens), temps, gens, top_p,
                                                torch.tensor(num_draft_tokens))
