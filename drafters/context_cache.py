"""The DSpark/DFlash drafter's per-request draft state: the context keys and values of the
committed prefix, per layer (and the last context state where the anchor reads it).

Shapes: B batch, nkv key-value heads, C cached positions, hd head dim, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftContextCache:
    """Per-layer context keys/values of the committed prefix (positions 0..length-1).

    keys[i], values[i]: [B, nkv, C, hd] with RoPE applied. Context features of a position never
    change once the target has processed it, so the cache only grows (by accepted tokens).
    last_state: [B, H], the context state H_ctx of position C-1, which the anchor slot of the next
    block reads (``drafter.anchor_features``); None when the drafter does not read it.
    """

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    last_state: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[2]



def grown_kv(cache: DraftContextCache, new: list[tuple[torch.Tensor, torch.Tensor]]):
    """The per-layer keys and values ``cache`` would hold with ``new`` (per layer (k, v), each
    [B, nkv, n, hd]) appended: (keys, values) lists, the cache itself untouched."""
    if not cache.keys:
        return [k.contiguous() for k, _ in new], [v.contiguous() for _, v in new]
    return ([torch.cat((old, k), dim=2) for old, (k, _) in zip(cache.keys, new)],
            [torch.cat((old, v), dim=2) for old, (_, v) in zip(cache.values, new)])
