"""Anchor-bounded packing of teacher-forced blocks (DSpark paper section 5.1; SPEC section 3).

Blocks from many sequences are packed into flat tensors without padding. Who may attend to whom is
given by token-level indices, never by a dense [blocks x context] mask over the whole batch:

- every context row carries (sequence id, position); every block carries (sequence id, anchor
  position) and its own block id (its row in the packed block tensors);
- a block query at anchor p of sequence s sees the context rows of s with position < p, and the
  keys of its own block (all slots for DSpark/DFlash, earlier chain steps for Eagle3);
- a sequence contributes context rows only up to its last anchor: nothing after the last anchor can
  be visible to any query, so it is neither projected nor scored ("anchor-bounded").

Attention work is therefore sum_s (A_s * S * p_max,s) + N * S * S score entries, set by the anchors
and where they sit, not by the sequence length, and never quadratic in the number of anchors.

Shapes: B sequences, N packed blocks, Nc packed context rows, K = gamma prediction slots,
S block slots, m*H_t context feature width, H target hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .anchors import sample_anchors, supervised_slots


@dataclass
class PackedBlocks:
    """A packed batch of blocks and the context they may see.

    context_features: [Nc, m*H_t] target layer features of the visible context rows;
    context_positions: int64 [Nc], position of each row inside its sequence;
    context_next_tokens: int64 [Nc], x_{t+1} of each context row t (Eagle3 pairs g_t with it);
    context_offsets: int64 [B+1], rows of sequence s are context_offsets[s]:context_offsets[s+1];
    anchor_positions / anchor_tokens: int64 [N], p and x_p of each block;
    block_offsets: int64 [B+1], blocks of sequence s are block_offsets[s]:block_offsets[s+1]
    (blocks are grouped by sequence and ascending in p);
    prev_tokens: int64 [N, K], x_{k-1} of each slot (x_0 = anchor);
    labels: int64 [N, K], x_{p+k}; label_valid: bool [N, K], supervised slots (a prefix);
    target_hidden: [N, K, H], last_hidden[p+k-1], the LM-head input giving p_t of slot k
    (zeros where not supervised).
    """

    context_features: torch.Tensor
    context_positions: torch.Tensor
    context_next_tokens: torch.Tensor
    context_offsets: torch.Tensor
    anchor_positions: torch.Tensor
    anchor_tokens: torch.Tensor
    block_offsets: torch.Tensor
    prev_tokens: torch.Tensor
    labels: torch.Tensor
    label_valid: torch.Tensor
    target_hidden: torch.Tensor

    @property
    def num_sequences(self) -> int:
        return self.block_offsets.numel() - 1

    @property
    def num_blocks(self) -> int:
        return self.anchor_positions.numel()

    def block_sequence_ids(self) -> torch.Tensor:
        """int64 [N], the sequence id of every block."""
        counts = self.block_offsets.diff()
        return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)

    def context_sequence_ids(self) -> torch.Tensor:
        """int64 [Nc], the sequence id of every context row."""
        counts = self.context_offsets.diff()
        return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)

    def to(self, device) -> "PackedBlocks":
        return PackedBlocks(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def pack_blocks(samples: list[dict], num_anchors: int, block_size: int,
                generator: torch.Generator | list | None = None, min_anchor: int = 0) -> PackedBlocks:
    """Sample anchors per sequence and pack blocks, labels and the anchor-bounded context.

    Args:
        samples: dicts with ``input_ids`` int [T_i], ``loss_mask`` [T_i], ``context_hidden``
            [T_i, m*H_t], ``last_hidden`` [T_i, H] (any float dtype), optional ``sample_id``.
        num_anchors: cap on anchors per sequence (SPEC default 512).
        block_size: gamma.
        generator: anchor-sampling RNG, or one per sample (so that a row's anchors do not depend
            on which batch or worker it lands in).
        min_anchor: smallest admissible anchor position (Eagle3 needs p >= 1: its first draft
            step reads the target state at p - 1).
    Raises:
        ValueError: empty ``samples`` or a sample without any admissible anchor (named).
    """
    if not samples:
        raise ValueError("pack_blocks needs at least one sample")
    k = block_size
    slot = torch.arange(k)
    ctx, ctx_pos, ctx_next, ctx_counts = [], [], [], []
    anchors_all, tokens_all, blk_counts = [], [], []
    prev, labels, valid, target = [], [], [], []
    for i, s in enumerate(samples):
        mask = s["loss_mask"].clone()
        mask[:min_anchor] = 0
        g = generator[i] if isinstance(generator, (list, tuple)) else generator
        a = sample_anchors(mask if min_anchor else s["loss_mask"], num_anchors, g)
        if a.numel() == 0:
            raise ValueError(f"sample {s.get('sample_id', i)!r} has no anchor position p >= "
                             f"{min_anchor} with loss_mask[p] = loss_mask[p+1] = 1")
        ids, t = s["input_ids"].long(), s["input_ids"].numel()
        bound = int(a.max())  # context rows >= the last anchor are never visible
        ctx.append(s["context_hidden"][:bound])
        ctx_pos.append(torch.arange(bound))
        ctx_next.append(ids[1:bound + 1])
        ctx_counts.append(bound)
        sup = supervised_slots(s["loss_mask"], a, k)
        src = (a[:, None] + slot).clamp(max=t - 1)  # p + k - 1: the state predicting x_{p+k}
        anchors_all.append(a)
        tokens_all.append(ids[a])
        blk_counts.append(a.numel())
        prev.append(ids[src])
        labels.append(ids[(src + 1).clamp(max=t - 1)])
        valid.append(sup)
        target.append(s["last_hidden"][src] * sup[..., None].to(s["last_hidden"].dtype))
    offsets = lambda counts: torch.tensor([0] + counts).cumsum(0)
    return PackedBlocks(
        context_features=torch.cat(ctx), context_positions=torch.cat(ctx_pos),
        context_next_tokens=torch.cat(ctx_next), context_offsets=offsets(ctx_counts),
        anchor_positions=torch.cat(anchors_all), anchor_tokens=torch.cat(tokens_all),
        block_offsets=offsets(blk_counts), prev_tokens=torch.cat(prev), labels=torch.cat(labels),
        label_valid=torch.cat(valid), target_hidden=torch.cat(target))


def packed_attention(q: torch.Tensor, block_k: torch.Tensor, block_v: torch.Tensor,
                     context_k: torch.Tensor, context_v: torch.Tensor, packed: PackedBlocks,
                     block_visibility: torch.Tensor | None = None, anchor_chunk: int = 64,
                     stats: dict | None = None, window: int | None = None) -> torch.Tensor:
    """Attention of packed block queries over their own sequence's context and their own block.

    Visibility is computed from indices per sequence: a query of the block at anchor p sees context
    rows with position < p of the same sequence and the block keys allowed by
    ``block_visibility``. The two key sets are scored separately and joined in one softmax, so the
    block part costs N * S * S (never N^2). Queries are processed in chunks of ``anchor_chunk``
    blocks (blocks of a sequence ascending in p, as :func:`pack_blocks` orders them); a chunk
    scores only the context rows its furthest anchor can see, which bounds the score memory at
    chunk * S * p_max per head. With autograd on, each chunk runs under activation checkpointing
    (:func:`_attend_chunk`): its [nh, chunk * S, p_max] scores and probabilities are recomputed in
    backward instead of being kept, so no score-sized tensor outlives its chunk (kept, they would
    be ~6 bytes per score entry per layer: ~57 GB for a Qwen3-4B-sized micro-batch of 4 x 4096
    tokens and 512 anchors each). A fused kernel (FlexAttention with the same index rule) is the
    faster GPU path; this one is plain PyTorch so that it runs everywhere.

    Args:
        q: [N, nh, S, hd] block queries (RoPE applied).
        block_k, block_v: [N, nkv, S, hd] keys/values of the block slots.
        context_k, context_v: [Nc, nkv, hd] keys/values of the packed context rows.
        packed: the :class:`PackedBlocks` the tensors come from (offsets and positions).
        block_visibility: bool [S, S], True where slot i may attend to slot j of its own block;
            None = all (bidirectional block, DSpark/DFlash).
        window: sliding window in tokens, or None: the query of slot i (position p + i) then sees
            only context positions > p + i - window (transformers' and vLLM's convention); the
            block's own keys are all within a window >= S. A chunk scores only the rows some
            query of it can see.
        stats: if given, ``stats["score_entries"]`` is increased by the number of attention scores
            computed per head (the attention work; used by the packing tests).
    Returns:
        [N, nh, S, hd].
    Raises:
        ValueError: a query would see no key at all (e.g. an Eagle3 slot 0 at anchor 0).
    """
    from torch.utils.checkpoint import checkpoint

    s = q.shape[2]
    out = torch.empty_like(q)
    b_off = packed.block_offsets.tolist()
    c_off = packed.context_offsets.tolist()
    anchors = packed.anchor_positions.tolist()
    blk_vis = None if block_visibility is None else block_visibility.to(q.device)
    if blk_vis is not None and not bool(blk_vis.any(-1).all()) and 0 in anchors:
        raise ValueError("a block query has no visible key: a slot without block keys at an "
                         "anchor at position 0 (pack with min_anchor=1)")
    recompute = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, block_k, block_v, context_k, context_v))
    for seq in range(len(b_off) - 1):
        kc = context_k[c_off[seq]:c_off[seq + 1]].transpose(0, 1)  # [nkv, L, hd]
        vc = context_v[c_off[seq]:c_off[seq + 1]].transpose(0, 1)
        pos = packed.context_positions[c_off[seq]:c_off[seq + 1]]
        for start in range(b_off[seq], b_off[seq + 1], anchor_chunk):
            end = min(start + anchor_chunk, b_off[seq + 1])
            # context rows are positions 0..L-1 in order: a chunk scores only the rows its
            # furthest anchor can see (with ascending anchors, later chunks see more)
            ctx_len = max(anchors[start:end])
            # with a window, rows before the nearest anchor's window are invisible to the chunk
            lo = 0 if window is None else max(0, min(min(anchors[start:end]) - window + 1, ctx_len))
            if stats is not None:  # per head: [a*S, ctx_len] context + [a, S, S] block scores
                stats["score_entries"] = (stats.get("score_entries", 0)
                                          + (end - start) * s * (ctx_len - lo + s))
            args = (q[start:end], block_k[start:end], block_v[start:end], kc[:, lo:ctx_len],
                    vc[:, lo:ctx_len], pos[lo:ctx_len], packed.anchor_positions[start:end],
                    blk_vis, window)
            if recompute:  # the checkpoint keeps only its inputs, all views of existing tensors
                out[start:end] = checkpoint(_attend_chunk, *args, use_reentrant=False,
                                            preserve_rng_state=False)
            else:
                out[start:end] = _attend_chunk(*args)
    return out


def _attend_chunk(qs: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, kc: torch.Tensor,
                  vc: torch.Tensor, pos: torch.Tensor, anchor: torch.Tensor,
                  blk_vis: torch.Tensor | None, window: int | None = None) -> torch.Tensor:
    """One chunk of :func:`packed_attention`: a blocks of one sequence against the context rows
    some query of the chunk can see (``[lo, ctx_len)``, given as ``kc``/``vc``/``pos``) and their
    own block slots, in one softmax.

    Args:
        qs: [a, nh, S, hd] queries; kb, vb: [a, nkv, S, hd] block keys/values.
        kc, vc: [nkv, ctx_len, hd] context keys/values (ascending positions ``pos``).
        pos: int64 [ctx_len] context positions; anchor: int64 [a] anchor position of each block.
        blk_vis: bool [S, S] or None; window: int or None (see :func:`packed_attention`).
    Returns:
        [a, nh, S, hd].
    """
    a, nh, s, hd = qs.shape
    nkv, ctx_len = kc.shape[0], kc.shape[1]
    groups = nh // nkv
    scale = hd ** -0.5
    # context part, grouped-query: query head h uses kv head h // groups, so the queries of one
    # kv head are stacked: [a, nh, S, hd] -> [nkv, groups*a*S, hd] (no repeated context keys)
    q_grp = qs.view(a, nkv, groups, s, hd).permute(1, 2, 0, 3, 4).reshape(nkv, groups * a * s, hd)
    s_ctx = torch.matmul(q_grp, kc.transpose(-1, -2)).float() * scale  # [nkv, groups*a*S, ctx_len]
    s_ctx = s_ctx.view(nkv, groups, a * s, ctx_len)
    visible = pos[None, :] < anchor.repeat_interleave(s)[:, None]  # [a*S, ctx_len]
    if window is not None:  # slot i of the block at p is at position p + i
        q_pos = (anchor[:, None] + torch.arange(s, device=anchor.device)).reshape(-1)
        visible &= pos[None, :] > q_pos[:, None] - window
    s_ctx = s_ctx.masked_fill(~visible, float("-inf")).view(nh, a * s, ctx_len)
    # block part: [a, nh, S, S], only inside the block
    kb = kb.repeat_interleave(groups, dim=1)
    vb = vb.repeat_interleave(groups, dim=1)
    s_blk = torch.matmul(qs, kb.transpose(-1, -2)).float() * scale
    if blk_vis is not None:
        s_blk = s_blk.masked_fill(~blk_vis, float("-inf"))
    s_blk = s_blk.permute(1, 0, 2, 3).reshape(nh, a * s, s)
    probs = torch.softmax(torch.cat((s_ctx, s_blk), dim=-1), dim=-1).to(qs.dtype)
    p_ctx = probs[..., :ctx_len].reshape(nkv, groups * a * s, ctx_len)
    o_ctx = torch.matmul(p_ctx, vc)  # [nkv, groups*a*S, hd]
    o_ctx = o_ctx.view(nkv, groups, a, s, hd).permute(2, 0, 1, 3, 4).reshape(a, nh, s, hd)
    p_blk = probs[..., ctx_len:].reshape(nh, a, s, s).permute(1, 0, 2, 3)
    return o_ctx + torch.matmul(p_blk, vb)  # [a, nh, S, hd]


def pack_dense(context_features: torch.Tensor, anchor_positions: torch.Tensor,
               anchor_tokens: torch.Tensor, input_ids: torch.Tensor | None = None) -> PackedBlocks:
    """Pack given anchors of a padded batch (no labels; for inspection and tests).

    Args:
        context_features: [B, T, m*H_t].
        anchor_positions, anchor_tokens: int64 [B, A] (every row has A anchors).
        input_ids: int64 [B, T] or None; gives ``context_next_tokens`` (zeros when None).
    Returns:
        :class:`PackedBlocks` with N = B*A blocks in row order; labels, prev_tokens and
        target_hidden are empty placeholders of the right shapes with K = 0.
    """
    b, t, _ = context_features.shape
    a = anchor_positions.shape[1]
    bounds = anchor_positions.max(dim=1).values.tolist()
    ids = input_ids if input_ids is not None else torch.zeros(b, t, dtype=torch.long)
    ids = torch.cat((ids, ids[:, -1:]), dim=1)  # x_{t+1} of the last row is never read
    dev = context_features.device
    offsets = lambda counts: torch.tensor([0] + counts, device=dev).cumsum(0)
    empty = torch.zeros(b * a, 0, dtype=torch.long, device=dev)
    return PackedBlocks(
        context_features=torch.cat([context_features[i, :n] for i, n in enumerate(bounds)]),
        context_positions=torch.cat([torch.arange(n, device=dev) for n in bounds]),
        context_next_tokens=torch.cat([ids[i, 1:n + 1].to(dev) for i, n in enumerate(bounds)]),
        context_offsets=offsets(bounds), anchor_positions=anchor_positions.reshape(-1),
        anchor_tokens=anchor_tokens.reshape(-1), block_offsets=offsets([a] * b),
        prev_tokens=empty, labels=empty, label_valid=empty.bool(),
        target_hidden=torch.zeros(b * a, 0, 0, device=dev))
