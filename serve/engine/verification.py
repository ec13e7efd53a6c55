"""Verification of one request's round against the target (SPEC 5, step 5): the request's target
distribution (temperature, min_p, top_k, top_p; min_tokens masking), lossless acceptance of its
draft (greedy, rejection sampling, or position-keyed coupled noise for a seeded request:
``serve/engine/rejection.py``), the first token after its prompt, and the logprobs it asked for.

Shapes: l draft tokens, V the target's vocabulary.
"""

from __future__ import annotations

import torch

from drafters.sampling import PositionNoise, draw, gumbel_argmax, warped_probs

from .rejection import verify_coupled, verify_greedy, verify_sampled
from .request_state import RequestState
from .requests import TokenLogprob


# Rows warped in one call at most (:meth:`Verifier.target_distributions`): a call's temporaries
# are a few [rows, V] fp32 tensors (200 KB a row at V = 49 k), so ~50 MB each at most; the
# distributions themselves are kept until the step's requests are verified, as before.
WARP_ROWS = 256


class Verifier:
    """Turns the target's logits for one request into its accepted tokens.

    Args:
        eos: token ids that end generation (``min_tokens`` holds them off).
        vocab_size: the target's V (position-keyed noise is drawn over it).
        load_invariant: seeded sampled requests draw position-keyed noise, so their output is the
            same under any batch and plan (a drafter is loaded and ``engine.seeded_sampling`` is
            "load_invariant").
    """

    def __init__(self, eos: set[int], vocab_size: int, load_invariant: bool):
        self.eos, self.vocab_size, self.load_invariant = eos, vocab_size, load_invariant

    def verify(self, r: RequestState, draft: torch.Tensor, draft_probs: torch.Tensor | None,
               logits: torch.Tensor, one_hot: bool = False,
               target_probs: torch.Tensor | None = None) -> tuple[int, int]:
        """Rejection-sample the round.

        Args:
            draft: int64 [l] the verified draft tokens.
            draft_probs: fp32 [l, V] the drafter's distributions they were sampled from, or None
                (greedy drafting, or ``one_hot``).
            logits: [l + 1, V] the target's logits after the anchor and after each draft token.
            one_hot: the draft is deterministic (prompt lookup), so its draft distribution puts
                probability 1 on each drafted token.
            target_probs: fp32 [l + 1, V], the request's target distribution if already computed
                (:meth:`target_distributions`, for a whole step at once); None = computed here.
        Returns:
            (accepted n, the target token after the accepted prefix).
        """
        p = r.req.params
        if p.temperature <= 0:
            return verify_greedy(draft, self.mask_early_stops(r, logits))
        if target_probs is None:
            target_probs = target_distribution(r, self.mask_early_stops(r, logits))
        noise = self.noise(r)
        if noise is not None:  # a seeded request: the same output under any plan
            return verify_coupled(draft, target_probs, noise)
        if one_hot:
            draft_probs = torch.zeros_like(target_probs[:draft.numel()])
            draft_probs[torch.arange(draft.numel()), draft.to(draft_probs.device)] = 1.0
        elif draft_probs is None:
            draft_probs = target_probs[:0]
        return verify_sampled(draft, draft_probs, target_probs, r.gen)

    def target_distributions(self, requests: list[RequestState],
                             logits: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Every sampled request's target distribution of a step (what :meth:`verify` would
        compute for each, bit for bit), warped in a few calls over all their rows instead of one
        per request: per request, those calls' fixed cost was a fifth of a 128-request
        target-only step on 2 CPU cores. Requests are grouped by the shape of their warp (the
        top-k limit in effect, whether min-p and top-p apply), so each row takes the code path,
        and the widths, it would take alone and its result does not depend on its neighbours;
        at most ``WARP_ROWS`` rows a call.

        Args:
            requests: R requests; logits: R tensors [rows_j, V] (their part of the target pass).
        Returns:
            R entries: fp32 [rows_j, V] (min_tokens masking applied, ``target_distribution``'s
            warps), or None for a greedy request.
        """
        out: list[torch.Tensor | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for j, r in enumerate(requests):
            p = r.req.params
            if p.temperature > 0:
                k = p.top_k if 0 < p.top_k < logits[j].shape[-1] else 0
                groups.setdefault((k, p.min_p > 0, p.top_p < 1), []).append(j)
        for group in groups.values():
            chunk, rows = [], 0
            for j in group + [None]:  # None: the group's end flushes its last chunk
                if chunk and (j is None or rows + len(logits[j]) > WARP_ROWS):
                    for i, probs in zip(chunk, self._warp_together(
                            [requests[i] for i in chunk], [logits[i] for i in chunk])):
                        out[i] = probs
                    chunk, rows = [], 0
                if j is not None:
                    chunk.append(j)
                    rows += len(logits[j])
        return out

    def _warp_together(self, requests: list[RequestState],
                       logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """One ``warped_probs`` call over the requests' rows, each row with its request's
        parameters; split back per request."""
        masked = [self.mask_early_stops(r, lg) for r, lg in zip(requests, logits)]
        counts = [lg.shape[0] for lg in masked]
        dev = masked[0].device

        def per_row(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=dev).repeat_interleave(
                torch.tensor(counts, device=dev))

        params = [r.req.params for r in requests]
        probs = warped_probs(
            torch.cat(masked), per_row([p.temperature for p in params]),
            per_row([p.top_p for p in params]),
            per_row([p.top_k for p in params], torch.long) if any(p.top_k for p in params)
            else None,
            per_row([p.min_p for p in params]) if any(p.min_p for p in params) else None)
        return list(probs.split(counts))

    def noise(self, r: RequestState) -> PositionNoise | None:
        """The position-keyed noise a seeded sampled request draws with when load invariance is
        on (``drafters.sampling.PositionNoise``), starting at its next output position; None for
        the others. Target-only decoding keeps one uniform per token from the request's own
        stream (``draw``): without drafting, that stream is consumed the same way under any load,
        and it costs a fraction of a Gumbel draw over the vocabulary."""
        p = r.req.params
        if p.seed is None or p.temperature <= 0 or not self.load_invariant:
            return None
        return PositionNoise(p.seed, len(r.output), self.vocab_size)

    def sample_one(self, r: RequestState, logits: torch.Tensor) -> int:
        """The token after a prompt from the target's logits [V] at its last position."""
        p = r.req.params
        logits = self.mask_early_stops(r, logits[None])
        if p.temperature <= 0:
            return int(logits[0].argmax())
        probs = target_distribution(r, logits)
        noise = self.noise(r)
        if noise is not None:
            return gumbel_argmax(probs[0], noise.gumbel(0))
        return draw(probs[0], r.gen)

    def mask_early_stops(self, r: RequestState, logits: torch.Tensor) -> torch.Tensor:
        """min_tokens: the target may not emit a token that would end the output (EOS, unless
        ``ignore_eos``, and the stop token ids: vLLM's set) at the rows [rows, V] whose token
        would be output number < min_tokens (row j emits output number len(output) + j).
        Masking the target's own distribution keeps verification exact."""
        p = r.req.params
        masked = min(logits.shape[0], p.min_tokens - len(r.output))
        if masked <= 0:
            return logits
        ends = (set() if p.ignore_eos else self.eos) | set(p.stop_token_ids)
        banned = torch.tensor(sorted(ends), dtype=torch.long, device=logits.device)
        if banned.numel() == 0:
            return logits
        logits = logits.clone()
        logits[:masked, banned] = float("-inf")
        return logits


def target_distribution(r: RequestState, logits: torch.Tensor) -> torch.Tensor:
    """The request's warped target distribution, fp32 [rows, V] (temperature, min_p, top_k,
    top_p: ``drafters.sampling.warped_probs``)."""
    p, rows, dev = r.req.params, logits.shape[0], logits.device
    return warped_probs(logits, torch.full((rows,), p.temperature, device=dev),
                        torch.full((rows,), p.top_p, device=dev),
                        torch.full((rows,), p.top_k, device=dev, dtype=torch.long)
                        if p.top_k else None,
                        torch.full((rows,), p.min_p, device=dev) if p.min_p else None)


def token_logprobs(r: RequestState, logits: torch.Tensor,
                   tokens: list[int]) -> list[TokenLogprob] | None:
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
