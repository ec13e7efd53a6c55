"""Chunked prefill (SPEC 5, step 1): which prompt tokens run this step within the step's prefill
token budget, and what the target pass needs for them.

A long prompt is split over several steps so that the running requests keep decoding meanwhile.
The chunks ride in the step's verification pass (one packed pass a step: a separate prefill pass
would pay a pass's fixed cost again whenever a request arrives); a step with nothing to decode
runs them alone. The engine commits their outputs (``SpecEngine._prefill_finish``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .request_state import RequestState
from .target_runner import TargetRunner


@dataclass
class PrefillChunk:
    """``take`` prompt tokens of ``request`` run this step, from position ``request.prefilled``."""

    request: RequestState
    take: int

    @property
    def tokens(self) -> list[int]:
        r = self.request
        return r.req.prompt_ids[r.prefilled:r.prefilled + self.take]

    @property
    def completes(self) -> bool:
        """Whether the chunk ends the prompt (read before ``prefilled`` advances past it)."""
        return self.request.prefilled + self.take == len(self.request.req.prompt_ids)


def prefill_chunks(prefilling: list[RequestState], budget_tokens: int) -> list[PrefillChunk]:
    """The step's chunks in admission order within ``budget_tokens``; a prompt longer than what is
    left is cut (the rest follows next step)."""
    chunks = []
    for r in prefilling:
        if budget_tokens <= 0:
            break
        take = min(len(r.req.prompt_ids) - r.prefilled, budget_tokens)
        chunks.append(PrefillChunk(r, take))
        budget_tokens -= take
    return chunks


def prefill_inputs(target: TargetRunner, chunks: list[PrefillChunk], extra_positions: int):
    """(caches, prompt tokens, logits modes) of the chunks for ``TargetRunner.forward_batch``;
    reserves each new request's whole length in the KV pool first (decoding never grows it):
    prompt + max_tokens + ``extra_positions`` (the draft block its last verification writes past
    its end). Only a chunk that completes its prompt asks for logits (of its last position)."""
    for c in chunks:
        r = c.request
        if r.prefilled == 0:
            target.reserve(r.kv, len(r.req.prompt_ids) + r.req.params.max_tokens + extra_positions)
    return ([c.request.kv for c in chunks], [c.tokens for c in chunks],
            ["last" if c.completes else "none" for c in chunks])


def prefill_forward(target: TargetRunner, chunks: list[PrefillChunk], extra_positions: int,
                    with_features: bool) -> list:
    """A target pass of the chunks alone (a step with nothing to decode); [] without chunks.
    A chunk whose own pass raises gets the exception as its output
    (:meth:`TargetRunner.forward_isolated`)."""
    if not chunks:
        return []
    caches, tokens, modes = prefill_inputs(target, chunks, extra_positions)
    return target.forward_isolated(caches, tokens, with_features=with_features, logits=modes)
