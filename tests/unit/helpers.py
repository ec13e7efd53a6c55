"""Shared builders for the unit tests: tiny targets with non-degenerate greedy text, an independent
(cache-free) greedy reference, and "oracle" drafters whose sequential head encodes the target's
bigram table so that rounds contain both accepted and rejected draft tokens."""

from __future__ import annotations

import torch
from torch import nn

from drafters import BlockProposal, DrafterConfig, DSparkDrafter
from drafters.registry import get_spec
from tests.tiny import tiny_target


def permuted_target(seed: int = 0, perm_seed: int = 1, vocab_size: int = 96,
                    embed_scale: float = 0.3):
    """tiny_target() with its tied LM head replaced by a row-permuted copy of the embedding.

    The stock tiny target (tied, embedding x4) greedily repeats its last token forever; permuting
    the head rows makes greedy text walk through the vocabulary, so tests see varied tokens.
    Shrinking the input embedding afterwards (``embed_scale``) lets attention matter, so the next
    token depends on more than the current one (a stale KV cache changes the output).
    """
    target = tiny_target(vocab_size=vocab_size, seed=seed)
    g = torch.Generator().manual_seed(perm_seed)
    perm = torch.randperm(vocab_size, generator=g)
    emb = target.get_input_embeddings().weight
    target.lm_head.weight = nn.Parameter(emb.detach()[perm].clone(), requires_grad=False)
    with torch.no_grad():
        emb.mul_(embed_scale)
    return target


@torch.no_grad()
def greedy_reference(model, prompt: list[int], max_new_tokens: int, eos: set[int] = frozenset()):
    """Target-only greedy decoding by full recomputation (no KV cache, no serve/ code)."""
    ids = list(prompt)
    out = []
    for _ in range(max_new_tokens):
        tok = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
        if tok in eos:
            break
    return out


@torch.no_grad()
def bigram_table(model) -> torch.Tensor:
    """table[a] = the target's greedy next token after the one-token context [a]: int64 [V]."""
    v = model.config.vocab_size
    logits = model(input_ids=torch.arange(v)[:, None]).logits[:, -1]
    return logits.argmax(-1)


def _drafter_config(target, layer_ids, block_size, head_type, rank, drafter_type="dspark",
                    num_layers=1):
    spec = get_spec(drafter_type)
    heads = {"head_type": head_type, "markov_rank": rank} if spec.has_option("head_type") else {}
    cfg = DrafterConfig(drafter_type=drafter_type, block_size=block_size,
                        options={"num_layers": num_layers, **heads}, qk_norm=True).for_target(
        target.config, "tiny-qwen3", list(layer_ids))
    cfg.target.max_position_embeddings = 512
    return cfg


@torch.no_grad()
def oracle_drafter(target, table: torch.Tensor, head_type: str = "markov", block_size: int = 4,
                   layer_ids=(1, 3), strength: float = 30.0, seed: int = 0) -> DSparkDrafter:
    """A drafter whose sequential head adds ``strength`` to the logit of table[x_{k-1}].

    With a large strength the drafter proposes the chain x_k = table[x_{k-1}] (sampled left to
    right, so this also exercises the head's use of the *sampled* previous token); where the
    target's in-context choice differs from the table, the draft is rejected.
    """
    torch.manual_seed(seed)
    v = target.config.vocab_size
    cfg = _drafter_config(target, layer_ids, block_size, head_type, rank=v)
    d = DSparkDrafter(cfg, target.get_input_embeddings().weight,
                      target.get_output_embeddings().weight).eval()
    head = d.head
    head.w1.weight.copy_(torch.eye(v))
    transition = torch.zeros(v, v)
    transition[table, torch.arange(v)] = strength  # column a -> row table[a]
    head.w2.weight.copy_(transition)
    if head_type == "rnn":
        # o = 10 * W1[x_{k-1}] so tanh(o) ~ onehot(x_{k-1}); gate/candidate parts are zero.
        head.cell.weight.zero_()
        head.cell.bias.zero_()
        head.cell.weight[2 * v:3 * v, v:2 * v] = 10.0 * torch.eye(v)
        head.w2.weight.copy_(transition / torch.tanh(torch.tensor(10.0)))
    return d


@torch.no_grad()
def randomize_heads(drafter: DSparkDrafter, seed: int = 0, scale: float = 0.5) -> DSparkDrafter:
    """Give the zero-initialised W2 and confidence projection random values so that the heads'
    outputs depend on their inputs (an untrained head is a constant)."""
    g = torch.Generator().manual_seed(seed)
    if drafter.head is not None:
        w = drafter.head.w2.weight
        w.copy_(torch.randn(w.shape, generator=g) * scale)
    if drafter.confidence is not None:
        w = drafter.confidence.proj.weight
        w.copy_(torch.randn(w.shape, generator=g) * scale)
        drafter.confidence.proj.bias.fill_(0.1)
    return drafter


def scripted_drafter(drafter: DSparkDrafter, prompt: list[int], continuation: list[int]):
    """Make ``drafter`` (greedy only) propose exactly the target's own continuation.

    In a lossless greedy run the committed text is prompt + continuation, so a block drafted at
    anchor position pos must be continuation[pos - len(prompt) + 1 : ...]: every draft token is
    accepted. The backbone still runs (block_hidden), only the proposal is replaced.
    """
    state = {}
    block_hidden = drafter.block_hidden

    def recording_block_hidden(cache, anchor_tokens, anchor_positions):
        state["pos"] = int(anchor_positions[0])
        return block_hidden(cache, anchor_tokens, anchor_positions)

    def propose(hidden, anchor_tokens, num_tokens, temperature, generator=None, top_p=1.0):
        assert bool((torch.as_tensor(temperature) <= 0).all()), "scripted drafter is greedy only"
        i = state["pos"] - len(prompt)
        assert continuation[i] == int(anchor_tokens[0])
        toks = continuation[i + 1:i + 1 + num_tokens]
        toks = toks + [0] * (num_tokens - len(toks))
        return BlockProposal(torch.tensor([toks]), None, None)

    drafter.block_hidden = recording_block_hidden
    drafter.propose = propose
    return drafter


def blocks(drafter, feats: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor,
           input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The drafter's training forward on given anchors of a padded batch: [B, A, K, H]."""
    from drafters.packing import pack_dense

    b, a = anchors.shape
    out = drafter(pack_dense(feats, anchors, tokens, input_ids))
    return out.view(b, a, *out.shape[1:])
