"""Preallocated target KV storage written in place: one slot per request, no per-step copies.

Every request's keys and values live in a slot of one pool per layer, ``[slots, kv_heads, capacity,
head_dim]``, written in place at the request's own positions. A forward pass over several requests
therefore never pads or gathers their caches into a batch (the copy ``DynamicCache`` batching
needs) and never grows a cache by ``torch.cat``: each layer writes only the new positions of each
request, and attention reads each request's slot in place (:func:`slot_attention`, registered
with transformers' attention interface as ``"dspark_slots"``): requests of at most
``MAX_KERNEL_QUERIES`` new tokens (decode, verify, short prompt chunks) in one call of the decode
attention kernel on a CPU (``serve/engine/decode_attention.py``), else with PyTorch (single-token
requests in batched products, the rest one SDPA call each over a view of its slot; the path on a
GPU and where the kernel cannot be built). Positions a request does not commit
(rejected drafts) are simply overwritten by its next pass.

The engine sizes the pool once at start-up (``max_num_requests`` slots of ``max_model_len`` + a
draft block positions, fewer positions if ``engine.kv_cache_memory_gib`` holds fewer; the
engine's model length is then what a slot holds) and allocates it whole, zero-filled, so its
memory is committed before the first request, as a serving engine's KV cache is: serving never
grows it, and a growing resident size means a leak elsewhere. A pool used outside the engine
(tests, profiling) doubles its slots or capacity when a pass needs more room (an amortised copy,
never a per-step one; counted in :attr:`SlotKVPool.reallocations`).
A slot returns to the pool the moment its request finishes, fails or is aborted
(:meth:`serve.engine.target_runner.TargetKV.release`), and at the latest when its cache object is
garbage-collected.

Shapes: R requests in a pass, n_j new tokens of request j, packed into one row of T = sum n_j
tokens (request j's at offsets [s_j, s_j + n_j)), L_j its committed length, Hkv key/value heads,
Hq query heads, d head dim.
"""

from __future__ import annotations

import torch

from .decode_attention import MAX_KERNEL_QUERIES

ATTENTION_NAME = "dspark_slots"
# Cost of attending one key position in a request's own SDPA call, relative to one position of
# the batched product over a slot range (which also pays for the range's holes and for padding
# every row to the longest): measured on 2 cores at ~300 positions, ~80 vs ~45 ns per position
# and key/value head, the per-call dispatch included.
PER_REQUEST_COST = 2.0
# Cost of one key position of a group whose slots are gathered (copied out of the pool, then
# multiplied), relative to one position of a product over a slot range read in place.
GATHER_COST = 1.5
# Fixed cost of one more group of single-token requests (its products' dispatches over every
# layer), in key positions of a product over a slot range.
GROUP_COST = 512
MAX_GROUPS = 8
# The batched product's width (keys per slot) is rounded up to a multiple of this: its scores,
# weights and key copies then come in a few sizes that the allocator reuses. With the exact width
# every step's buffers are a little larger than the last step's freed ones, glibc cannot reuse
# them, and its heap grows: measured 3.35 -> 2.16 GB RSS for 48 requests of 192 tokens (same
# speed within noise), and a 128-request generate actor reached 17 GB (killed by Ray's OOM
# monitor) where its KV pool held 4.4 GB. The extra positions are masked, so results are exact.
WIDTH_STEP = 64


