"""Where the target's keys and values live: one preallocated tensor per layer, one slot per
request, and a sliding-window layer holding only what its window can still see.

Shapes: each layer's keys and values are ``[slots, Hkv, positions, d]``. A full-attention layer's
slot holds the request's positions from 0 (``capacity`` of them: the engine's model length plus a
draft block). A sliding-window layer (query position p sees keys (p - window, p]) never needs a key
more than ``window - 1`` positions behind the first token of a pass, so its slot holds
:func:`window_positions` positions, stored from a per-slot offset: position p of the request is
stored at ``p - offset``. Layers are grouped by window (None: full attention); every layer of a
group shares the offsets, so one forward pass plans its writes and masks once per group.

When a pass would write past a sliding group's slot, :meth:`SlotKVPool.prepare` first moves the
last ``window - 1`` committed keys of every layer of the group to the slot's start (one copy per
layer, at most once per ``window`` tokens a request decodes), so every slot stays one contiguous
range that the decode attention kernel and SDPA read in place. Only committed positions are kept:
a rejected draft's keys are past the committed length and are overwritten by the next pass either
way.

The engine sizes the pool once at start-up (``max_num_requests`` slots of ``max_model_len`` + a
draft block positions, fewer positions if ``engine.kv_cache_memory_gib`` holds fewer; the
engine's model length is then what a slot holds) and allocates it whole, zero-filled, so its
memory is committed before the first request, as a serving engine's KV cache is: serving never
grows it, and a growing resident size means a leak elsewhere. A pool used outside the engine
(tests, profiling) doubles its slots or positions when a pass needs more room (an amortised copy,
never a per-step one; counted in :attr:`SlotKVPool.reallocations`). A slot returns to the pool the
moment its request finishes, fails or is aborted
(:meth:`serve.engine.target_runner.TargetKV.release`), and at the latest when its cache object is
garbage-collected.

At a 32 k model length with the engine's 2,048-token prompt chunks, bf16, a request of
transformers' default Gemma 3 config then takes 0.42x the keys of full-length slots, Mistral's
0.31x, gpt-oss's 0.54x (``benchmarks/results/target_families/2026-12-04_unrecorded.md``).
"""

from __future__ import annotations

import torch

ALL_GROUPS = object()  # SlotKVPool._grow: every layer, whatever its window

def window_positions(window: int, pass_tokens: int) -> int:
    """Positions one slot of a sliding layer holds: the ``window - 1`` committed keys the first
    token of a pass still sees, the pass's own ``pass_tokens`` (the longest prompt chunk or draft
    block one request runs), and ``window`` more, so that the keys are moved back at most once per
    ``window`` tokens (the move copies ``window - 1`` keys: ~1 key copied per token decoded)."""
    return 2 * window - 1 + pass_tokens


