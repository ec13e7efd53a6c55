"""Tiny random-weight targets of every decoder family the engine is checked on (issue 40).

Each family is built from its own transformers config class (hidden 64, 4 layers, 4 query heads /
2 key/value heads, fp32), with a sliding window short enough (``WINDOW`` tokens) that test prompts
cross it, so a path that ignores the window or the attention sinks changes the output. The
targets go through ``save_pretrained`` / ``from_pretrained`` where a test needs a directory, as a
user's checkpoint does.
"""

from __future__ import annotations

import torch

WINDOW = 8
VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, eos_token_id=1, pad_token_id=0, bos_token_id=None)


def _configs(window: int = WINDOW, softcap: float | None = 2.0, **overrides) -> dict:
    """family name -> a function returning its transformers config (``overrides`` replace
    :data:`COMMON`'s values, e.g. a smaller vocabulary; ``softcap``: Gemma 2's attention logit
    soft cap, small enough to bind on these random weights)."""
    import transformers as tf

    COMMON = {**globals()["COMMON"], **overrides}
    WINDOW = window
    alternating = ["sliding_attention", "full_attention"] * (COMMON["num_hidden_layers"] // 2)

    def llama(tied=True):
        return lambda: tf.LlamaConfig(**COMMON, tie_word_embeddings=tied)

    return {
        "llama": llama(True),
        "llama-untied": llama(False),
        "qwen3": lambda: tf.Qwen3Config(**COMMON, tie_word_embeddings=True),
        "qwen3-moe": lambda: tf.Qwen3MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=4,
                                               num_experts_per_tok=2, decoder_sparse_step=1),
        "phi3": lambda: tf.Phi3Config(**{k: v for k, v in COMMON.items() if k != "head_dim"},
                                      sliding_window=WINDOW),
        "mistral": lambda: tf.MistralConfig(**COMMON, sliding_window=WINDOW),
        "qwen2-sliding": lambda: tf.Qwen2Config(
            **{k: v for k, v in COMMON.items() if k != "head_dim"}, use_sliding_window=True,
            sliding_window=WINDOW, max_window_layers=2),
        "gemma3": lambda: tf.Gemma3TextConfig(**COMMON, sliding_window=WINDOW,
                                              layer_types=alternating),
        "gemma2": lambda: tf.Gemma2Config(**COMMON, sliding_window=WINDOW, layer_types=alternating,
                                          attn_logit_softcapping=softcap),
        "gpt-oss": lambda: tf.GptOssConfig(**COMMON, sliding_window=WINDOW, num_local_experts=4,
                                           num_experts_per_tok=2,
                                           layer_types=alternating),
        "qwen3-next": lambda: tf.Qwen3NextConfig(
            **COMMON, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, full_attention_interval=2),
    }


FAMILIES = sorted(_configs())


SLIDING = ("gemma2", "gemma3", "gpt-oss", "mistral", "phi3", "qwen2-sliding")  # windowed layers
SUPPORTED = tuple(FAMILIES)  # what the engine serves
HYBRID = ("qwen3-next",)  # linear-attention layers (per-request states, rolled back)


def family_config(name: str, window: int = WINDOW, softcap: float | None = 2.0, **overrides):
    """The transformers config of family ``name`` (one of :data:`FAMILIES`) with a sliding
    window of ``window`` tokens where the family has one (and Gemma 2's soft cap ``softcap``);
    ``overrides`` replace :data:`COMMON`."""
    return _configs(window, softcap, **overrides)[name]()


def family_target(name: str, seed: int = 0, window: int = WINDOW, softcap: float | None = 2.0,
                  **overrides):
    """A tiny random target of family ``name``: fp32, eval mode, frozen. Its embeddings are
    sharpened (x4), where the family has attention sinks they are set to visible values, and
    where it has a soft cap its query and key projections are scaled up (x10 each) so that the
    cap binds: greedy text is not pure noise, and sinks and caps matter. The same ``seed`` gives
    the same weights whatever ``window`` is (a test compares with and without the window)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name, window, softcap, **overrides),
                                             dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(4.0)
        if getattr(model.config, "attn_logit_softcapping", None):  # scores large enough to cap
            for layer in model.get_decoder().layers:
                layer.self_attn.q_proj.weight.mul_(10.0)
                layer.self_attn.k_proj.weight.mul_(10.0)
        for module in model.modules():
            sinks = getattr(module, "sinks", None)
            if isinstance(sinks, torch.nn.Parameter):
                sinks.copy_(torch.randn(sinks.shape) * 2.0)
    model.requires_grad_(False)
    return model


def family_target_dir(name: str, tokenizer_dir, out, seed: int = 0):
    """Save a tiny target of family ``name`` with the tokenizer (and chat template) at
    ``tokenizer_dir`` into directory ``out`` (``save_pretrained``), as a user's checkpoint: the
    pipeline loads it with ``from_pretrained``. Returns ``out``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
               max_position_embeddings=1024)
    model = family_target(name, seed=seed, **ids)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