class SlotKVPool:
    """Per-layer key/value storage with one slot per live request.

    Args:
        num_layers: decoder layers of the target.
        kv_heads, head_dim: the layers' key/value heads and head dimension.
        dtype, device: of the stored keys and values (the target's).
        slots, capacity: initial slot count and positions per slot (both grow by doubling).
        stateless: layers that keep no keys and values (a hybrid target's linear-attention
            layers, whose states live in ``serve/engine/linear_state.py``): None in
            :attr:`keys` / :attr:`values`, no memory.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, slots: int = 4, capacity: int = 256,
                 stateless: frozenset[int] = frozenset()):
        shape = (slots, kv_heads, capacity, head_dim)
        # zero-filled: the memory is committed now (on CPU, untouched pages would only become
        # resident as slots fill up, which looks like a leak under load)
        self.keys = [None if i in stateless else torch.zeros(shape, dtype=dtype, device=device)
                     for i in range(num_layers)]
        self.values = [None if i in stateless else torch.zeros(shape, dtype=dtype, device=device)
                       for i in range(num_layers)]
        self._first = next(i for i, t in enumerate(self.keys) if t is not None)
        self.free_slots = list(range(slots - 1, -1, -1))  # pop() hands out the lowest first
        self.reallocations = 0  # growths so far (the engine reserves at admission, not later)

    @property
    def num_slots(self) -> int:
        return self.keys[self._first].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[self._first].shape[2]

    @property
    def device(self) -> torch.device:
        return self.keys[self._first].device

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers' keys and values."""
        return 2 * sum(t.numel() * t.element_size() for t in self.keys if t is not None)

    @staticmethod
    def bytes_per_position(num_layers: int, kv_heads: int, head_dim: int,
                           dtype: torch.dtype) -> int:
        """Bytes one slot position takes over ``num_layers`` layers that keep keys and values."""
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def state(self) -> dict:
        """Size and use for operators: slots, free slots, positions per slot, bytes, growths."""
        return {"slots": self.num_slots, "free_slots": len(self.free_slots),
                "capacity": self.capacity, "bytes": self.nbytes,
                "reallocations": self.reallocations}

    def allocate(self) -> int:
        """A free slot (the pool doubles its slots when none is left)."""
        if not self.free_slots:
            old = self.num_slots
            self._grow(dim=0, size=2 * old)
            self.free_slots = list(range(2 * old - 1, old - 1, -1))
        return self.free_slots.pop()

    def release(self, slot: int) -> None:
        self.free_slots.append(slot)

    def reserve(self, length: int) -> None:
        """Make every slot hold at least ``length`` positions (doubling the capacity)."""
        if length > self.capacity:
            size = self.capacity
            while size < length:
                size *= 2
            self._grow(dim=2, size=size)

    def reserve_slots(self, slots: int) -> None:
        """Make the pool hold at least ``slots`` slots (new ones are free)."""
        old = self.num_slots
        if slots > old:
            self._grow(dim=0, size=slots)
            self.free_slots = list(range(slots - 1, old - 1, -1)) + self.free_slots

    def _grow(self, dim: int, size: int) -> None:
        self.reallocations += 1
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is None:  # a stateless layer
                    continue
                shape = list(t.shape)
                shape[dim] = size
                grown = t.new_zeros(shape)
                grown.narrow(dim, 0, t.shape[dim]).copy_(t)
                store[i] = grown


