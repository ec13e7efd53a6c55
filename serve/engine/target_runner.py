"""The target model as the speculative engine uses it: forward passes over per-request KV caches
that return next-token logits and, when a drafter needs them, the selected layers' hidden states.

Continuous batching without copies: every request's keys and values live in its own slot of a
preallocated pool (``serve/engine/kv_pool.py``), written in place at the request's positions, so
requests join and leave between steps and one forward pass verifies every request's variable-length
block at its own positions. The new tokens of all requests are packed into one row (no padding: a
request verifying a long block does not make the others pay for it); attention runs per request over
a view of its slot; nothing is padded, gathered or concatenated per step. A pass writes all its new
positions; only the ones a request commits (:meth:`BatchOutput.keep`) count, and the rest are
overwritten by its next pass (rejected drafts never stay in a cache).

Logits are computed only where a caller needs them (``logits="last"`` for a prefill that samples
one token, ``"none"`` for a prefill chunk that samples nothing, all new positions for a
verification), and hidden states are kept only of the layers the drafter reads (forward hooks on
those layers, not ``output_hidden_states``).

Shapes: R requests, n_r new tokens of request r, T = sum n_r, V vocabulary, m selected layers, H hidden size.
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass, field

import torch

from . import slot_attention
from .decode_attention import MAX_QUERY_GROUPS, decode_kernel
from .kv_pool import PooledStepCache
from .kv_storage import SlotKVPool, window_positions
from .linear_state import LinearStates, RequestStates, linear_mixers
from .target_support import check_target_supported, probe

logger = logging.getLogger(__name__)


class TargetKV:
    """One request's target KV cache: a slot of its runner's pool holding ``length`` committed
    positions. The slot is taken at the request's first pass and returned to the pool by
    :meth:`release` (the engine calls it when the request finishes, fails or is aborted) or, at
    the latest, when this object is garbage-collected."""

    def __init__(self):
        self.length = 0
        self.slot: int | None = None
        self._pool: SlotKVPool | None = None
        self._finalizer: weakref.finalize | None = None
        self._released = False

    def release(self) -> None:
        """Return the slot to the pool now (idempotent); a later :meth:`bind` raises, so a
        released cache can never write into the slot's next owner."""
        if self._finalizer is not None:
            self._finalizer()  # runs pool.release(slot) once, and never again at collection
            self._released = True
            self._pool = self.slot = None

    def bind(self, pool: SlotKVPool) -> int:
        """The request's slot in ``pool`` (allocated on first use).

        Raises:
            ValueError: the cache already belongs to another runner's pool, or was released.
        """
        if self._released:
            raise ValueError("this TargetKV was released: its slot belongs to another request")
        if self._pool is None:
            self._pool, self.slot = pool, pool.allocate()
            self._finalizer = weakref.finalize(self, pool.release, self.slot)
        elif self._pool is not pool:
            raise ValueError("this TargetKV belongs to another TargetRunner")
        return self.slot


@dataclass
class BatchOutput:
    """Per-request results of a batched forward: logits fp32 [n_r, V] (``"last"``: [1, V];
    ``"none"``: None); features [n_r, m*H] or None. Call :meth:`keep` with the number of new
    positions the request commits. states: its linear-attention layers' states of this pass
    (hybrid targets; ``serve/engine/linear_state.py``), None otherwise; new: n_r."""

    logits: torch.Tensor | None
    features: torch.Tensor | None
    kv: TargetKV = field(repr=False)
    states: RequestStates | None = field(default=None, repr=False)
    new: int = 0

    def keep(self, count: int) -> None:
        """Commit the first ``count`` new positions (keys and values already written to the
        request's slot; linear-attention states committed, or recomputed over those positions
        when fewer than all are kept)."""
        self.kv.length += max(0, count)
        if self.states is not None:
            self.states.commit(count, self.new)


