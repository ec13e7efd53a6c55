"""The target model as the speculative engine uses it: forward passes over a KV cache that return
next-token logits and, when a drafter needs them, the selected layers' hidden states.

Shapes: n new tokens, V vocabulary, m selected layers, H hidden size.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class TargetRunner:
    """Wraps a Hugging Face causal LM (frozen, eval mode).

    Args:
        model: ``AutoModelForCausalLM`` instance.
        layer_ids: 0-based decoder layers whose outputs form the drafter's context features
            (``hidden_states[l + 1]``; index 0 is the embedding output).
    """

    def __init__(self, model, layer_ids: list[int]):
        self.model = model
        self.layer_ids = list(layer_ids)
        self.num_layers = model.config.num_hidden_layers
        if self.layer_ids and (min(self.layer_ids) < 0 or max(self.layer_ids) >= self.num_layers):
            raise ValueError(f"layer ids {self.layer_ids} exceed the target's {self.num_layers} layers")

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.no_grad()
    def forward(self, cache: DynamicCache, tokens: list[int] | torch.Tensor, with_features: bool):
        """Run ``tokens`` after what ``cache`` holds.

        Returns:
            (logits fp32 [n, V], features [n, m*H] in the model dtype or None).
        """
        ids = torch.as_tensor(tokens, dtype=torch.long).view(1, -1)
        out = self.model(input_ids=ids, cache=cache, use_cache=True,
                         output_hidden_states=with_features)
        logits = out.logits[0].float()
        if not with_features:
            return logits, None
        feats = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        return logits, feats

    @staticmethod
    def crop(cache: DynamicCache, length: int) -> None:
        """Drop cached positions >= ``length`` (rejected draft tokens)."""
        excess = cache.get_seq_length() - length
        if excess > 0:  # transformers 5 crops by a negative count of tokens to remove
            cache.crop(-excess)
