"""One forward pass over the KV pool: where each request's new keys go and how it attends them.

Every request's keys and values live in a slot of the pool (``serve/engine/kv_storage.py``),
written in place at the request's own positions. A forward pass over several requests therefore
never pads or gathers their caches into a batch (the copy ``DynamicCache`` batching needs) and never
grows a cache by ``torch.cat``: each layer writes only the new positions of each request
(:class:`PooledStepCache`, the cache object transformers' layers call), and attention
(``serve/engine/slot_attention.py``) reads each request's slot in place: requests of at most
``MAX_KERNEL_QUERIES`` new tokens (decode, verify, short prompt chunks) in one call of the decode
attention kernel on a CPU (:class:`KernelRows`), else with PyTorch (single-token requests in
batched products, :class:`SingleTokenRows`; the rest one SDPA call each over a view of its slot,
:class:`SlotViews`; the path on a GPU and where the kernel cannot be built). Positions a request
does not commit (rejected drafts) are simply overwritten by its next pass. The plan is made once
per pass per layer group (:class:`GroupPass`: the full-attention layers, and the layers of each
sliding window, whose slots hold only the window) and shared by the group's layers.

Shapes: R requests in a pass, n_j new tokens of request j, packed into one row of T = sum n_j
tokens (request j's at offsets [s_j, s_j + n_j)), L_j its committed length, Hkv key/value heads,
Hq query heads, d head dim.
"""

from __future__ import annotations

import torch

from .decode_attention import MAX_KERNEL_QUERIES
from .kv_storage import SlotKVPool

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
    request attended otherwise), and the pass plan of the layer's group (:class:`GroupPass`):
    its new tokens' offset s_j in the packed row and count n_j (its causal and window masks
    built from them, :meth:`folded_mask`), the rows the decode attention kernel attends
    (:class:`KernelRows`, or None) or else the groups of single-token requests
    (:class:`SingleTokenRows`; empty: none), with this layer's whole pool tensor
    ``[slots, Hkv, positions, d]``.

    Fields: window: the sliding window the layer's slots were sized and compacted for (None:
    all positions are kept); :meth:`check_window` holds the layer's attention to it."""

    __slots__ = ("rows", "starts", "counts", "_folded", "single", "pool", "kernel_rows",
                 "window", "layer", "_seen")

    def __init__(self, rows: list, plan: "GroupPass", pool: torch.Tensor, layer: int,
                 seen: dict):
        self.rows, self.starts, self.counts = rows, plan.starts, plan.counts
        self._folded = plan.folded
        self.single, self.pool, self.kernel_rows = plan.single, pool, plan.kernel_rows
        self.window, self.layer, self._seen = plan.window, layer, seen

    def check_window(self, window: int | None) -> None:
        """Record the window the layer's attention was called with
        (:attr:`SlotKVPool.observed_windows`: how the engine learns each layer's window) and
        refuse one its slots do not hold: keys older than the stored window are gone.

        Raises:
            RuntimeError: the layer's slots keep a window of :attr:`window` keys and its
                attention asks for another (or for all keys).
        """
        self._seen[self.layer] = window
        if self.window is not None and window != self.window:
            raise RuntimeError(f"layer {self.layer} attends with sliding window {window}, but "
                               f"its KV slots keep the last {self.window} keys (the window it "
                               f"was called with when the engine was built)")

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


class GroupPass:
    """One layer group's plan of a forward pass (the layers of one sliding window, or the
    full-attention layers; ``serve/engine/kv_storage.py``): where each new key is written in the
    group's slots and how each request attends them, built once per pass and used by every layer
    of the group. Lengths are as stored in the group's slots (a sliding group's are shifted by
    each slot's offset; windows and causal masks only depend on positions relative to a
    request's own, so they are the same either way).

    Args:
        window: the group's sliding window (None: full attention); positions: its slot size.
        slots, lengths, counts, starts: per request, its slot, stored committed length, new
            tokens and first offset in the packed row.
        kernel: as :class:`PooledStepCache`.
    """

    def __init__(self, window: int | None, positions: int, slots: list[int], lengths: list[int],
                 counts: list[int], starts: list[int], kernel, device):
        self.window, self.slots, self.lengths, self.counts = window, slots, lengths, counts
        self.starts = starts
        self.folded: dict = {}  # folded masks, shared by all layers of this group and pass
        self.kernel_rows: KernelRows | None = None
        self.single: list[SingleTokenRows] = []
        if kernel is not None:
            chosen = [j for j, n in enumerate(counts) if n <= MAX_KERNEL_QUERIES]
            tokens = [(slots[j], lengths[j] + i, starts[j] + i)
                      for j in chosen for i in range(counts[j])]
            writes = torch.tensor(tokens, device=device).T if tokens else None
            if tokens:
                self.kernel_rows = KernelRows(kernel, writes[0].contiguous(),
                                              (writes[1] + 1).contiguous(), writes[2].contiguous())
        else:
            groups = single_token_groups(slots, lengths, counts)
            self.single = [SingleTokenRows([slots[j] for j in grp], [lengths[j] for j in grp],
                                           [starts[j] for j in grp], device,
                                           max_width=positions, gather=gathered)
                           for grp, gathered in groups]
            chosen = [j for grp, _ in groups for j in grp]
            writes = (torch.tensor([[slots[j] for j in chosen], [lengths[j] for j in chosen],
                                    [starts[j] for j in chosen]], device=device)
                      if chosen else None)
        # every new key and value of those requests: one indexed store per tensor
        # (rows: slot, position, offset in the packed row)
        self._token_writes = writes
        batched = set(chosen)
        self._multi = [j for j in range(len(counts)) if j not in batched]

    def write(self, keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor,
              value_states: torch.Tensor, layer: int, pool: SlotKVPool
              ) -> tuple[SlotViews, SlotViews]:
        """Store one layer's new keys and values (``[1, Hkv, T, d]``) in its pool tensors
        ``[slots, Hkv, positions, d]`` and return what its attention reads."""
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
        return (SlotViews(krows, self, keys, layer, pool.observed_windows),
                SlotViews(vrows, self, values, layer, pool.observed_windows))


class PooledStepCache:
    """The cache object of one forward pass over requests in ``slots``: transformers' attention
    layers call :meth:`update` with the new keys and values of the packed row ``[1, Hkv, T, d]``;
    request j's (offsets ``[s_j, s_j + n_j)``) are written at positions ``[L_j, L_j + n_j)`` of
    its slot (less the slot's offset in a sliding layer: :meth:`SlotKVPool.prepare`).

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
        stored = pool.prepare(slots, lengths, counts)
        self._groups = {window: GroupPass(window, pool.group_positions(window), slots, held,
                                          counts, self.starts, kernel, pool.device)
                        for window, held in stored.items()}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[SlotViews, SlotViews]:
        group = self._groups[self.pool.window_of[layer_idx]]
        return group.write(self.pool.keys[layer_idx], self.pool.values[layer_idx], key_states,
                           value_states, layer_idx, self.pool)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths)
