"""Tiny randomly initialised Qwen3 target and DSpark drafter for fast tests."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from drafters import DrafterBase, DrafterConfig
from drafters.loading import build_drafter
from drafters.registry import get_spec


def tiny_target(vocab_size: int = 96, seed: int = 0, num_layers: int = 6) -> Qwen3ForCausalLM:
    """A 6-layer, 64-wide Qwen3 with a small vocabulary, fp32, eval mode."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
                      eos_token_id=1, pad_token_id=0, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg).eval()
    # sharpen the random model's distributions a little so greedy text is not pure noise
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)
    model.requires_grad_(False)
    return model


def tiny_drafter(target, layer_ids=(1, 3), block_size: int = 4, head_type: str = "markov",
                 num_layers: int = 1, seed: int = 0, drafter_type: str = "dspark",
                 draft_vocab: list[int] | None = None, sliding_window="target",
                 anchor_features: bool = False) -> DrafterBase:
    """A 1-layer drafter for ``target``; ``draft_vocab`` (target ids) makes it predict in that
    subset only (``drafters/draft_vocab.py``); ``sliding_window`` and ``anchor_features`` as the
    config fields."""
    torch.manual_seed(seed)
    spec = get_spec(drafter_type)
    options = {"num_layers": num_layers}
    if spec.has_option("head_type"):
        options.update(head_type=head_type, markov_rank=16)
    if spec.has_option("sliding_window"):
        options.update(sliding_window=sliding_window, anchor_features=anchor_features)
    cfg = DrafterConfig(
        drafter_type=drafter_type, block_size=block_size, options=options, qk_norm=True,
        draft_vocab_size=len(draft_vocab) if draft_vocab else 0,
    ).for_target(target.config, "tiny-qwen3", list(layer_ids))
    cfg.target.max_position_embeddings = 512
    emb = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    return build_drafter(cfg, emb, head, draft_vocab).eval()
