"""Speculative decoding of one request with a DSpark drafter (SPEC section 5), and the target-only
baseline through the same code path (a round with zero draft tokens is a plain decoding step).

Round: draft l <= gamma tokens from the anchor; verify [anchor, x_1..x_l] in one target pass;
rejection-sample (lossless); commit accepted + 1 tokens; an accepted EOS ends generation at once
(no bonus token); output never exceeds ``max_new_tokens``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from drafters.modeling import DSparkDrafter

from .rejection import verify_greedy, verify_sampled
from .target_runner import TargetRunner


@dataclass
class RoundRecord:
    """One verification round: ``drafted`` l, ``accepted`` n, ``committed`` tokens emitted (n + 1,
    or fewer when EOS or the token budget ends the round), times in seconds, and the drafter's raw
    confidence logits z_1..z_l of the drafted tokens (None without a confidence head), which
    calibration (SPEC 4) and the threshold sweep read."""

    drafted: int
    accepted: int
    committed: int
    draft_s: float
    verify_s: float
    confidence_logits: list[float] | None = None


@dataclass
class GenerationResult:
    """Output of :meth:`SpeculativeDecoder.generate`.

    tokens: generated token ids (the EOS token, if any, is the last); finish_reason: ``"stop"``
    (EOS) or ``"length"``; rounds: one record per decoding step after the prefill;
    prefill_s / total_s: wall-clock seconds.
    """

    tokens: list[int]
    finish_reason: str
    rounds: list[RoundRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    total_s: float = 0.0


def _sample(logits: torch.Tensor, temperature: float, generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class SpeculativeDecoder:
    """Decodes one request at a time with a target and an optional drafter.

    Args:
        target: :class:`TargetRunner` over the target model.
        drafter: a :class:`DSparkDrafter` whose ``target_layer_ids`` equal the runner's, or None
            (target-only decoding).
        eos_token_ids: tokens that end generation.
    Raises:
        ValueError: the drafter's layer ids differ from the runner's.
    """

    def __init__(self, target: TargetRunner, drafter: DSparkDrafter | None,
                 eos_token_ids: list[int]):
        if drafter is not None and list(drafter.config.target_layer_ids) != target.layer_ids:
            raise ValueError(f"drafter reads target layers {drafter.config.target_layer_ids}, "
                             f"runner provides {target.layer_ids}")
        self.target = target
        self.drafter = drafter
        self.eos = set(eos_token_ids)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, num_draft_tokens: int | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

        Args:
            prompt_ids: the rendered prompt (chat template applied), non-empty.
            max_new_tokens: hard cap on generated tokens (>= 1).
            temperature: 0 for greedy, else the sampling temperature of target and drafter.
            seed: seeds this request's own RNG.
            num_draft_tokens: tokens drafted per round; None = the drafter's gamma, 0 = target only.
        Raises:
            ValueError: empty prompt or max_new_tokens < 1.
        """
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        gamma = 0 if self.drafter is None else self.drafter.config.block_size
        gamma = gamma if num_draft_tokens is None else min(num_draft_tokens, gamma)
        speculate = gamma > 0
        gen = torch.Generator().manual_seed(seed)
        start = time.perf_counter()

        cache = self.target.new_cache()
        logits, feats = self.target.forward(cache, prompt_ids, with_features=speculate)
        anchor = _sample(logits[-1], temperature, gen)
        pos = len(prompt_ids)  # position of the anchor, not yet run through the target
        dcache = self.drafter.new_draft_state() if speculate else None
        if speculate:
            nxt_tokens = torch.tensor(list(prompt_ids[1:]) + [anchor])[None]
            self.drafter.extend_context(dcache, feats[None], torch.arange(pos)[None], nxt_tokens)
        result = GenerationResult(tokens=[anchor], finish_reason="length",
                                  prefill_s=time.perf_counter() - start)
        if anchor in self.eos:
            result.finish_reason = "stop"
        max_drafter_pos = (self.drafter.config.max_position_embeddings if speculate else 0)

        while result.finish_reason != "stop" and len(result.tokens) < max_new_tokens:
            remaining = max_new_tokens - len(result.tokens)
            l = min(gamma, remaining - 1)
            if pos + l >= max_drafter_pos:  # beyond the drafter's context: target-only steps
                l = 0
            t0 = time.perf_counter()
            draft = torch.empty(0, dtype=torch.long)
            proposal = None
            if l > 0:
                proposal = self.drafter.propose_block(dcache, torch.tensor([anchor]),
                                                      torch.tensor([pos]), l, temperature, gen)
                draft = proposal.tokens[0]
            t1 = time.perf_counter()
            logits, feats = self.target.forward(cache, [anchor] + draft.tolist(),
                                                with_features=speculate)
            if temperature <= 0:
                n, nxt = verify_greedy(draft, logits)
            else:
                target_probs = torch.softmax(logits / temperature, dim=-1)
                draft_probs = proposal.probs[0] if proposal is not None else target_probs[:0]
                n, nxt = verify_sampled(draft, draft_probs, target_probs, gen)
            committed = draft[:n].tolist() + [nxt]
            for i, tok in enumerate(committed):
                if tok in self.eos:  # an accepted EOS ends the round there: no bonus token
                    committed = committed[:i + 1]
                    n = min(n, i + 1)  # drafts after the EOS were never emitted
                    result.finish_reason = "stop"
                    break
            result.tokens.extend(committed)
            if speculate and result.finish_reason != "stop":
                # keep anchor + accepted drafts; rejected positions leave both caches
                self.target.crop(cache, pos + 1 + n)
                self.drafter.extend_context(dcache, feats[None, :n + 1],
                                            torch.arange(pos, pos + n + 1)[None],
                                            torch.tensor(committed)[None])
            anchor, pos = nxt, pos + n + 1
            conf = (None if proposal is None or proposal.confidence_logits is None
                    else proposal.confidence_logits[0].tolist())
            result.rounds.append(RoundRecord(l, n, len(committed), t1 - t0,
                                             time.perf_counter() - t1, conf))
        result.total_s = time.perf_counter() - start
        return result
