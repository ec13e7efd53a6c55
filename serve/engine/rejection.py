"""Lossless verification of a drafted block: speculative rejection sampling (Leviathan et al. 2023;
Chen et al. 2023; DSpark SPEC section 5).

Terms: of the l draft tokens x_1..x_l, the leading ones that pass are *accepted*; at the first
rejection a *recovered* token is sampled from norm(max(0, p_t - p_d)); if all l pass, a *bonus*
token is sampled from the target's distribution after x_l. Either way exactly one target token
follows the accepted prefix, so a round commits accepted + 1 tokens.

Shapes: l draft tokens, V vocabulary.
"""

from __future__ import annotations

import torch

from drafters.sampling import PositionNoise, draw, gumbel_argmax


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Temperature 0: accept x_k iff it equals the target's argmax.

    Args:
        draft_tokens: int64 [l].
        target_logits: [l + 1, V], the target's logits after the anchor and after each x_k.
    Returns:
        (number accepted n, the target token after the accepted prefix).
    """
    target_tokens = target_logits.argmax(-1).cpu()
    draft_tokens = draft_tokens.cpu()
    l = draft_tokens.numel()
    matches = (draft_tokens == target_tokens[:l]).int()
    n = int(matches.cumprod(0).sum()) if l else 0
    return n, int(target_tokens[n])


def verify_sampled(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                   target_probs: torch.Tensor, generator: torch.Generator | None = None
                   ) -> tuple[int, int]:
    """Temperature > 0: accept x_k with probability min(1, p_t(x_k) / p_d(x_k)), left to right.

    The draft distributions must be exactly those the draft tokens were sampled from, and the
    target distributions must use the same temperature (SPEC 5), else the output is biased.

    Args:
        draft_tokens: int64 [l].
        draft_probs: fp32 [l, V], p_d of each slot.
        target_probs: fp32 [l + 1, V], p_t after the anchor and after each x_k.
        generator: RNG (per request, so requests in one batch never share randomness).
    Returns:
        (number accepted n, recovered or bonus token).
    """
    # the request's generator is a CPU generator: the (small) decision tensors move to the CPU
    target_probs, draft_probs = target_probs.cpu(), draft_probs.cpu()
    draft_tokens = draft_tokens.cpu()
    l = draft_tokens.numel()
    if l:
        idx = torch.arange(l)
        p_t = target_probs[idx, draft_tokens]
        p_d = draft_probs[idx, draft_tokens]
        u = torch.rand(l, generator=generator, dtype=torch.float64)
        accepted = (u * p_d.double() <= p_t.double()).int()
        n = int(accepted.cumprod(0).sum())
    else:
        n = 0
    if n < l:
        residual = (target_probs[n] - draft_probs[n]).clamp(min=0)
        total = residual.sum()
        # A rejection implies p_t(x) < p_d(x), so the residual has mass; the fallback only guards
        # against float round-off when both distributions are numerically equal.
        dist = residual / total if total > 0 else target_probs[n]
    else:
        dist = target_probs[l]
    return n, draw(dist, generator)


def verify_coupled(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                   noise: PositionNoise) -> tuple[int, int]:
    """A seeded request's verification: the target's token at each position is its Gumbel-max
    draw with that position's noise (``drafters.sampling.PositionNoise``), so it does not depend on
    the draft; x_k is accepted iff it equals that token. Lossless like :func:`verify_sampled` (each
    emitted token is a draw from the target's distribution at its position), and the output is the
    same whatever was drafted: a seeded request's text does not depend on the drafting plan, and so
    not on the server's load.

    Args:
        draft_tokens: int64 [l].
        target_probs: fp32 [l + 1, V], p_t after the anchor and after each x_k.
        noise: the request's noise with ``start`` = the output position of row 0.
    Returns:
        (number accepted n, the target's token after the accepted prefix).
    Raises:
        ValueError: a target row without positive finite mass.
    """
    drafted = draft_tokens.tolist()
    for k in range(len(drafted) + 1):
        token = gumbel_argmax(target_probs[k], noise.gumbel(k))
        if k == len(drafted) or drafted[k] != token:
            return k, token
    raise AssertionError("unreachable")
