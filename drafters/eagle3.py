"""The Eagle3 drafter: the autoregressive baseline (SPEC section 2).

Sources: Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test" (arXiv 2503.01840), and its SpecForge training recipe; SPEC sections 2, 3, 5.

Architecture. The target features of position t are fused into g_t = fc([h_l1; ...; h_lm])
(Linear m*H_t -> H, no bias). A draft step's decoder layer takes the 2H-wide input
[RMSNorm(embed(x)); RMSNorm(h)] into its q/k/v projections (GQA, optional qk-norm, RoPE), projects
back to H with o_proj and adds the residual h; then post-attention RMSNorm, SwiGLU MLP, residual.
The final RMSNorm and the frozen target LM head give the draft logits. Further layers (when
``num_hidden_layers > 1``) are ordinary pre-norm decoder layers on H.

Indexing (the same as DSpark's, so trainer, losses and engine are shared). A block at anchor
position p (anchor x_p = the bonus token; target states exist for positions < p) makes
K = gamma predictions, prediction k predicting x_{p+k}:

- step 1 is the query at position p-1 with input [embed(x_p); g_{p-1}]; its output h_1 predicts
  x_{p+1}. It attends to the step-1 keys of all positions t <= p-1, where position t has the input
  pair [embed(x_{t+1}); g_t] (so its own key is the context row p-1);
- step k >= 2 has input [embed(x_{p+k-1}); h_{k-1}] at RoPE position p-1+(k-1) and predicts
  x_{p+k}; it additionally attends to the keys of steps 2..k of its own chain (the "diagonal" of
  training-time test). In training x_{p+k-1} is the ground truth; at inference the draft token.

Shapes: B batch, N packed blocks, Nc packed context rows, K = gamma steps, H hidden size, m target
layers, H_t target hidden size, V vocabulary, nkv key-value heads, hd head dim, C cached positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from .base import BlockProposal, DrafterBase
from .export.eagle3 import EXPORTERS
from .layers import KVInjectionAttention, RMSNorm, RotaryEmbedding, SwiGLU
from .losses import eagle3_step_weights
from .options import DrafterOptions
from .packing import PackedBlocks
from .sampling import sample_rows
from .spec import DrafterSpec

if TYPE_CHECKING:
    from .config import BoundDrafterConfig


class Eagle3Attention(KVInjectionAttention):
    """GQA attention whose q/k/v projections read an ``input_size``-wide input (2H for the fused
    Eagle3 layer) and whose o_proj maps back to ``hidden_size``.

    Everything else (qk-norm, RoPE, packed and cached attention) is
    :class:`~drafters.layers.KVInjectionAttention`'s: keys/values of the queries themselves are
    appended to the given context keys/values.
    """

    def __init__(self, input_size: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, qk_norm: bool, eps: float):
        super().__init__(input_size, num_heads, num_kv_heads, head_dim, qk_norm, eps)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)


class Eagle3Layer(nn.Module):
    """One Eagle3 decoder layer.

    ``fused=True`` (the first layer): input [input_layernorm(embed(x)); hidden_norm(h)] (2H wide),
    residual h (EAGLE-3 paper section 3; SpecForge ``LlamaDecoderLayer`` of the draft model).
    ``fused=False``: an ordinary pre-norm layer, input input_layernorm(h) (H wide).
    Both then do h + attn, followed by h + MLP(post_attention_layernorm(h)).
    """

    def __init__(self, cfg: BoundDrafterConfig, fused: bool):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fused = fused
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps) if fused else None
        self.self_attn = Eagle3Attention(2 * h if fused else h, h, cfg.num_attention_heads,
                                         cfg.num_key_value_heads, cfg.head_dim, cfg.qk_norm, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size)

    def layer_input(self, hidden: torch.Tensor, embeds: torch.Tensor | None) -> torch.Tensor:
        """The attention input: [..., H] (+ embeds [..., H] when fused) -> [..., 2H] or [..., H]."""
        if not self.fused:
            return self.input_layernorm(hidden)
        return torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual add of the attention output, then the MLP sub-block: [..., H] -> [..., H]."""
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class Eagle3DraftState:
    """Per-request Eagle3 draft state (what :meth:`Eagle3Drafter.extend_context` builds).

    keys[i], values[i]: [B, nkv, C, hd], layer i's step-1 keys (RoPE applied) / values of the
    committed positions 0..C-1 (position t's input is [embed(x_{t+1}); g_t]);
    hidden: [B, H], the last layer's step-1 output at position C-1 before the final norm, i.e. h_1
    of the block anchored at C (None before the first extend);
    last_token: int64 [B], x_C, the token paired with position C-1 (the next anchor).
    The cache only grows through ``extend_context``; a round's own chain keys are discarded.
    """

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    hidden: torch.Tensor | None = None
    last_token: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[2]


