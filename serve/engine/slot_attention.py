"""Attention over the engine's KV pool, registered with transformers' attention interface.

Every layer of the target calls :func:`slot_attention` with its new queries and the
:class:`serve.engine.kv_pool.SlotViews` of its keys and values (``PooledStepCache.update``): each
request's keys in place in its slot, never gathered into a padded batch. The decode and verify rows
go to the decode attention kernel on a CPU (``serve/engine/decode_attention.py``), groups of
single-token requests to batched products, the rest to one SDPA call each. Called with plain
tensors (``generate`` outside the engine), it is transformers' own SDPA or the model file's eager
attention, so the registered model still works on its own.

Shapes: T new tokens of all requests packed in one row, Hq query heads, Hkv key/value heads,
d head dim.
"""

from __future__ import annotations

import sys

import torch

from .kv_pool import SingleTokenRows, SlotViews

ATTENTION_NAME = "dspark_slots"


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   sliding_window: int | None = None, s_aux: torch.Tensor | None = None,
                   softcap: float | None = None, **kwargs):
    """Attention over slot views, as the target's layer defines it: the decode and verify rows in
    one call of the decode attention kernel where it is in use (:class:`KernelRows`), else
    single-token requests in batched products (:class:`SingleTokenRows`); every other request one
    SDPA call, its query heads folded into the query axis per key/value head (so keys and values
    are never repeated for grouped-query attention). Any other input goes to transformers' SDPA
    attention (or, for sinks or a soft cap, the model's own eager attention) unchanged, so the
    model still works outside the engine (plain ``generate``).

    Every path honours what transformers passes the layer's attention function: a sliding window
    (Mistral, Qwen2, Gemma 2/3, gpt-oss, Phi-3: query position p sees keys (p - window, p]), the
    attention sinks (gpt-oss's ``s_aux``: one logit per query head in the softmax's denominator)
    and a logit soft cap (Gemma 2: scores -> cap * tanh(scores / cap)).

    Args:
        query: the packed row ``[1, Hq, T, d]``; key, value: :class:`SlotViews` (or tensors: the
            SDPA path).
        sliding_window: keys a query sees at most (None: full attention).
        s_aux: float ``[Hq]`` sink logits, or None; softcap: the cap, or None.
    Returns:
        (``[1, T, Hq, d]``, None), as transformers' attention functions return.
    """
    if not isinstance(key, SlotViews):
        return _outside_engine(module, query, key, value, attention_mask, scaling, dropout,
                               sliding_window, s_aux, softcap, **kwargs)
    key.check_window(sliding_window)
    _, hq, t, d = query.shape
    scale = scaling if scaling is not None else d ** -0.5
    sinks = None if s_aux is None else s_aux.detach().float().contiguous()
    out = query.new_empty(1, t, hq, d)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for j, (k, v, s, nj) in enumerate(zip(key.rows, value.rows, key.starts, key.counts)):
        if k is None:  # attended below with the others (kernel rows or single-token groups)
            continue
        hkv = k.shape[0]
        groups = hq // hkv
        q = query[0, :, s:s + nj].reshape(hkv, groups * nj, d)  # head h = kv head * groups + g
        first = key.window_start(j, sliding_window)  # keys before it are outside every window
        k, v = k[:, first:], v[:, first:]
        # the folded rows are g * n_j + i: each group repeats the causal (and window) mask
        mask = key.folded_mask(j, groups, sliding_window)
        if sinks is None and softcap is None:
            o = sdpa(q[None], k[None], v[None], attn_mask=mask, scale=scale)[0]
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [Hkv, g*n, keys]
            row_sinks = (None if sinks is None else
                         sinks.view(hkv, groups, 1).expand(hkv, groups, nj).reshape(hkv, -1, 1))
            o = torch.matmul(_weights(scores, None if mask is None else mask[0], row_sinks,
                                      softcap).to(v.dtype), v)
        out[0, s:s + nj] = o.reshape(hq, nj, d).transpose(0, 1)
    for one in key.single or ():
        out[0, one.starts] = _single_token_attention(query, one, key.pool, value.pool, scale,
                                                     sliding_window, sinks, softcap)
    rows = key.kernel_rows
    if rows is not None:
        if softcap is not None:
            raise NotImplementedError("the decode attention kernel has no logit soft cap; the "
                                      "runner attends such a target with PyTorch")
        q = query[0, :, rows.offsets].transpose(0, 1).contiguous()  # [N, Hq, d]
        out[0, rows.offsets] = rows.op(q, key.pool, value.pool, rows.slots, rows.lengths, scale,
                                       rows.starts(sliding_window), sinks)
    return out, None


