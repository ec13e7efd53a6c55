"""The target's training features of a conversation, computed once per sample: the cache stage
writes them to Parquet (:mod:`pipeline.cache.stage`), online and hybrid training stream them straight
into the trainers (:mod:`pipeline.feature_stream`). One tokenization (chat template, loss mask,
``max_length`` cut, the checks a sample must pass) and one batched forward, so a streamed row and
a cached row of the same sample are the same bytes (SPEC 1.4).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from serve.engine.chat import tokenize_conversation_samples
from serve.engine.target_loading import load_target, load_tokenizer

from .cache.writer import check_row_size, rows_table
from .config import CacheConfig
from .plan import bytes_per_token


@dataclass(frozen=True)
class CacheTarget:
    """The target a cache is made from, as the cache stage forwards it."""

    name_or_path: str  # resolved: a local directory or a hub name
    dtype: str  # forward dtype ("float32", "bfloat16", ...)
    layer_ids: list[int]  # target layers whose hidden states form context_hidden, ascending
    template_kwargs: dict  # chat-template arguments (target.chat_template_kwargs)


def length_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped for batched forwards: longest first (ties by index), each
    batch at most ``max_tokens`` padded tokens (batch size x its longest length); a sample
    longer than that goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class ConversationTokenizer:
    """Samples of a conversation as the cache holds them (tokenizer only, no model).

    Args:
        target: the target (its tokenizer and chat-template arguments are used).
        cache: the ``cache:`` section (``max_length``, ``min_supervised_tokens``).
    """

    def __init__(self, target: CacheTarget, cache: CacheConfig):
        self.tokenizer = load_tokenizer(target.name_or_path)
        self.template_kwargs = target.template_kwargs
        self.max_length = cache.max_length
        self.min_supervised = cache.min_supervised_tokens

    def tokenize(self, conv: dict) -> list[dict]:
        """Samples of one conversation: one, or one per assistant turn when the chat template
        renders history differently from a generated turn (``serve.engine.chat``); ids
        ``<id>#<turn>`` then. Each: ``sample_id``, ``domain``, ``input_ids`` and ``loss_mask``
        (lists, [T]).

        Raises:
            ValueError: too few supervised tokens, no anchor position, or a template error.
        """
        samples = tokenize_conversation_samples(self.tokenizer, conv["messages"],
                                                self.template_kwargs, self.max_length)
        out = []
        for k, tok in enumerate(samples):
            if tok.num_supervised < self.min_supervised:
                raise ValueError(f"only {tok.num_supervised} supervised tokens "
                                 f"(< min_supervised_tokens {self.min_supervised})")
            mask = tok.loss_mask
            if not any(a and b for a, b in zip(mask, mask[1:])):
                raise ValueError("no anchor position (two consecutive supervised tokens)")
            out.append({"sample_id": conv["id"] if len(samples) == 1 else f"{conv['id']}#{k}",
                        "domain": conv.get("domain", "unknown"),
                        "input_ids": list(tok.input_ids), "loss_mask": list(tok.loss_mask)})
        return out


class TargetFeatures(ConversationTokenizer):
    """Tokenizes conversations and runs the target on them: the rows of the target cache.

    Args:
        target: the target to load (``serve.engine.target_loading.load_target``), on CUDA when
            there is one.
        cache: the ``cache:`` section (``max_length``, ``min_supervised_tokens``,
            ``forward_batch_tokens``, ``num_threads``).
    Raises:
        ValueError: a ``max_length`` row would not fit one Arrow binary value
            (:func:`pipeline.cache.writer.check_row_size`), before any forward is spent.
    """

    def __init__(self, target: CacheTarget, cache: CacheConfig):
        import torch

        if cache.num_threads:
            torch.set_num_threads(cache.num_threads)
        super().__init__(target, cache)
        self.torch = torch
        self.model = load_target(target.name_or_path, target.dtype)
        hidden = self.model.config.hidden_size
        self.layer_ids = list(target.layer_ids)
        check_row_size(cache.max_length, hidden, len(self.layer_ids))
        self.bytes_per_token = bytes_per_token(hidden, len(self.layer_ids))
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(self.device)
        self.forward_batch_tokens = cache.forward_batch_tokens
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)

    def forward(self, samples: list[dict]) -> pa.Table:
        """Cache rows of ``samples`` (same order, :func:`pipeline.cache.writer.rows_table`) from
        right-padded batched target forwards (:func:`length_batches`): ``context_hidden`` bf16
        [T, m*H] and ``last_hidden`` bf16 [T, H] of each sample's own T positions (attention is
        causal, so the padding after a sample cannot change them)."""
        torch = self.torch
        context: list = [None] * len(samples)
        last: list = [None] * len(samples)
        lengths = [len(s["input_ids"]) for s in samples]
        for batch in length_batches(lengths, self.forward_batch_tokens):
            width = lengths[batch[0]]
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [B, T_max]
            attn = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T_max]
            for b, i in enumerate(batch):
                ids[b, :lengths[i]] = torch.tensor(samples[i]["input_ids"])
                attn[b, :lengths[i]] = 1
            with torch.no_grad():
                out = self.model.model(input_ids=ids.to(self.device),
                                       attention_mask=attn.to(self.device),
                                       output_hidden_states=True, use_cache=False)
            hs = out.hidden_states  # L + 1 tensors [B, T_max, H]; hs[l + 1]: decoder layer l
            # [B, T_max, m*H] and [B, T_max, H] (post-norm: exactly the LM head's input), bf16
            ctx = torch.cat([hs[l + 1] for l in self.layer_ids], dim=-1).to(torch.bfloat16).cpu()
            fin = out.last_hidden_state.to(torch.bfloat16).cpu()
            for b, i in enumerate(batch):
                context[i], last[i] = ctx[b, :lengths[i]], fin[b, :lengths[i]]
        return rows_table(samples, context, last)

    def tokenize_all(self, convs: list[dict], stage: str) -> tuple[list[dict], list[dict]]:
        """(samples of every conversation in order, error rows ``{id, stage, error}`` of those
        that failed :meth:`tokenize`): bad data never sinks the others."""
        samples, errors = [], []
        for conv in convs:
            try:
                samples += self.tokenize(conv)
            except ValueError as err:
                errors.append({"id": conv["id"], "stage": stage,
                               "error": f"{type(err).__name__}: {err}"})
        return samples, errors