class Eagle3Drafter(DrafterBase):
    """Eagle3 drafter trained with training-time test (EAGLE-3 paper; SPEC section 2).

    Config: ``drafter_type="eagle3"`` (options :class:`Eagle3Options`: no heads, full
    attention); ``num_hidden_layers`` Eagle3 layers (normally 1; the first is the fused
    2H-input layer; ``eagle3_num_layers`` in the flat layout); ``block_size`` = gamma = the
    number of chained draft steps (``num_block_inputs == block_size``, ``anchor_slots == 0``).

    Args:
        config: a :class:`~drafters.config.BoundDrafterConfig`.
        embed_weight: the target's input embedding [V, H] (frozen, shared).
        lm_head_weight: the target's LM head [V, H] (frozen, shared).
    Raises:
        ValueError: ``config.drafter_type`` is not built by this class, ``num_hidden_layers < 1``, or the
            target tensors do not match the config's vocabulary / hidden size.
    """

    def __init__(self, config: BoundDrafterConfig, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, draft_vocab=None):
        if config.num_hidden_layers < 1:
            raise ValueError(f"an Eagle3 drafter needs num_hidden_layers >= 1, got "
                             f"{config.num_hidden_layers}")
        super().__init__(config, embed_weight, lm_head_weight, draft_vocab)
        h = config.hidden_size
        self.fc = nn.Linear(config.num_context_layers * config.target_hidden_size, h, bias=False)
        self.layers = nn.ModuleList(Eagle3Layer(config, fused=i == 0)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    # ------------------------------------------------------------------ shared pieces
    def fuse_features(self, context_features: torch.Tensor) -> torch.Tensor:
        """g = fc([h_l1; ...; h_lm]): [..., m*H_t] (any float dtype) -> [..., H]."""
        return self.fc(context_features.to(self.fc.weight.dtype))

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_weight).to(self.fc.weight.dtype)

    def _chain_visibility(self, device) -> torch.Tensor:
        """bool [K, K]: step slot i sees the block keys of slots 1..i (slot 0's key is the context
        row p-1, already visible through the context)."""
        k = self.config.block_size
        j = torch.arange(k, device=device)
        return (j[None, :] >= 1) & (j[None, :] <= j[:, None])

    # ------------------------------------------------------------------ training
    def forward(self, packed: PackedBlocks) -> torch.Tensor:
        """Training-time-test forward over anchor-bounded packed blocks (SPEC 3).

        The packed context rows t (features, positions, next tokens x_{t+1}) are the step-1
        key/value inputs. Step 1 of the block at p reuses g_{p-1} (the context row p-1); step k >= 2
        reads the ground-truth token ``packed.prev_tokens[:, k-1]`` = x_{p+k-1} and h_{k-1}. The
        steps run in order; step k's attention (``packed_attention``) covers the context rows < p
        of the block's sequence and the keys of steps 2..k of its own block, so the cost is set by
        the anchors (per step O(N * k * p)), not by the sequence length. With more than one layer,
        the step-1 outputs of the context rows are first computed causally (O(Nc * p) per layer).

        Args:
            packed: a :class:`~drafters.packing.PackedBlocks` packed with ``min_anchor=1`` (the
                spec's anchor rule, :meth:`~drafters.base.DrafterBase.pack_blocks`) and
                ``block_size = gamma`` (``prev_tokens`` [N, K]).
        Returns:
            [N, K, H], step outputs after the final norm (the trainer applies
            :meth:`draft_logits`).
        Raises:
            ValueError: an anchor at position 0 (no target state at p-1), ``prev_tokens`` with
                fewer than K columns, or context rows that are not positions 0.. of each sequence.
        """
        cfg = self.config
        k_steps = cfg.block_size
        n = packed.num_blocks
        anchors = packed.anchor_positions
        if n and bool((anchors < 1).any()):
            raise ValueError("Eagle3 blocks need anchors p >= 1 (step 1 reads the target state at "
                             "p-1): pack with pack_blocks(..., min_anchor=1)")
        if k_steps > 1 and packed.prev_tokens.shape[-1] < k_steps:
            raise ValueError(f"Eagle3 teacher forcing needs prev_tokens [N, {k_steps}], got "
                             f"{tuple(packed.prev_tokens.shape)}")
        # row of the context position p-1 of every block
        rows = packed.context_offsets[packed.block_sequence_ids()] + anchors - 1
        if n and not torch.equal(packed.context_positions[rows], anchors - 1):
            raise ValueError("context rows must be positions 0, 1, ... of each sequence")

        g = self.fuse_features(packed.context_features)  # [Nc, H]
        dtype = g.dtype
        ctx_cos, ctx_sin = self.rotary(packed.context_positions[None], dtype)  # [1, 1, Nc, hd]
        ctx_embeds = self._embed(packed.context_next_tokens)
        ctx_hidden = g
        ctx_kv = []
        for i, layer in enumerate(self.layers):
            x = layer.layer_input(ctx_hidden, ctx_embeds)
            ctx_kv.append(layer.self_attn.project_packed_context(x, ctx_cos, ctx_sin))
            if i + 1 < len(self.layers):  # step-1 outputs of the context rows feed the next layer
                ctx_hidden = self._context_layer_outputs(layer, x, ctx_hidden, ctx_kv[i],
                                                         (ctx_cos, ctx_sin), packed)

        positions = anchors[:, None] - 1 + torch.arange(k_steps, device=anchors.device)
        cos, sin = self.rotary(positions, dtype)  # [N, 1, K, hd]
        vis = self._chain_visibility(anchors.device)
        inputs = [[] for _ in self.layers]  # per layer: step inputs so far, each [N, in]
        hidden = g[rows]  # h_0 of step 1: g_{p-1}
        outs = []
        for j in range(k_steps):
            tokens = packed.anchor_tokens if j == 0 else packed.prev_tokens[:, j]
            embeds = self._embed(tokens)
            for i, layer in enumerate(self.layers):
                inputs[i].append(layer.layer_input(hidden, embeds))
                attn = layer.self_attn.forward_packed(
                    torch.stack(inputs[i], dim=1), (cos[:, :, :j + 1], sin[:, :, :j + 1]),
                    ctx_kv[i], packed, vis[:j + 1, :j + 1])[:, -1]
                hidden = layer.finish(hidden, attn)
            outs.append(hidden)
        return self.norm(torch.stack(outs, dim=1))

    @staticmethod
    def _context_layer_outputs(layer: Eagle3Layer, x: torch.Tensor, hidden: torch.Tensor,
                               ctx_kv, ctx_rope, packed: PackedBlocks) -> torch.Tensor:
        """Causal step-1 outputs of a layer at every packed context row: [Nc, H].

        Each row t is treated as a one-slot pseudo-block at anchor t+1, so ``packed_attention``
        lets it see the rows <= t of its own sequence (its block key is masked out).
        """
        rows_as_blocks = replace(packed, anchor_positions=packed.context_positions + 1,
                                 anchor_tokens=packed.context_next_tokens,
                                 block_offsets=packed.context_offsets)
        cos, sin = (t[0, 0][:, None, None] for t in ctx_rope)  # [Nc, 1, 1, hd]
        no_block_key = torch.zeros(1, 1, dtype=torch.bool, device=x.device)
        attn = layer.self_attn.forward_packed(x[:, None], (cos, sin), ctx_kv, rows_as_blocks,
                                              no_block_key)[:, 0]
        return layer.finish(hidden, attn)

    def head_features(self, hidden: torch.Tensor, prev_tokens: torch.Tensor):
        """Eagle3 has no sequential or confidence head: (None, None)."""
        return None, None

    def logits_from(self, hidden: torch.Tensor, features=None) -> torch.Tensor:
        """Draft logits through the frozen LM head (rows of the draft vocabulary):
        [..., H] -> fp32 [..., N]."""
        return self.draft_head(hidden)

    # ------------------------------------------------------------------ inference
    def new_draft_state(self) -> Eagle3DraftState:
        """An empty per-request draft state."""
        return Eagle3DraftState()

    def _cached_layers(self, hidden: torch.Tensor, embeds: torch.Tensor, rope, past_kv,
                       mask: torch.Tensor | None):
        """Run all layers for new queries [B, n, H] over past keys/values (per layer, each
        [B, nkv, C, hd]) plus their own keys. Returns (hidden [B, n, H], per-layer (k, v) of the
        new queries, each [B, nkv, n, hd])."""
        new_kv = []
        for layer, past in zip(self.layers, past_kv):
            x = layer.layer_input(hidden, embeds)
            new_kv.append(layer.self_attn.project_kv(x, *rope))
            hidden = layer.finish(hidden, layer.self_attn(x, rope, past, mask))
        return hidden, new_kv

    def _empty_kv(self, b: int, like: torch.Tensor):
        cfg = self.config
        empty = like.new_zeros(b, cfg.num_key_value_heads, 0, cfg.head_dim)
        return [(empty, empty) for _ in self.layers]

    @torch.no_grad()
    def extend_context(self, state: Eagle3DraftState, context_features: torch.Tensor,
                       positions: torch.Tensor, next_tokens: torch.Tensor | None = None) -> None:
        """Append committed positions: run step 1 causally over them, cache their keys/values and
        keep the last one's output as h_1 of the next block.

        Args:
            state: from :meth:`new_draft_state`.
            context_features: [B, n, m*H_t] target features of the new positions.
            positions: int64 [B, n], consecutive, starting at ``state.length``.
            next_tokens: int64 [B, n], x_{t+1} of each new position t (the last one is the next
                anchor); required.
        Raises:
            ValueError: ``next_tokens`` missing or of another shape, or positions not starting at
                ``state.length``.
        """
        b, n = positions.shape
        if next_tokens is None or tuple(next_tokens.shape) != (b, n):
            raise ValueError("Eagle3 pairs each target state g_t with the next token x_{t+1}: "
                             f"next_tokens must be int64 [{b}, {n}]")
        if n == 0:
            return
        if int(positions[0, 0]) != state.length:
            raise ValueError(f"positions start at {int(positions[0, 0])}, the draft state holds "
                             f"{state.length} positions")
        g = self.fuse_features(context_features)
        rope = self.rotary(positions, g.dtype)
        c = state.length
        past = (list(zip(state.keys, state.values)) if c else self._empty_kv(b, g))
        mask = torch.ones(n, c + n, dtype=torch.bool, device=g.device)
        mask[:, c:] = torch.ones(n, n, dtype=torch.bool, device=g.device).tril()
        hidden, new_kv = self._cached_layers(g, self._embed(next_tokens), rope, past,
                                             mask[None, None])
        state.keys = [torch.cat((pk, k), dim=2) for (pk, _), (k, _) in zip(past, new_kv)]
        state.values = [torch.cat((pv, v), dim=2) for (_, pv), (_, v) in zip(past, new_kv)]
        state.hidden = hidden[:, -1]
        state.last_token = next_tokens[:, -1]

    def _unroll(self, state: Eagle3DraftState, anchor_tokens: torch.Tensor,
                anchor_positions: torch.Tensor, num_steps: int, next_input) -> torch.Tensor:
        """Chain ``num_steps`` draft steps from the state. After step k+1 (0-based k),
        ``next_input(k, normed_h)`` is called with its normed output [B, H] and returns the token
        fed to the following step (int64 [B]; ignored after the last step). Returns the normed step
        outputs [B, num_steps, H].
        """
        if state.hidden is None:
            raise ValueError("the draft state is empty: call extend_context first")
        if bool((anchor_positions != state.length).any()):
            raise ValueError(f"anchor positions {anchor_positions.tolist()} != the draft state's "
                             f"length {state.length} (the state must hold exactly positions < p)")
        if bool((anchor_tokens.to(state.last_token.device) != state.last_token).any()):
            raise ValueError(f"anchor tokens {anchor_tokens.tolist()} differ from the next tokens "
                             f"{state.last_token.tolist()} given to extend_context")
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        hidden = state.hidden  # h_1
        past = list(zip(state.keys, state.values))
        token, outs = None, []
        for k in range(num_steps):
            if k:  # step k+1: [embed(token k); h_k] at position p-1+k
                rope = self.rotary((anchor_positions - 1 + k)[:, None], hidden.dtype)
                h, new_kv = self._cached_layers(hidden[:, None], self._embed(token[:, None]),
                                                rope, past, None)
                past = [(torch.cat((pk, nk), 2), torch.cat((pv, nv), 2))
                        for (pk, pv), (nk, nv) in zip(past, new_kv)]
                hidden = h[:, 0]
            outs.append(self.norm(hidden))
            token = next_input(k, outs[-1])
        return torch.stack(outs, dim=1)

    @torch.no_grad()
    def chain_hidden(self, state: Eagle3DraftState, prev_tokens: torch.Tensor,
                     anchor_positions: torch.Tensor) -> torch.Tensor:
        """Teacher-forced inference chain: the step outputs when step k's input token is
        ``prev_tokens[:, k-1]`` (x_0 = the anchor), as the training forward computes them.

        Args:
            state: holding exactly the positions < p.
            prev_tokens: int64 [B, k], anchor first.
            anchor_positions: int64 [B], p.
        Returns:
            [B, k, H] after the final norm.
        Raises:
            ValueError: empty or mismatched state (see :meth:`propose_block`).
        """
        n = prev_tokens.shape[1]
        return self._unroll(state, prev_tokens[:, 0], anchor_positions, n,
                            lambda k, _: prev_tokens[:, k + 1] if k + 1 < n else None)

    @torch.no_grad()
    def propose_block(self, state: Eagle3DraftState, anchor_tokens: torch.Tensor,
                      anchor_positions: torch.Tensor, num_draft_tokens: int, temperature,
                      generator=None, top_p=1.0) -> BlockProposal:
        """Draft ``num_draft_tokens`` tokens left to right (SPEC 5): token 1 from the stored h_1, each
        further step runs the layers on [embed(draft_{k-1}); h_{k-1}] at position p-1+(k-1) over
        the cache and this round's chain keys (discarded afterwards). Drafting cost grows linearly
        with the number of tokens.

        Args:
            state: holding exactly the positions < p (the last extend's next token is the anchor).
            anchor_tokens, anchor_positions: int64 [B], x_p and p.
            num_draft_tokens: 1 <= num_draft_tokens <= gamma.
            temperature: float or fp32 [B]; <= 0 greedy (argmax); else multinomial from
                softmax(logits / T), the temperature the target is verified at.
            generator: RNG for sampling, or one per row.
            top_p: float or fp32 [B], nucleus filter of the draft distribution.
        Returns:
            :class:`~drafters.base.BlockProposal` with tokens int64 [B, num_draft_tokens], probs
            fp32 [B, num_draft_tokens, V] (None when greedy) and confidence_logits None.
        Raises:
            ValueError: empty state, anchors not matching the state, or num_draft_tokens out of
                range.
        """
        if not 1 <= num_draft_tokens <= self.config.block_size:
            raise ValueError(f"num_draft_tokens must be in 1..{self.config.block_size}, got "
                             f"{num_draft_tokens}")

        tokens, probs = [], []
        all_greedy = bool((torch.as_tensor(temperature) <= 0).all())

        def sample(k, normed):  # one draft token from a step's normed output [B, H]
            logits = self.draft_head(normed)
            if all_greedy:
                tok = logits.argmax(-1)
            else:
                tok, p = sample_rows(logits, temperature, top_p, generator, slot=k,
                                     target_ids=self.d2t)
                probs.append(p)
            tok = self.to_target_ids(tok)  # the chain embeds target tokens
            tokens.append(tok)
            return tok

        self._unroll(state, anchor_tokens, anchor_positions, num_draft_tokens, sample)
        return BlockProposal(tokens=torch.stack(tokens, 1),
                             probs=None if all_greedy else self.to_target_probs(
                                 torch.stack(probs, 1)),
                             confidence_logits=None)


class Eagle3Options(DrafterOptions):
    """Eagle3's settings: its decoder layers, written ``eagle3_num_layers`` in the flat layout
    (where ``num_layers`` is DSpark's and DFlash's backbone)."""

    FLAT_NAMES = {"num_layers": "eagle3_num_layers"}

    num_layers: int = Field(1, ge=1, description="Decoder layers of an Eagle3 drafter.")


SPEC = DrafterSpec(
    name="eagle3", title="Eagle3", model_class=Eagle3Drafter, objective="soft_ce",
    step_weights=lambda config: eagle3_step_weights(config.block_size), min_anchor=1,
    options=Eagle3Options, drafts_whole_block=False, exporters=EXPORTERS,
    vllm_method="eagle3", vllm_architectures=("Eagle3",))
