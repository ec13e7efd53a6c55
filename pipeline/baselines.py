"""What users already have: plain Hugging Face ``generate``, the baseline every speed-up is taken
against, and its prompt-lookup decoding (``prompt_lookup_num_tokens``), the training-free
speculative method a user would try first (Saxena 2023; transformers "assisted generation").

Sampling settings mirror the engine's: greedy at temperature 0, else pure temperature sampling
(top_k and top_p disabled, so the model's ``generation_config`` defaults do not change the
distribution); generation stops at the first of the shared EOS ids (``serve.engine.target_loading.eos_token_ids``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class PlainGeneration:
    """tokens: generated ids (the EOS that ended it included); seconds: wall-clock of the call."""

    tokens: list[int]
    seconds: float


def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                seed: int, eos_token_ids: list[int], pad_token_id: int | None = None,
                prompt_lookup_num_tokens: int = 0) -> PlainGeneration:
    """One request through ``model.generate`` (batch 1, KV cache, the model's own dtype).

    Args:
        prompt_ids: the rendered prompt; max_new_tokens: >= 1; temperature: 0 = greedy;
        seed: seeds torch's global RNG before sampling;
        prompt_lookup_num_tokens: > 0 turns on prompt-lookup decoding with that many
            candidate tokens per step.
    Returns:
        :class:`PlainGeneration` (output cut after the first EOS id).
    """
    import torch

    ids = torch.tensor([prompt_ids], device=model.device)
    kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=list(eos_token_ids),
                  pad_token_id=pad_token_id if pad_token_id is not None else eos_token_ids[0],
                  attention_mask=torch.ones_like(ids))
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    if prompt_lookup_num_tokens:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    seconds = time.perf_counter() - start
    tokens = out[0, len(prompt_ids):].tolist()
    eos = set(eos_token_ids)
    for i, tok in enumerate(tokens):
        if tok in eos:
            tokens = tokens[:i + 1]
            break
    return PlainGeneration(tokens, seconds)
