"""The target model as the speculative engine uses it: forward passes over per-request KV caches
that return next-token logits and, when a drafter needs them, the selected layers' hidden states.

Continuous batching: every request keeps its own KV cache (``TargetKV``), so requests join and
leave between steps. A step with one request (batch 1, the latency case) runs directly on that
request's Hugging Face ``DynamicCache``, as plain ``generate`` does, and afterwards drops the
positions it does not keep (rejected drafts never stay in it). A batched step left-pads the caches
into one ``DynamicCache``, right-pads the new tokens, and passes a 2-D attention mask and per-row
position ids, so one forward pass verifies every request's variable-length block at its own
positions; only the new tokens a request keeps are appended to its cache.

Logits are computed only where a caller needs them (``logits="last"`` for a prefill that samples
one token; all new positions for a verification).

Shapes: R requests, n new tokens, V vocabulary, m selected layers, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache


@dataclass
class TargetKV:
    """One request's target KV cache: a ``DynamicCache`` (batch 1) holding ``length`` committed
    positions; a forward pass may leave uncommitted positions behind, which the next pass drops."""

    cache: DynamicCache | None = None
    length: int = 0

    def settle(self) -> None:
        """Drop positions beyond the committed length (left by an uncommitted forward)."""
        if self.cache is not None:
            extra = self.cache.get_seq_length() - self.length
            if extra > 0:
                self.cache.crop(-extra)

    def layer(self, i: int):
        """(keys, values) of layer i, each [nkv, length, hd]."""
        layer = self.cache.layers[i]
        return layer.keys[0, :, :self.length], layer.values[0, :, :self.length]

    def append(self, new: list, keep: int, config) -> None:
        """Append the first ``keep`` positions of ``new`` (per layer (k, v) [nkv, n, hd])."""
        if keep <= 0:
            return
        self.settle()
        if self.cache is None:
            self.cache = DynamicCache(config=config)
        for i, (k, v) in enumerate(new):
            self.cache.update(k[None, :, :keep], v[None, :, :keep], i)
        self.length += keep


@dataclass
class BatchOutput:
    """Per-request results of a batched forward: logits fp32 [n_r, V] (or [1, V] with
    ``logits="last"``); features [n_r, m*H] or None. Call :meth:`keep` with the number of new
    positions the request commits (its cache holds them afterwards)."""

    logits: torch.Tensor
    features: torch.Tensor | None
    kv: TargetKV
    new_kv: list | None  # per layer (k, v) [nkv, n_r, hd]; None when the cache grew in place
    config: object = field(repr=False, default=None)

    def keep(self, count: int) -> None:
        """Commit the first ``count`` new positions to the request's cache."""
        if self.new_kv is None:
            self.kv.length += count
            self.kv.settle()
        else:
            self.kv.append(self.new_kv, count, self.config)


class TargetRunner:
    """Wraps a Hugging Face causal LM (frozen, eval mode).

    Args:
        model: ``AutoModelForCausalLM`` instance.
        layer_ids: 0-based decoder layers whose outputs form the drafter's context features
            (``hidden_states[l + 1]``; index 0 is the embedding output).
        pad_token_id: token used to right-pad new tokens (its outputs are discarded).
    Raises:
        ValueError: layer ids outside the model.
    """

    def __init__(self, model, layer_ids: list[int], pad_token_id: int = 0):
        self.model = model
        self.layer_ids = list(layer_ids)
        self.num_layers = model.config.num_hidden_layers
        self.pad_token_id = pad_token_id
        if self.layer_ids and (min(self.layer_ids) < 0 or max(self.layer_ids) >= self.num_layers):
            raise ValueError(f"layer ids {self.layer_ids} exceed the target's {self.num_layers} layers")

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def forward_batch(self, caches: list[TargetKV], tokens: list[list[int]],
                      with_features: bool, logits: str = "all") -> list[BatchOutput]:
        """Run each request's new ``tokens`` after what its cache holds, in one forward pass.

        Args:
            caches: R per-request caches (their committed positions are not modified; commit new
                ones with :meth:`BatchOutput.keep`).
            tokens: R non-empty token lists.
            with_features: also return the selected layers' hidden states.
            logits: ``"all"`` (every new position) or ``"last"`` (each request's last new token).
        Returns:
            R :class:`BatchOutput`.
        Raises:
            ValueError: an unknown ``logits`` mode.
        """
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        for c in caches:
            c.settle()
        if len(caches) == 1:
            return [self._forward_one(caches[0], tokens[0], with_features, logits)]
        r = len(caches)
        lengths = [c.length for c in caches]
        counts = [len(t) for t in tokens]
        past, new = max(lengths), max(counts)
        dev = self.device
        ids = torch.full((r, new), self.pad_token_id, dtype=torch.long, device=dev)
        mask = torch.zeros(r, past + new, dtype=torch.long, device=dev)
        for j, (t, l, n) in enumerate(zip(tokens, lengths, counts)):
            ids[j, :n] = torch.as_tensor(t, dtype=torch.long)
            mask[j, past - l:past + n] = 1  # left-padded past, right-padded new tokens
        positions = torch.tensor(lengths, device=dev)[:, None] + torch.arange(new, device=dev)
        cache = DynamicCache(config=self.model.config)
        if past:
            for i in range(self.num_layers):
                k0, v0 = caches[lengths.index(past)].layer(i)
                keys = k0.new_zeros(r, k0.shape[0], past, k0.shape[-1])
                values = torch.zeros_like(keys)
                for j, c in enumerate(caches):
                    if lengths[j]:
                        k, v = c.layer(i)
                        keys[j, :, past - lengths[j]:] = k
                        values[j, :, past - lengths[j]:] = v
                cache.update(keys, values, i)
        keep_idx = self._logit_positions(counts, logits, dev)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         cache=cache, use_cache=True, output_hidden_states=with_features,
                         logits_to_keep=keep_idx)
        all_logits = out.logits.float()
        feats = (torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
                 if with_features else None)
        kv = [(layer.keys[:, :, past:], layer.values[:, :, past:]) for layer in cache.layers]
        results = []
        for j, n in enumerate(counts):
            row = (all_logits[j, :n] if logits == "all"
                   else all_logits[j, (keep_idx == n - 1).nonzero()[0]])
            results.append(BatchOutput(row, None if feats is None else feats[j, :n], caches[j],
                                       [(k[j, :, :n], v[j, :, :n]) for k, v in kv],
                                       self.model.config))
        return results

    @staticmethod
    def _logit_positions(counts: list[int], logits: str, dev) -> torch.Tensor | int:
        """``logits_to_keep`` for the batch: 0 (all positions) or the sorted distinct last-token
        positions of the rows."""
        if logits == "all":
            return 0
        return torch.tensor(sorted({n - 1 for n in counts}), device=dev)

    def _forward_one(self, kv: TargetKV, tokens: list[int], with_features: bool,
                     logits: str) -> BatchOutput:
        """Batch 1: no padding, no copy; the request's own cache grows in place (uncommitted
        positions are dropped by the next :meth:`TargetKV.settle`)."""
        dev = self.device
        if kv.cache is None:
            kv.cache = DynamicCache(config=self.model.config)
        n = len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=dev)
        positions = torch.arange(kv.length, kv.length + n, device=dev)[None]
        out = self.model(input_ids=ids, position_ids=positions, cache=kv.cache, use_cache=True,
                         output_hidden_states=with_features,
                         logits_to_keep=0 if logits == "all" else 1)
        feats = (torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
                 if with_features else None)
        return BatchOutput(out.logits[0].float(), feats, kv, None, self.model.config)
