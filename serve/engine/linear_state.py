"""Recurrent and convolution states of hybrid targets' linear-attention layers (Gated DeltaNet in
Qwen3-Next and Qwen3.5), per request, with the rollback speculative verification needs.

A linear-attention layer keeps no keys and values: it carries a fixed-size state per request (a
short causal-convolution window ``[C, K]`` and a recurrent matrix ``[heads, d_k, d_v]``) that
every token updates. The engine's packed pass puts many requests in one row, so each such layer's
token mixer runs once per request over its own tokens, through the model's own code, with a
per-request cache object (:class:`RequestStates`) that speaks transformers' linear-attention cache
interface (``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``,
``update_recurrent_state``).

Rollback: a verification pass runs [anchor, x_1..x_l] through the recurrence, but only the
accepted prefix may stay in the state. The pass therefore never writes the committed state: it
reads a copy and returns its new states to :class:`RequestStates`, which commits them when the
request keeps every new position (a prefill chunk, a fully accepted block) and otherwise
recomputes the state from the committed one over the accepted positions only, by running each
linear layer's mixer again on the inputs it saw in the pass (recorded; the same for the accepted
prefix, since every layer is causal). Measured against keeping a snapshot per verified position,
this stores nothing per position and costs one mixer pass over <= gamma + 1 tokens per linear
layer, only for requests whose block was cut.
"""

from __future__ import annotations

import inspect

import torch

from .errors import UnsupportedTargetError

# transformers' layer types whose token mixer carries a conv + recurrent state
LINEAR_LAYER_TYPES = frozenset({"linear_attention"})


def linear_mixers(model) -> dict[int, torch.nn.Module]:
    """Layer index -> the token mixer of each linear-attention layer of ``model``: the decoder
    layer's child module whose ``forward`` takes ``cache`` and whose ``layer_idx`` is the layer's.

    Raises:
        UnsupportedTargetError: a linear-attention layer without exactly one such module.
    """
    types = list(getattr(model.config, "layer_types", None) or [])
    layers = model.get_decoder().layers
    found = {}
    for i, kind in enumerate(types):
        if kind not in LINEAR_LAYER_TYPES:
            continue
        mixers = [m for _, m in layers[i].named_children()
                  if getattr(m, "layer_idx", None) == i
                  and "cache" in inspect.signature(m.forward).parameters]
        if len(mixers) != 1:
            raise UnsupportedTargetError(
                f"target model type {model.config.model_type!r}: layer {i} ({kind!r}) has no "
                f"token mixer the engine can give a per-request state")
        found[i] = mixers[0]
    return found


def _split_per_request(mixer: torch.nn.Module, layer: int) -> None:
    """Make ``mixer.forward`` run once per request of a packed engine pass, each with its own
    states (the pass's cache carries them: ``linear_states``); any other call (plain
    ``generate``) is the model's own. Done once per module (``dspark_own_forward`` keeps the
    model's), so several runners on one model never stack wrappers."""
    if hasattr(mixer, "dspark_own_forward"):
        return
    original = mixer.forward
    mixer.dspark_own_forward = original

    def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
        per_request = getattr(cache, "linear_states", None)
        if per_request is None:
            return original(hidden_states=hidden_states, cache=cache,
                            attention_mask=attention_mask, **kwargs)
        outs = []
        for states, s, n in zip(per_request, cache.starts, cache.counts):
            x = hidden_states[:, s:s + n]
            states.inputs[layer] = x
            outs.append(original(hidden_states=x, cache=states, attention_mask=None, **kwargs))
        return torch.cat(outs, dim=1)

    mixer.forward = forward


class LinearStates:
    """The committed states of every request slot: ``states[slot][layer] = (conv, recurrent)``,
    tensors of one request (``[1, C, K]`` and ``[1, heads, d_k, d_v]``). A slot's states are
    valid only while its request has committed positions (a fresh request starts from none,
    whatever an earlier owner of the slot left)."""

    def __init__(self, mixers: dict[int, torch.nn.Module]):
        self.mixers = mixers
        for i, m in mixers.items():
            _split_per_request(m, i)
        # the model's own forwards (replay); wrapped once per model, whatever runners share it
        self._originals = {i: m.dspark_own_forward for i, m in mixers.items()}
        self.states: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def measure(self) -> int:
        """Bytes one request's states take, read off the states the build probe committed (then
        dropped): every linear layer's conv and recurrent state, twice (the committed states
        and the copies a pass works on)."""
        sizes = [sum(t.numel() * t.element_size() for t in pair)
                 for layers in self.states.values() for pair in layers.values()]
        per_request = sum(sizes) // max(1, len(self.states))
        self.states.clear()
        return 2 * per_request

    def for_pass(self, slot: int, fresh: bool) -> "RequestStates":
        """The cache object of one request in one pass (``fresh``: no committed position)."""
        return RequestStates(self, slot, fresh)

    @torch.inference_mode()  # keep() may be called outside the engine's step
    def replay(self, slot: int, fresh: bool, inputs: dict[int, torch.Tensor], count: int
               ) -> None:
        """Commit the state after the first ``count`` tokens of a pass: each mixer again over
        its recorded inputs ``[1, count, H]`` from the committed state (none when ``fresh``)."""
        again = RequestStates(self, slot, fresh)
        for layer, x in inputs.items():
            self._originals[layer](hidden_states=x[:, :count], cache=again, attention_mask=None)
        again.commit_all()


class RequestStates:
    """One request's linear-attention states in one pass, as transformers' cache interface: the
    committed states are read as copies (the mixer may update a conv state in place), the new
    ones are kept here until :meth:`commit`."""

    def __init__(self, owner: LinearStates, slot: int, fresh: bool):
        self.owner, self.slot = owner, slot
        committed = {} if fresh else owner.states.get(slot, {})
        self.conv = {i: c.clone() for i, (c, _) in committed.items()}
        self.recurrent = {i: r.clone() for i, (_, r) in committed.items()}
        self.fresh = fresh or not committed
        self._fresh_pass = fresh
        self.inputs: dict[int, torch.Tensor] = {}  # layer -> the mixer's input in this pass

    # transformers' linear-attention cache interface (cache_utils.Cache)
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv.get(layer_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent.get(layer_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None
                           ) -> bool:
        return not self.fresh

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """As transformers' ``LinearAttentionLayer.update_conv_state``: ``conv_states`` ``[1, C,
        n]`` after the committed window (or left-padded to the kernel in a first pass); keeps
        the last ``K`` columns; returns the whole window the convolution reads."""
        previous = self.conv.get(layer_idx)
        kernel = conv_kernel_size or (previous.shape[-1] if previous is not None
                                      else conv_states.shape[-1])
        if previous is None:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([previous, conv_states], dim=-1)
        self.conv[layer_idx] = full[..., -kernel:].clone()
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int,
                               state_idx: int = 0, **kwargs) -> torch.Tensor:
        self.recurrent[layer_idx] = recurrent_states
        return recurrent_states

    # the engine's side
    def commit(self, count: int, total: int) -> None:
        """The request keeps the first ``count`` of the pass's ``total`` new positions: all of
        them commit the pass's states, fewer recompute them over those positions
        (:meth:`LinearStates.replay`), none leave the committed states as they are."""
        if count >= total:
            self.commit_all()
        elif count > 0:
            self.owner.replay(self.slot, self._fresh_pass, self.inputs, count)

    def commit_all(self) -> None:
        self.owner.states[self.slot] = {i: (self.conv[i], self.recurrent[i])
                                        for i in self.conv}
