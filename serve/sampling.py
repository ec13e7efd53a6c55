"""Token sampling with temperature, top-k and top-p (nucleus) filtering.

Shapes: B rows, V vocabulary. Logits are processed in fp32.
"""

from __future__ import annotations

import torch


def sample_tokens(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample one token per row.

    top-k keeps the k most likely tokens (0 = all); top-p then keeps the smallest set of those whose
    probability mass reaches ``top_p`` (the most likely token is always kept).

    Args:
        logits: [B, V].
        temperature: 0 = greedy (argmax), else divides the logits.
        top_k: >= 0. top_p: in (0, 1].
    Returns:
        int64 [B].
    Raises:
        ValueError: negative temperature or top_k, top_p outside (0, 1].
    """
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"invalid sampling parameters: temperature={temperature}, top_k={top_k}, "
                         f"top_p={top_p}")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        values, index = logits.topk(top_k, dim=-1)  # sorted descending
    else:
        values, index = logits.sort(dim=-1, descending=True)
    if top_p < 1.0:
        probs = torch.softmax(values, dim=-1)
        mass_before = probs.cumsum(-1) - probs
        values = values.masked_fill(mass_before >= top_p, float("-inf"))
    choice = torch.multinomial(torch.softmax(values, dim=-1), 1, generator=generator)
    return index.gather(-1, choice).squeeze(-1)