class SingleTokenRows:
    """The requests of a pass that run one new token each (a decode step), attended together in
    one batched product over a contiguous range of pool slots instead of one SDPA call each
    (chosen by :func:`batched_single_tokens`). With 128 decoding requests of similar lengths
    (GSM8K prompts, 128-token answers) the per-request calls cost ~130 ms of a ~370 ms step on 2
    CPU cores and the batched product ~60 ms; with mixed prompt and answer lengths the product
    pays for padding to its longest row and for the range's holes, so fewer rows qualify.

    Fields (n single-token requests, slots [lo, hi) covering theirs, P = hi - lo):
        slots, positions: int64 [n], each one's slot and the position its new token is written at.
        starts: int64 [n], its token's offset in the packed row.
        lo, hi: the slot range; rows: int64 [n], each one's row in the range (slot - lo).
        in_slot_order: whether rows is 0..n-1 (the requests fill the range in slot order), so
            queries and outputs need no reordering.
        width: keys attended per slot: the longest of them, new token included, rounded up to a
            multiple of ``WIDTH_STEP`` (at most ``max_width``, the pool's capacity).
        mask: bool [P, 1, 1, width], True where a row may attend (slots in the range that are not
            in this pass attend position 0 only, so their discarded rows never divide by zero).
    """

    __slots__ = ("slots", "positions", "starts", "lo", "hi", "rows", "width", "mask",
                 "in_slot_order", "gather", "_visible", "_windowed")

    def __init__(self, slots: list[int], lengths: list[int], starts: list[int], device,
                 max_width: int | None = None, gather: bool = False):
        self.slots = torch.tensor(slots, device=device)
        self.positions = torch.tensor(lengths, device=device)
        self.starts = torch.tensor(starts, device=device)
        longest = max(lengths) + 1
        width = -(-longest // WIDTH_STEP) * WIDTH_STEP  # WIDTH_STEP: few distinct buffer sizes
        self.width = min(width, max_width) if max_width is not None else width
        # gather: the rows' keys are copied out of their slots (a group of similar lengths from
        # anywhere in the pool); else the product reads the slot range [lo, hi) in place
        self.gather = gather
        if gather:
            self.lo, self.hi, self.rows, self.in_slot_order = 0, len(slots), None, True
            visible = self.positions + 1
        else:
            self.lo, self.hi = min(slots), max(slots) + 1
            self.rows = self.slots - self.lo
            # requests come in admission order, and a reused slot can put them in any slot order
            self.in_slot_order = slots == list(range(self.lo, self.hi))
            visible = torch.ones(self.hi - self.lo, dtype=torch.long, device=device)
            visible[self.rows] = self.positions + 1
        keys_at = torch.arange(self.width, device=device)[None]
        self.mask = (keys_at < visible[:, None])[:, None, None]
        self._visible = visible
        self._windowed: dict[int, torch.Tensor] = {}

    def mask_for(self, window: int | None) -> torch.Tensor:
        """:attr:`mask` of a layer with a sliding window of ``window`` keys (None: full
        attention): a row at position p also sees no key before p - window + 1 (transformers'
        ``sliding_window_overlay``). Built once per pass per window, shared by every layer."""
        if window is None:
            return self.mask
        if window not in self._windowed:
            keys_at = torch.arange(self.width, device=self.mask.device)[None]
            recent = (keys_at >= (self._visible - window)[:, None])[:, None, None]
            self._windowed[window] = self.mask & recent
        return self._windowed[window]


def batched_single_tokens(slots: list[int], lengths: list[int], counts: list[int]) -> list[int]:
    """Which single-token requests of a pass to attend together (:class:`SingleTokenRows`), the
    rest one SDPA call each: the shortest m of them for the m that minimises the estimated cost,
    span x width of the batched product (its slot range times its longest row) plus
    ``PER_REQUEST_COST`` x positions of the others. One long request (a 1,000-token prompt among
    300-token ones) would otherwise make every row of the product attend 1,000 positions.

    Args:
        slots, lengths, counts: per request of the pass, its slot, committed length and new
            tokens.
    Returns:
        the chosen request indices (empty: fewer than two are worth batching).
    """
    ones = sorted((j for j, n in enumerate(counts) if n == 1), key=lambda j: lengths[j])
    rest = sum(lengths[j] + 1 for j in ones)  # positions left to the per-request path
    best, best_cost = 0, PER_REQUEST_COST * rest
    lo, hi = None, None
    for m, j in enumerate(ones, start=1):
        lo = slots[j] if lo is None else min(lo, slots[j])
        hi = slots[j] if hi is None else max(hi, slots[j])
        rest -= lengths[j] + 1
        cost = (hi - lo + 1) * (lengths[j] + 1) + PER_REQUEST_COST * rest
        if m >= 2 and cost < best_cost:
            best, best_cost = m, cost
    return ones[:best]


def single_token_groups(slots: list[int], lengths: list[int], counts: list[int]
                        ) -> list[tuple[list[int], bool]]:
    """How to attend the single-token requests of a pass: the cheapest by estimated cost of
    (a) one product over a slot range read in place (:func:`batched_single_tokens`, the rest one
    SDPA call each) and (b) g = 1..``MAX_GROUPS`` groups of similar lengths (the requests sorted
    by length, cut into g equal parts), each a product over its rows' keys gathered from their
    slots, costing ``GATHER_COST`` x rows x its longest row + ``GROUP_COST``. With mixed prompt
    and answer lengths (a generate batch: prompts up to 600 tokens, answers up to 512) one range
    pays for its longest row and its holes on every row; length groups pay about each row's own
    length.

    Args:
        slots, lengths, counts: per request of the pass, its slot, committed length and new
            tokens.
    Returns:
        (request indices, gathered?) per group; empty: none worth batching.
    """
    ones = sorted((j for j, n in enumerate(counts) if n == 1), key=lambda j: lengths[j])
    if len(ones) < 2:
        return []
    ranged = batched_single_tokens(slots, lengths, counts)
    best: list[tuple[list[int], bool]] = [(ranged, False)] if ranged else []
    in_range = set(ranged)
    rest = sum(lengths[j] + 1 for j in ones if j not in in_range)
    if ranged:
        span = max(slots[j] for j in ranged) - min(slots[j] for j in ranged) + 1
        best_cost = span * (max(lengths[j] for j in ranged) + 1) + PER_REQUEST_COST * rest
    else:
        best_cost = PER_REQUEST_COST * rest
    for g in range(1, min(MAX_GROUPS, len(ones) // 2) + 1):
        cuts = [round(i * len(ones) / g) for i in range(g + 1)]
        groups = [ones[a:b] for a, b in zip(cuts, cuts[1:])]
        cost = sum(GATHER_COST * len(grp) * (lengths[grp[-1]] + 1) + GROUP_COST
                   for grp in groups)
        if cost < best_cost:
            best, best_cost = [(grp, True) for grp in groups], cost
    return best


class KernelRows:
    """The query rows of a pass that the decode attention kernel attends
    (:func:`serve.engine.decode_attention.decode_kernel`): every new token of each request that
    runs at most ``MAX_KERNEL_QUERIES`` of them (decode and verify), one row per token.

    Fields (N rows): op: the kernel; slots: int64 [N], the row's request's slot; lengths: int64
    [N], the keys the row sees (its position + 1: causal within a verify block); offsets: int64
    [N], the row's token in the packed row.
    """

    __slots__ = ("op", "slots", "lengths", "offsets", "_starts")

    def __init__(self, op, slots: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor):
        self.op, self.slots, self.lengths, self.offsets = op, slots, lengths, offsets
        self._starts: dict[int, torch.Tensor | None] = {}

    def starts(self, window: int | None) -> torch.Tensor | None:
        """int64 [N], each row's first visible key under a sliding window of ``window`` keys
        (``lengths - window``, at least 0), or None where every row sees all its keys."""
        if window is None:
            return None
        if window not in self._starts:
            first = (self.lengths - window).clamp_(min=0)
            self._starts[window] = first.contiguous() if bool((first > 0).any()) else None
        return self._starts[window]


class SlotViews:
    """What :meth:`PooledStepCache.update` hands the attention of one layer: each multi-token
    request's keys or values ``[Hkv, L_j + n_j, d]`` as views of its slot (no copy; None for a
    request attended otherwise), its new tokens' offset s_j in the packed row and count n_j
    (its causal and window masks built from them, :meth:`folded_mask`), the rows the decode attention kernel attends
    (:class:`KernelRows`, or None) or else the groups of single-token requests
    (:class:`SingleTokenRows`; empty or None: none), with this layer's whole pool tensor
    ``[slots, Hkv, capacity, d]``."""

    __slots__ = ("rows", "starts", "counts", "_folded", "single", "pool", "kernel_rows")

    def __init__(self, rows: list, starts: list[int], counts: list[int], folded: dict,
                 single: list[SingleTokenRows] | None = None, pool: torch.Tensor | None = None,
                 kernel_rows: KernelRows | None = None):
        self.rows, self.starts, self.counts = rows, starts, counts
        self._folded = folded
        self.single, self.pool, self.kernel_rows = single, pool, kernel_rows

    def window_start(self, j: int, window: int | None) -> int:
        """The first key any new token of request j sees in a layer with a sliding window of
        ``window`` keys (0: full attention, or a window longer than the request)."""
        if window is None:
            return 0
        return max(0, self.rows[j].shape[1] - self.counts[j] - window + 1)

    def folded_mask(self, j: int, groups: int, window: int | None = None
                    ) -> torch.Tensor | None:
        """Row j's mask over keys ``[window_start, L_j + n_j)`` repeated for ``groups`` folded
        query heads ``[1, 1, groups * n_j, keys]``, or None where every query sees every one of
        those keys; built once per forward pass and shared by every layer. Query i (position
        L_j + i) sees keys (L_j + i - window, L_j + i] (transformers' ``sliding_window_overlay``).
        """
        key = (j, groups, window)
        if key not in self._folded:
            n = self.counts[j]
            total = self.rows[j].shape[1]
            first = self.window_start(j, window)
            at = torch.arange(first, total, device=self.rows[j].device)[None]
            last = total - n + torch.arange(n, device=at.device)[:, None]  # each query's position
            mask = at <= last
            if window is not None:
                mask &= at > last - window
            self._folded[key] = None if bool(mask.all()) else mask.repeat(groups, 1)[None, None]
        return self._folded[key]


class PooledStepCache:
    """The cache object of one forward pass over requests in ``slots``: transformers' attention
    layers call :meth:`update` with the new keys and values of the packed row ``[1, Hkv, T, d]``;
    request j's (offsets ``[s_j, s_j + n_j)``) are written at positions ``[L_j, L_j + n_j)`` of
    its slot.

    Args:
        pool: the :class:`SlotKVPool`.
        slots: R slot ids; lengths: R committed lengths L_j; counts: R new-token counts n_j.
        kernel: the decode attention kernel (:func:`serve.engine.decode_attention.decode_kernel`)
            for requests of at most ``MAX_KERNEL_QUERIES`` new tokens, or None: PyTorch only
            (single-token requests in batched products, the rest one SDPA call each).
    """

    def __init__(self, pool: SlotKVPool, slots: list[int], lengths: list[int], counts: list[int],
                 kernel=None):
        self.pool, self.slots, self.lengths, self.counts = pool, slots, lengths, counts
        # per-request linear-attention states of a hybrid target (serve/engine/linear_state.py)
        self.linear_states = None
        self.starts = [0] * len(counts)
        for j in range(1, len(counts)):
            self.starts[j] = self.starts[j - 1] + counts[j - 1]
        pool.reserve(max(l + n for l, n in zip(lengths, counts)))
        device = pool.device
        self._folded: dict = {}  # folded masks, shared by all layers of this pass
        self.kernel_rows: KernelRows | None = None
        self.single: list[SingleTokenRows] = []
        if kernel is not None:
            chosen = [j for j, n in enumerate(counts) if n <= MAX_KERNEL_QUERIES]
            tokens = [(slots[j], lengths[j] + i, self.starts[j] + i)
                      for j in chosen for i in range(counts[j])]
            writes = torch.tensor(tokens, device=device).T if tokens else None
            if tokens:
                self.kernel_rows = KernelRows(kernel, writes[0].contiguous(),
                                              (writes[1] + 1).contiguous(), writes[2].contiguous())
        else:
            groups = single_token_groups(slots, lengths, counts)
            self.single = [SingleTokenRows([slots[j] for j in grp], [lengths[j] for j in grp],
                                           [self.starts[j] for j in grp], device,
                                           max_width=pool.capacity, gather=gathered)
                           for grp, gathered in groups]
            chosen = [j for grp, _ in groups for j in grp]
            writes = (torch.tensor([[slots[j] for j in chosen], [lengths[j] for j in chosen],
                                    [self.starts[j] for j in chosen]], device=device)
                      if chosen else None)
        # every new key and value of those requests: one indexed store per tensor
        # (rows: slot, position, offset in the packed row)
        self._token_writes = writes
        batched = set(chosen)
        self._multi = [j for j in range(len(counts)) if j not in batched]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[SlotViews, SlotViews]:
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        krows: list = [None] * len(self.counts)
        vrows: list = [None] * len(self.counts)
        for j in self._multi:
            slot, l, s, n = self.slots[j], self.lengths[j], self.starts[j], self.counts[j]
            keys[slot, :, l:l + n] = key_states[0, :, s:s + n]
            values[slot, :, l:l + n] = value_states[0, :, s:s + n]
            krows[j] = keys[slot, :, :l + n]
            vrows[j] = values[slot, :, :l + n]
        if self._token_writes is not None:
            s, pos, at = self._token_writes
            keys[s, :, pos] = key_states[0, :, at].transpose(0, 1)
            values[s, :, pos] = value_states[0, :, at].transpose(0, 1)
        return (SlotViews(krows, self.starts, self.counts, self._folded, self.single, keys,
                          self.kernel_rows),
                SlotViews(vrows, self.starts, self.counts, self._folded, self.single, values,
                          self.kernel_rows))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths)


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
    import sys

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
