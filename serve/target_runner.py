"""The target model as the speculative engine uses it: forward passes over per-request KV caches
that return next-token logits and, when a drafter needs them, the selected layers' hidden states.

Continuous batching: every request keeps its own KV cache (``TargetKV``), so requests join and
leave between steps. A batched step left-pads the caches into one Hugging Face ``DynamicCache``,
right-pads the new tokens, and passes a 2-D attention mask and per-row position ids, so one
forward pass verifies every request's variable-length block at its own positions. Only the new
tokens a request keeps are copied back into its cache (rejected drafts never enter it).

Shapes: R requests, n new tokens, V vocabulary, m selected layers, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache


@dataclass
class TargetKV:
    """One request's target KV cache: per layer (keys, values), each [nkv, L, hd]."""

    layers: list = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.layers else self.layers[0][0].shape[1]

    def append(self, new: list, keep: int) -> None:
        """Append the first ``keep`` positions of ``new`` (per layer (k, v) [nkv, n, hd])."""
        if keep <= 0:
            return
        if not self.layers:
            self.layers = [(k[:, :keep].clone(), v[:, :keep].clone()) for k, v in new]
            return
        self.layers = [(torch.cat((k, nk[:, :keep]), dim=1), torch.cat((v, nv[:, :keep]), dim=1))
                       for (k, v), (nk, nv) in zip(self.layers, new)]


@dataclass
class BatchOutput:
    """Per-request results of a batched forward: logits fp32 [n_r, V]; features [n_r, m*H] or
    None; new_kv: per layer (k, v) [nkv, n_r, hd], to be kept with :meth:`TargetKV.append`."""

    logits: torch.Tensor
    features: torch.Tensor | None
    new_kv: list


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

    @torch.no_grad()
    def forward_batch(self, caches: list[TargetKV], tokens: list[list[int]],
                      with_features: bool) -> list[BatchOutput]:
        """Run each request's new ``tokens`` after what its cache holds, in one forward pass.

        Args:
            caches: R per-request caches (not modified; keep tokens with ``TargetKV.append``).
            tokens: R non-empty token lists.
            with_features: also return the selected layers' hidden states.
        Returns:
            R :class:`BatchOutput`.
        """
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
                k0, v0 = caches[lengths.index(past)].layers[i]
                keys = k0.new_zeros(r, k0.shape[0], past, k0.shape[-1])
                values = torch.zeros_like(keys)
                for j, c in enumerate(caches):
                    if lengths[j]:
                        keys[j, :, past - lengths[j]:] = c.layers[i][0]
                        values[j, :, past - lengths[j]:] = c.layers[i][1]
                cache.update(keys, values, i)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         cache=cache, use_cache=True, output_hidden_states=with_features)
        logits = out.logits.float()
        feats = (torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
                 if with_features else None)
        kv = [(layer.keys[:, :, past:], layer.values[:, :, past:]) for layer in cache.layers]
        return [BatchOutput(logits[j, :n], None if feats is None else feats[j, :n],
                            [(k[j, :, :n], v[j, :, :n]) for k, v in kv])
                for j, n in enumerate(counts)]