def _weights(scores: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor | None,
             softcap: float | None) -> torch.Tensor:
    """Attention weights from fp32 ``scores [..., rows, keys]`` as transformers' eager attention
    computes them: soft-capped (``cap * tanh(s / cap)``), masked (bool, True = visible,
    broadcastable), softmaxed with one sink logit per row joining the denominator (``sinks``
    broadcastable to ``[..., rows, 1]``; its weight is dropped). Returns fp32 ``[..., rows, keys]``.
    """
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]


def _outside_engine(module, query, key, value, attention_mask, scaling, dropout, sliding_window,
                    s_aux, softcap, **kwargs):
    """The model called outside the engine (plain ``generate``, training): the eager attention of
    the model's own modeling file where the runner registered eager masks (:func:`register`:
    the target's own attention was eager, e.g. for sinks or a soft cap, which SDPA cannot
    express), else SDPA; transformers built either mask with the window."""
    extra = {k: v for k, v in (("s_aux", s_aux), ("softcap", softcap)) if v is not None}
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if attention_mask is not None and attention_mask.dtype != torch.bool and eager is not None:
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     sliding_window=sliding_window, **extra, **kwargs)
    if extra:  # SDPA cannot express them: never answer with another attention's output
        raise NotImplementedError(f"{sorted(extra)} need the model's eager attention and its "
                                  f"additive mask (kv_pool.register(eager=True))")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, sliding_window=sliding_window, **kwargs)


def _single_token_attention(query: torch.Tensor, one: SingleTokenRows, keys: torch.Tensor,
                            values: torch.Tensor, scale: float, window: int | None = None,
                            sinks: torch.Tensor | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """Attention of a group of single-token requests at once over their slots' keys, as two
    batched matrix products: over the slot range [lo, hi) of the pool (views, no copy of any
    key), or over the group's keys gathered from its slots (``one.gather``).

    Args:
        query: the packed row ``[1, Hq, T, d]``; one: the group; keys, values: this layer's pool
            tensors ``[slots, Hkv, capacity, d]``; scale: the softmax scale; window, sinks
            (float32 ``[Hq]``), softcap: as :func:`slot_attention`.
    Returns:
        ``[n, Hq, d]``, the attention output of the group's n requests in their order.
    """
    _, hq, _, d = query.shape
    hkv = keys.shape[1]
    groups = hq // hkv
    q = query[0, :, one.starts].reshape(hkv, groups, -1, d).permute(2, 0, 1, 3)  # [n, Hkv, g, d]
    if one.gather:
        k = keys[one.slots, :, :one.width]
        v = values[one.slots, :, :one.width]
    else:
        span = one.hi - one.lo
        if not one.in_slot_order:  # rows in slot order; slots of the range not in this pass: 0
            q = q.new_zeros(span, hkv, groups, d).index_copy_(0, one.rows, q)
        k = keys[one.lo:one.hi, :, :one.width]
        v = values[one.lo:one.hi, :, :one.width]
    # keys times queries, not queries times transposed keys: the pool's key rows are contiguous,
    # and this orientation multiplies 3x faster on them (measured on 2 cores, bf16). In bf16 the
    # scores are rounded to bf16 before the fp32 softmax (SDPA's CPU kernel keeps them in fp32):
    # noise of the size bf16 already puts on q and k; an fp32 target is exact (tested)
    scores = torch.matmul(k, q.transpose(-1, -2)).transpose(-1, -2).float() * scale
    if window is None and sinks is None and softcap is None:
        weights = scores.masked_fill_(~one.mask, float("-inf")).softmax(-1)
    else:
        weights = _weights(scores, one.mask_for(window),
                           None if sinks is None else sinks.view(1, hkv, groups, 1), softcap)
    o = torch.matmul(weights.to(v.dtype), v)  # [P, Hkv, g, d]
    if not one.in_slot_order:
        o = o.index_select(0, one.rows)
    return o.reshape(-1, hq, d)


def register(eager: bool = False) -> str:
    """Register :func:`slot_attention` with transformers, with the mask builder of the attention
    the model falls back to outside the engine: SDPA's (boolean masks, ``"dspark_slots"``) or, for
    ``eager``, eager attention's (additive float masks, ``"dspark_slots_eager"``: a target whose
    attention transformers computes eagerly, e.g. gpt-oss's sinks or Gemma 2's soft cap). Returns
    the attention implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    name = ATTENTION_NAME + ("_eager" if eager else "")
    AttentionInterface.register(name, slot_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, eager_mask if eager else sdpa_mask)
    return name
