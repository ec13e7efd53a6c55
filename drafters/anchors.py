"""Anchor sampling and teacher-forced block batches (SPEC section 3; DSpark paper section 5.1).

For each sequence, up to ``num_anchors`` distinct positions p with loss_mask[p] = loss_mask[p+1] = 1
are sampled. Slot j of the block at p predicts x_{p+1+j}; it is supervised only while every earlier
slot of the block is supervised (the supervised prefix of the block). The target distribution of
slot j is softmax(LM_head(last_hidden[p+j])), recomputed from the cached O(H) state.

Shapes: B sequences, T max length, A max anchors, K = gamma, H hidden, m target layers.
"""

from __future__ import annotations

import torch


def valid_anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p with loss_mask[p] = loss_mask[p+1] = 1: bool/uint8 [T] -> int64 [P]."""
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:]).flatten()


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample up to ``num_anchors`` distinct valid anchor positions, ascending: int64 [A']."""
    candidates = valid_anchor_positions(loss_mask)
    if candidates.numel() > num_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        candidates = candidates[pick]
    return candidates.sort().values


def supervised_slots(loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Which slots of each block are supervised: bool [A, K].

    Slot j (predicting x_{p+1+j}) is supervised iff positions p+1..p+1+j all lie inside the
    sequence and carry loss_mask = 1.
    """
    t = loss_mask.numel()
    target_pos = anchors[:, None] + 1 + torch.arange(block_size)  # [A, K]
    inside = target_pos < t
    ok = inside & loss_mask.bool()[target_pos.clamp(max=t - 1)]
    return ok.int().cumprod(dim=1).bool()