class SlotKVPool:
    """Per-layer key/value storage with one slot per live request.

    Args:
        num_layers: decoder layers of the target.
        kv_heads, head_dim: the layers' key/value heads and head dimension.
        dtype, device: of the stored keys and values (the target's).
        slots: initial slot count (grows by doubling).
        capacity: positions per slot of a full-attention layer (grows by doubling): the longest
            request the pool holds.
        stateless: layers that keep no keys and values (a hybrid target's linear-attention
            layers, whose states live in ``serve/engine/linear_state.py``): None in
            :attr:`keys` / :attr:`values`, no memory.
        windows: layer -> its sliding window in keys (what transformers passes the layer's
            attention; :attr:`observed_windows` of a pool without windows records it). Layers not
            named attend every earlier position.
        pass_tokens: the most tokens one request runs in one pass, for sizing a sliding layer's
            slot (:func:`window_positions`, at most ``capacity``; a longer pass grows it).
    Raises:
        ValueError: a window below 1.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, slots: int = 4, capacity: int = 256,
                 stateless: frozenset[int] = frozenset(), windows: dict[int, int] | None = None,
                 pass_tokens: int = 64):
        windows = {l: w for l, w in (windows or {}).items() if l not in stateless}
        if any(w < 1 for w in windows.values()):
            raise ValueError(f"sliding windows must be >= 1 keys, got {windows}")
        #: per layer, its group: its sliding window, or None (full attention)
        self.window_of: list[int | None] = [windows.get(i) for i in range(num_layers)]
        self._groups: dict[int | None, list[int]] = {}
        for i in range(num_layers):
            if i not in stateless:
                self._groups.setdefault(self.window_of[i], []).append(i)
        self._capacity = capacity

        def positions(layer: int) -> int:
            window = self.window_of[layer]
            return capacity if window is None else min(capacity, window_positions(window, pass_tokens))

        # zero-filled: the memory is committed now (on CPU, untouched pages would only become
        # resident as slots fill up, which looks like a leak under load)
        self.keys = [None if i in stateless else
                     torch.zeros((slots, kv_heads, positions(i), head_dim), dtype=dtype,
                                 device=device) for i in range(num_layers)]
        self.values = [None if t is None else torch.zeros_like(t) for t in self.keys]
        self._first = next(i for i, t in enumerate(self.keys) if t is not None)
        #: per sliding group, per slot: the request position stored at the slot's position 0
        self.offsets: dict[int, list[int]] = {w: [0] * slots for w in self._groups if w}
        self.free_slots = list(range(slots - 1, -1, -1))  # pop() hands out the lowest first
        self.reallocations = 0  # growths so far (the engine reserves at admission, not later)
        #: layer -> the sliding window its attention was called with (None: full attention),
        #: recorded by ``serve.engine.slot_attention.slot_attention``
        self.observed_windows: dict[int, int | None] = {}

    @property
    def num_slots(self) -> int:
        return self.keys[self._first].shape[0]

    @property
    def capacity(self) -> int:
        """Positions of a request the pool holds: a full-attention layer's slot (a target whose
        layers all slide holds any length, and this is the length it was sized for)."""
        return self._capacity

    def group_positions(self, window: int | None) -> int:
        """Positions one slot of a layer of this group holds (``capacity`` for full attention)."""
        if window is None:
            return self._capacity
        return self.keys[self._groups[window][0]].shape[2]

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
        """Size and use for operators: slots, free slots, positions per slot (``capacity``; and
        per sliding window, ``window_positions``), bytes, growths."""
        return {"slots": self.num_slots, "free_slots": len(self.free_slots),
                "capacity": self.capacity, "bytes": self.nbytes,
                "window_positions": {w: self.group_positions(w) for w in self.offsets},
                "reallocations": self.reallocations}

    def allocate(self) -> int:
        """A free slot (the pool doubles its slots when none is left)."""
        if not self.free_slots:
            old = self.num_slots
            self._grow(dim=0, size=2 * old)
            self.free_slots = list(range(2 * old - 1, old - 1, -1))
        slot = self.free_slots.pop()
        for offsets in self.offsets.values():
            offsets[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.free_slots.append(slot)

    def reserve(self, length: int) -> None:
        """Make every slot hold at least ``length`` positions (doubling the capacity)."""
        if length > self._capacity:
            size = self._capacity
            while size < length:
                size *= 2
            self._grow(dim=2, size=size, window=None)

    def grow_positions(self, capacity: int) -> None:
        """Make a full-attention slot hold exactly ``capacity`` positions (no doubling)."""
        if capacity > self._capacity:
            self._grow(dim=2, size=capacity, window=None)

    def reserve_window_positions(self, pass_tokens: int) -> None:
        """Make each sliding layer's slot hold :func:`window_positions` for passes of
        ``pass_tokens`` (at most ``capacity``): an engine sharing a live pool with another."""
        for window in self.offsets:
            size = min(self._capacity, window_positions(window, pass_tokens))
            if size > self.group_positions(window):
                self._grow(dim=2, size=size, window=window)

    def reserve_slots(self, slots: int) -> None:
        """Make the pool hold at least ``slots`` slots (new ones are free)."""
        old = self.num_slots
        if slots > old:
            self._grow(dim=0, size=slots)
            self.free_slots = list(range(slots - 1, old - 1, -1)) + self.free_slots

    def prepare(self, slots: list[int], lengths: list[int], counts: list[int]
                ) -> dict[int | None, list[int]]:
        """Make room for a pass that writes ``counts[j]`` positions after the ``lengths[j]``
        committed ones of the request in ``slots[j]``: grow the full-attention capacity if needed,
        and in each sliding group move a slot's last ``window - 1`` committed keys to its start
        where the pass would otherwise run past its end (growing the group only for a pass
        longer than it was sized for).

        Returns:
            per group (its window, or None), each request's committed length as stored in that
            group's slots (``lengths[j]`` minus the slot's offset).
        """
        if None in self._groups:  # (a target whose layers all slide holds any length)
            self.reserve(max(l + n for l, n in zip(lengths, counts)))
        stored: dict[int | None, list[int]] = {}
        if None in self._groups:
            stored[None] = list(lengths)
        for window, offsets in self.offsets.items():
            size = self.group_positions(window)
            for slot, length, count in zip(slots, lengths, counts):
                if length - offsets[slot] + count <= size:
                    continue
                start = max(offsets[slot], length - (window - 1))  # the oldest key still seen
                if length - start + count > size:
                    size = max(2 * size, length - start + count)
                    self._grow(dim=2, size=size, window=window)
                self._move_back(window, slot, start - offsets[slot], length - start)
                offsets[slot] = start
            stored[window] = [l - offsets[s] for s, l in zip(slots, lengths)]
        return stored

    def _move_back(self, window: int, slot: int, source: int, count: int) -> None:
        """Copy ``count`` stored positions from ``source`` to the slot's start in every layer of
        the sliding group ``window`` (the ranges may overlap: the source is copied out first)."""
        if source == 0 or count == 0:
            return
        for i in self._groups[window]:
            for store in (self.keys, self.values):
                t = store[i][slot]
                t[:, :count] = t[:, source:source + count].clone()

    def _grow(self, dim: int, size: int, window: int | None | object = ALL_GROUPS) -> None:
        """Grow dimension ``dim`` (0: slots, 2: positions) to ``size`` in every layer, or in
        the layers of the group ``window`` only (positions)."""
        self.reallocations += 1
        if dim == 2 and window is None:
            self._capacity = size
        if dim == 0:
            for offsets in self.offsets.values():
                offsets.extend([0] * (size - len(offsets)))
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is None or (window is not ALL_GROUPS and self.window_of[i] != window):
                    continue
                shape = list(t.shape)
                shape[dim] = size
                grown = t.new_zeros(shape)
                grown.narrow(dim, 0, t.shape[dim]).copy_(t)
                store[i] = grown
