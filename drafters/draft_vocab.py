"""Frequency-ranked draft vocabulary (FR-Spec, Zhao et al. 2025; EAGLE-3's ``draft_vocab_size``).

The drafter predicts only the N most frequent supervised target tokens: its LM head is the frozen
target LM head's rows of that subset, and its sequential head, softmax and sampling all live in
the subset. Draft tokens are mapped back to target ids before verification, and the draft
distribution is zero outside the subset, so rejection sampling over the target's full vocabulary
stays exactly lossless (a target token outside the subset can still be emitted: as a recovered or
bonus token).

Terms: ``d2t`` int64 [N], the target id of each draft id, in descending frequency; ``t2d`` int64
[V], the draft id of each target id, or N ("outside the draft vocabulary").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch


def frequency_ranking(counts: Mapping[int, int], vocab_size: int) -> list[int]:
    """All ``vocab_size`` target ids, most frequent first (ties and unseen ids by ascending id).

    Args:
        counts: target id -> number of supervised occurrences.
        vocab_size: V.
    Raises:
        ValueError: an id outside [0, V).
    """
    bad = [t for t in counts if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary of {vocab_size}")
    seen = sorted(((int(t), int(c)) for t, c in counts.items() if int(c) > 0),
                  key=lambda tc: (-tc[1], tc[0]))
    ranked = [t for t, _ in seen]
    seen_set = set(ranked)
    return ranked + [t for t in range(vocab_size) if t not in seen_set]


def coverage(counts: Mapping[int, int], draft_ids: Iterable[int]) -> float:
    """Share of supervised occurrences whose token is in ``draft_ids`` (1.0 for no counts)."""
    total = sum(int(c) for c in counts.values())
    if not total:
        return 1.0
    ids = set(int(t) for t in draft_ids)
    return sum(int(c) for t, c in counts.items() if int(t) in ids) / total


def check_draft_vocab(d2t: torch.Tensor, size: int, vocab_size: int) -> None:
    """Validate a draft-to-target map.

    Raises:
        ValueError: not an int64 vector of ``size`` distinct ids in [0, vocab_size).
    """
    if d2t.dim() != 1 or d2t.numel() != size:
        raise ValueError(f"the draft vocabulary map has shape {tuple(d2t.shape)}, the config says "
                         f"draft_vocab_size {size}")
    if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= vocab_size):
        raise ValueError(f"the draft vocabulary map holds ids outside the target vocabulary "
                         f"[0, {vocab_size})")
    if torch.unique(d2t).numel() != d2t.numel():
        raise ValueError("the draft vocabulary map repeats a target id")


def fingerprint(d2t: torch.Tensor | list[int]) -> str:
    """sha256 of the map (int64 little-endian): stored in the drafter config so that a checkpoint
    whose weights and map disagree is rejected on load."""
    t = torch.as_tensor(d2t, dtype=torch.int64).cpu().contiguous()
    return hashlib.sha256(t.numpy().astype("<i8").tobytes()).hexdigest()


def target_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 [V]: the draft id of every target id, N = len(d2t) where it is outside."""
    t2d = torch.full((vocab_size,), d2t.numel(), dtype=torch.int64, device=d2t.device)
    t2d[d2t] = torch.arange(d2t.numel(), device=d2t.device)
    return t2d