class TargetRunner:
    """Wraps a Hugging Face causal LM (frozen, eval mode).

    Args:
        model: ``AutoModelForCausalLM`` instance.
        layer_ids: 0-based decoder layers whose outputs form the drafter's context features
            (``hidden_states[l + 1]`` in transformers' numbering, where 0 is the embedding).
    Raises:
        ValueError: layer ids outside the model.
        UnsupportedTargetError: an architecture feature the engine cannot honour
            (``serve/engine/target_support.py``: named with the model type).
    """

    def __init__(self, model, layer_ids: list[int]):
        check_target_supported(model)
        self.model = model
        self.layer_ids = list(layer_ids)
        self.num_layers = model.config.num_hidden_layers
        if self.layer_ids and (min(self.layer_ids) < 0 or max(self.layer_ids) >= self.num_layers):
            raise ValueError(f"layer ids {self.layer_ids} exceed the target's {self.num_layers} layers")
        decoder = model.get_decoder()
        # the modules whose outputs are hidden_states[l + 1]: decoder layer l, except that
        # transformers reports the last layer's output after the final norm
        self._feature_modules = {l: decoder.norm if l == self.num_layers - 1 else decoder.layers[l]
                                 for l in self.layer_ids}
        self._pool: SlotKVPool | None = None
        # how decode and verify rows attend (EngineConfig.attention): each engine sets it before
        # its passes, since engines built on one set of models share this runner
        self.attention = "kernel"
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
        # attention over per-request slot views; any other call (plain generate) stays the
        # model's own: SDPA, or its eager attention where it was eager (sinks, a soft cap)
        own = getattr(model.config, "_attn_implementation", None) or "sdpa"
        # a model an earlier runner wrapped keeps the fallback that runner chose
        eager = (own in ("eager", slot_attention.ATTENTION_NAME + "_eager")
                 or getattr(model.config, "attn_logit_softcapping", None) is not None)
        model.set_attn_implementation(slot_attention.register(eager=eager))
        mixers = linear_mixers(model)
        # hybrid targets: each linear-attention layer's per-request conv and recurrent states
        self._linear = LinearStates(mixers) if mixers else None
        self.stateless_layers = frozenset(mixers)  # no keys and values in the KV pool
        self.layer_windows: dict[int, int] = {}  # learnt from the probe's pass, below
        probe(self)
        # each layer's sliding window as transformers passes it to the layer's attention (the
        # model's own reading of its config: layer_types, use_sliding_window, max_window_layers
        # or a model-wide sliding_window), so a sliding layer's slots hold only its window
        self.layer_windows = {layer: window for layer, window
                              in self._pool.observed_windows.items() if window is not None}
        self._pool = None  # the probe's default-sized pool; the engine sizes its own
        # what one request's linear-attention states take (counted in the KV budget)
        self.state_bytes_per_request = self._linear.measure() if self._linear is not None else 0

    def use_decode_kernel(self, enabled: bool) -> bool:
        """Set :attr:`attention` to "kernel" (``enabled``) or "pytorch"; returns whether the
        kernel is then in use (:attr:`decode_kernel`)."""
        self.attention = "kernel" if enabled else "pytorch"
        return self.decode_kernel is not None

    @property
    def decode_kernel(self):
        """The decode attention kernel (:func:`serve.engine.decode_attention.decode_kernel`,
        built on first use) when :attr:`attention` is "kernel" and it applies, else None: not
        where it cannot be built (a warning says why), on a GPU, for a dtype other than float32 /
        bfloat16, with more than 8 query heads per key/value head, or for a target with a logit
        soft cap (Gemma 2: PyTorch applies it)."""
        if self.attention != "kernel" or not self._kernel_applies:
            return None
        return decode_kernel()

    @functools.cached_property
    def _kernel_applies(self) -> bool:
        cfg = self.model.config
        heads = getattr(cfg, "num_attention_heads", 0)
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        return (self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
                and getattr(cfg, "attn_logit_softcapping", None) is None and bool(kv_heads) and heads % kv_heads == 0
                and 1 <= heads // kv_heads <= MAX_QUERY_GROUPS)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def forward_batch(self, caches: list[TargetKV], tokens: list[list[int]],
                      with_features: bool, logits: str | list[str] = "all") -> list[BatchOutput]:
        """Run each request's new ``tokens`` after what its cache holds, in one forward pass.

        Args:
            caches: R per-request caches (their committed positions are not modified; commit new
                ones with :meth:`BatchOutput.keep`).
            tokens: R non-empty token lists.
            with_features: also return the selected layers' hidden states.
            logits: ``"all"`` (every new position), ``"last"`` (each request's last new token)
                or ``"none"`` (a prefill chunk: no LM head output is needed); one mode for all,
                or one per request (a pass that verifies some requests and prefills others).
        Returns:
            R :class:`BatchOutput`.
        Raises:
            ValueError: an unknown ``logits`` mode, or a cache of another runner.
        """
        modes = [logits] * len(tokens) if isinstance(logits, str) else list(logits)
        if len(modes) != len(tokens) or any(m not in ("all", "last", "none") for m in modes):
            raise ValueError(f"logits must be 'all', 'last' or 'none' (one, or one per request), "
                             f"got {logits!r}")
        pool = self._kv_pool()
        slots = [c.bind(pool) for c in caches]
        lengths = [c.length for c in caches]
        counts = [len(t) for t in tokens]
        if min(counts, default=0) < 1:
            raise ValueError("every request needs at least one new token")
        dev = self.device
        # packed: every request's new tokens one after another in a single row, so a request
        # verifying a long block never pads the others (a pass costs the tokens it runs)
        ends = torch.tensor(counts).cumsum(0).tolist()
        starts = [e - n for e, n in zip(ends, counts)]
        ids = torch.tensor([t for row in tokens for t in row], dtype=torch.long, device=dev)[None]
        positions = torch.cat([torch.arange(l, l + n) for l, n in zip(lengths, counts)]).to(dev)[None]
        keep_idx = self._logit_positions(starts, ends, modes, dev)
        captured: dict[int, torch.Tensor] = {}
        hooks = ([self._feature_modules[i].register_forward_hook(self._capture(i, captured))
                  for i in self.layer_ids] if with_features else [])
        step_cache = PooledStepCache(pool, slots, lengths, counts, self.decode_kernel)
        states = ([self._linear.for_pass(s, l == 0) for s, l in zip(slots, lengths)]
                  if self._linear is not None else None)
        step_cache.linear_states = states
        try:
            # the 1x1 4-D mask makes transformers skip building a [1, 1, T, L] mask: the
            # per-request causal masks live in the step cache (serve/engine/kv_pool.py)
            out = self.model(input_ids=ids, attention_mask=self._no_mask, position_ids=positions,
                             cache=step_cache, use_cache=True, logits_to_keep=keep_idx)
        finally:
            for h in hooks:
                h.remove()
        kept = out.logits[0].float() if any(m != "none" for m in modes) else None
        feats = (torch.cat([captured[i][0] for i in self.layer_ids], dim=-1)
                 if with_features else None)
        results, at = [], 0  # at: the request's first row in ``kept`` (kept rows are in order)
        for j, (a, e, mode) in enumerate(zip(starts, ends, modes)):
            width = {"all": e - a, "last": 1, "none": 0}[mode]
            row = kept[at:at + width] if width else None
            at += width
            results.append(BatchOutput(row, None if feats is None else feats[a:e], caches[j],
                                       None if states is None else states[j], e - a))
        return results

    def forward_isolated(self, caches: list[TargetKV], tokens: list[list[int]],
                         with_features: bool, logits: str | list[str] = "all"
                         ) -> list[BatchOutput | Exception]:
        """:meth:`forward_batch`, except that a pass that raises is run again one request at a
        time, so a request whose own tokens make the target raise fails alone: its entry is the
        exception, the others' their outputs. Running again is safe: a pass writes only positions
        no request has committed yet (its next pass overwrites them), and nothing is committed
        before :meth:`BatchOutput.keep`.

        Args: as :meth:`forward_batch`.
        Returns:
            R entries, each a :class:`BatchOutput` or the exception its request's pass raised.
        Raises:
            the packed pass's exception when every request of two or more also raises alone
            (a failure of the engine, not of one request's input: the caller's to handle).
        """
        try:
            return self.forward_batch(caches, tokens, with_features=with_features, logits=logits)
        except Exception as err:  # noqa: BLE001 - whose input raised is found by running each alone
            if len(tokens) == 1:
                return [err]
            packed_error = err
            logger.warning("a packed target pass of %d requests raised (%s: %s); running each "
                           "alone", len(tokens), type(err).__name__, err)
        modes = [logits] * len(tokens) if isinstance(logits, str) else list(logits)
        results: list[BatchOutput | Exception] = []
        for cache, row, mode in zip(caches, tokens, modes):
            try:
                results.append(self.forward_batch([cache], [row], with_features=with_features,
                                                  logits=mode)[0])
            except Exception as err:  # noqa: BLE001 - this request's own pass raised
                results.append(err)
        if all(isinstance(r, Exception) for r in results):
            # no request's own input is at fault: the engine's (a bug, memory), not theirs
            raise packed_error
        return results

    def reserve(self, cache: TargetKV, length: int) -> None:
        """Give ``cache`` its slot and room for ``length`` positions now (at admission), so the
        passes that follow never grow the pool."""
        pool = self._kv_pool()
        cache.bind(pool)
        pool.reserve(length)

    def preallocate(self, slots: int, max_positions: int, memory_bytes: int,
                    pass_tokens: int = 64) -> dict:
        """Size the KV pool before serving: ``slots`` slots of ``max_positions`` positions (a
        sliding-window layer's slots only what its window needs: ``kv_storage.window_positions``),
        or as many positions as ``memory_bytes`` allows (at least 1). An idle pool (left by
        profiling or an earlier engine) is replaced; one that holds live requests (a runner shared
        by several engines) is only grown.

        Args:
            slots: live requests (the engine's ``max_num_requests``).
            max_positions: the longest request in tokens (max_model_len + a draft block).
            memory_bytes: the pool's budget (keys and values of every layer, and a hybrid
                target's linear-attention states: :attr:`state_bytes_per_request` per slot),
                bytes; the caller checks that the positions it buys are enough (the engine
                refuses < 16).
            pass_tokens: the most tokens one request runs in one pass (a prompt chunk or a draft
                block), which a sliding layer's slot must hold beside its window.
        Returns:
            the pool's :meth:`SlotKVPool.state`.
        """
        kv_bytes = max(0, memory_bytes - slots * self.state_bytes_per_request)
        low, high = 1, max(1, max_positions)  # the most positions whose slots fit kv_bytes
        while low < high:
            mid = (low + high + 1) // 2
            if slots * self.slot_bytes(mid, pass_tokens) <= kv_bytes:
                low = mid
            else:
                high = mid - 1
        capacity = low
        old = self._pool
        if old is None or len(old.free_slots) == old.num_slots:
            # an idle pool (profiling, or another engine on this runner) is replaced, never
            # shrunk below what that engine was promised
            if old is not None:
                capacity, slots = max(capacity, old.capacity), max(slots, old.num_slots)
            self._pool = None  # the idle pool's memory goes before the new one is taken
            self._pool = self._new_pool(slots, capacity, pass_tokens)
        else:  # live requests hold slots: grow to exactly what this engine needs as well
            if capacity > old.capacity:
                old.grow_positions(capacity)
            old.reserve_window_positions(pass_tokens)
            old.reserve_slots(old.num_slots - len(old.free_slots) + slots)
        return self._pool.state()

    def slot_bytes(self, positions: int, pass_tokens: int) -> int:
        """Bytes of keys and values one slot of ``positions`` positions takes over every layer
        that keeps them (a sliding layer: at most its window's :func:`window_positions`)."""
        kv_heads, head_dim = self._kv_shape()
        per_layer = SlotKVPool.bytes_per_position(1, kv_heads, head_dim, self.dtype)
        held = 0
        for layer in range(self.num_layers):
            if layer in self.stateless_layers:
                continue
            window = self.layer_windows.get(layer)
            held += positions if window is None else min(positions,
                                                        window_positions(window, pass_tokens))
        return per_layer * held

    def _new_pool(self, slots: int = 4, capacity: int = 256, pass_tokens: int = 64) -> SlotKVPool:
        kv_heads, head_dim = self._kv_shape()
        return SlotKVPool(self.num_layers, kv_heads, head_dim, self.dtype, self.device,
                          slots=slots, capacity=capacity, stateless=self.stateless_layers,
                          windows=self.layer_windows, pass_tokens=pass_tokens)

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep keys and values in the KV pool (all but linear-attention ones)."""
        return self.num_layers - len(self.stateless_layers)

    def kv_pool_state(self) -> dict:
        """The KV pool's :meth:`SlotKVPool.state` (created with its defaults if needed)."""
        return self._kv_pool().state()

    def _kv_shape(self) -> tuple[int, int]:
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim

    def _kv_pool(self) -> SlotKVPool:
        if self._pool is None:  # callers that never preallocated (tests, one-off passes)
            self._pool = self._new_pool()
        return self._pool

    @staticmethod
    def _capture(layer: int, into: dict):
        def hook(module, args, output):
            into[layer] = output[0] if isinstance(output, tuple) else output
        return hook

    @staticmethod
    def _logit_positions(starts: list[int], ends: list[int], modes: list[str],
                         dev) -> torch.Tensor | int:
        """``logits_to_keep`` for a packed pass whose request j spans [starts[j], ends[j]): 0 when
        every request wants all its positions, 1 when none wants any (the cheapest legal
        choice), else the wanted positions in request order."""
        if all(m == "all" for m in modes):
            return 0
        if all(m == "none" for m in modes):
            return 1
        wanted: list[int] = []
        for a, e, m in zip(starts, ends, modes):
            wanted += range(a, e) if m == "all" else [e - 1] if m == "last" else []
        return torch.tensor(wanted, device=dev)
