"""The DSpark drafter: a parallel KV-injection backbone drafts a block of block_size tokens in one
pass, a sequential (Markov or RNN) head corrects each token by the one before, and a confidence
head predicts each token's acceptance (DSpark paper section 3.1; SPEC section 2). The DFlash
baseline (``drafters/dflash.py``) is this backbone without the heads.

Shapes: B batch, T context length, A anchors (blocks) per sequence, S = ``config.num_block_inputs``
block inputs (block_size for DSpark, block_size + 1 for DFlash), K = block_size prediction slots,
H hidden size, m target layers, V vocab.

The target's token embedding and LM head are shared and frozen: they are held as non-persistent
buffers (``drafters/base.py``), so checkpoints carry only the drafter's own weights and the serving
engine binds the target's tensors at load time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .base import BlockProposal, DrafterBase, row_pieces
from .context_cache import DraftContextCache, grown_kv
from .dspark_options import DSparkOptions
from .export.dspark import EXPORTERS
from .heads import ConfidenceHead, MarkovHead, RNNHead
from .layer_init import map_layer_state
from .layers import DrafterLayer, RMSNorm, RotaryEmbedding
from .losses import position_weights
from .packing import PackedBlocks
from .spec import DrafterSpec

if TYPE_CHECKING:
    from .config import BoundDrafterConfig


class DSparkDrafter(DrafterBase):
    """DSpark drafter (and, through :class:`~drafters.dflash.DFlashDrafter`, DFlash's).

    Args:
        config: a :class:`~drafters.config.BoundDrafterConfig`.
        embed_weight: the target's input embedding, [V, H] (frozen, shared).
        lm_head_weight: the target's LM head, [V, H] (frozen, shared).
    Raises:
        ValueError: the tensors do not match the config's vocabulary / hidden size.
    """

    def __init__(self, config: BoundDrafterConfig, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, draft_vocab=None):
        super().__init__(config, embed_weight, lm_head_weight, draft_vocab)
        h = config.hidden_size
        n = config.draft_vocab_len
        n_in = n + 1 if config.draft_vocab_size else n  # + "previous token outside the subset"
        m_h = config.num_context_layers * config.target_hidden_size
        self.context_proj = nn.Linear(m_h, h, bias=False)  # W_c of Eq. 2
        self.context_norm = RMSNorm(h, config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.randn(h) * float(embed_weight.float().std()))
        # the first-slot variant (issue 42): the anchor input also reads H_ctx[p-1], the state
        # Eagle3's first step reads; zero at the start, so it begins as the plain anchor
        self.anchor_proj = None
        if config.anchor_features:
            self.anchor_proj = nn.Linear(h, h, bias=False)
            nn.init.zeros_(self.anchor_proj.weight)
        windows = config.layer_windows or [None] * config.num_hidden_layers
        self.layers = nn.ModuleList(DrafterLayer(config, w) for w in windows)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        if config.head_type == "markov":
            self.head = MarkovHead(n_in, config.options.markov_rank, n)
        elif config.head_type == "rnn":
            self.head = RNNHead(n_in, config.options.markov_rank, h, n)
        else:
            self.head = None
        self.confidence = (ConfidenceHead(h, config.options.markov_rank) if config.confidence_head
                           else None)

    @torch.no_grad()
    def init_from_target(self, layer_states: list[dict], norm_state: dict) -> None:
        """Start the backbone from the target's last decoder layers instead of random weights.

        The drafter layers take the weights of the target's last ``num_hidden_layers`` decoder
        layers (mapped by the layer's own parameter names: Llama, Qwen3, Mistral, Phi-3 layers;
        ``drafters/layer_init.py``), the final norm the
        target's (the frozen LM head expects its output), and W_c starts as the identity on the
        deepest selected target layer with the first copied layer's input norm as the context
        norm, so that the first drafter layer's context keys/values equal that target layer's
        keys/values when the deepest feature layer feeds it (not when the drafter has q/k norms
        the target's layers lack, ``drafter.qk_norm`` on a Llama target: those keep their own
        values and normalise the copied keys). The mask embedding is unchanged.

        Args:
            layer_states: ``num_hidden_layers`` state dicts of target decoder layers (first = the
                lowest copied layer).
            norm_state: the target's final norm state dict.
        Raises:
            ValueError: wrong number of layers; LayerInitError (a ValueError): names or shapes
                that do not map (``drafters/layer_init.py``, which the pipeline checks first).
        """
        if len(layer_states) != len(self.layers):
            raise ValueError(f"init_from_target needs {len(self.layers)} layer states, got "
                             f"{len(layer_states)}")
        for i, (layer, state) in enumerate(zip(self.layers, layer_states)):
            own = layer.state_dict()
            # the target layer's names as the drafter's (Phi-3's fused projections split); q/k
            # norms the target's layers lack (drafter.qk_norm on a Llama target) keep their own
            # values (1 in a fresh drafter)
            mapped = map_layer_state(state, {k: tuple(v.shape) for k, v in own.items()},
                                     f"copied target layer {i}")
            layer.load_state_dict({**own, **{k: v.to(own[k].dtype) for k, v in mapped.items()}},
                                  strict=True)
        self.norm.load_state_dict({k: v.float() for k, v in norm_state.items()})
        h = self.config.hidden_size
        w = self.context_proj.weight
        w.zero_()
        w[:, -self.config.target_hidden_size:][:, :h] += torch.eye(h, dtype=w.dtype)
        self.context_norm.weight.copy_(self.layers[0].input_layernorm.weight)

    # ------------------------------------------------------------------ backbone
    def context_states(self, context_features: torch.Tensor) -> torch.Tensor:
        """H_ctx = RMSNorm(W_c [h_l1; ...; h_lm]) (Eq. 2): [B, T, m*H_t] -> [B, T, H]."""
        return self.context_norm(self.context_proj(context_features.to(self.context_proj.weight.dtype)))

    def block_inputs(self, anchor_tokens: torch.Tensor,
                     last_states: torch.Tensor | None = None) -> torch.Tensor:
        """Anchor input followed by S-1 mask embeddings: int64 [...] -> [..., S, H].

        The anchor input is embed(x_p), plus W_a H_ctx[p-1] when ``config.anchor_features`` is set
        (``last_states`` [..., H], the context state of the position before each anchor; the
        first-slot variant of issue 42, after Eagle3's first step, which reads [embed(x_p);
        g_{p-1}]).

        Raises:
            ValueError: ``last_states`` missing where the config reads them.
        """
        anchor = F.embedding(anchor_tokens, self.embed_weight).to(self.mask_embedding.dtype)
        if self.anchor_proj is not None:
            if last_states is None:
                raise ValueError("this drafter's anchor slot reads the last context state "
                                 "(anchor_features): extend its context before drafting")
            anchor = anchor + self.anchor_proj(last_states.to(anchor.dtype))
        masks = self.mask_embedding.expand(*anchor_tokens.shape, self.config.num_block_inputs - 1, -1)
        return torch.cat((anchor.unsqueeze(-2), masks), dim=-2)

    def forward(self, packed: PackedBlocks) -> torch.Tensor:
        """Training forward over anchor-bounded packed blocks (teacher forcing; SPEC 3).

        A query of the block at anchor position p sees its own sequence's context positions < p
        and every slot of its own block (bidirectional inside the block), never another block or
        sequence (``drafters/packing.py``). RoPE positions are the context positions and
        p..p+S-1 for the block (SPEC 2).

        Args:
            packed: a :class:`~drafters.packing.PackedBlocks` (N blocks, Nc context rows).
        Returns:
            hidden states of the prediction slots, [N, K, H] (after the final norm).
        """
        ctx = self.context_states(packed.context_features)  # [Nc, H]
        ctx_rope = self.rotary(packed.context_positions[None], ctx.dtype)
        q_pos = packed.anchor_positions[:, None] + torch.arange(
            self.config.num_block_inputs, device=ctx.device)  # [N, S]
        block_rope = self.rotary(q_pos, ctx.dtype)
        hidden = self.block_inputs(packed.anchor_tokens, self._last_context_rows(ctx, packed))
        for layer in self.layers:
            ctx_kv = layer.self_attn.project_packed_context(ctx, *ctx_rope)
            hidden = layer(hidden, block_rope, ctx_kv, packed=packed)
        off = self.config.anchor_slots
        return self.norm(hidden)[:, off:off + self.config.block_size]

    def _last_context_rows(self, ctx: torch.Tensor, packed: PackedBlocks) -> torch.Tensor | None:
        """H_ctx[p-1] of every packed block, [N, H] (zeros at an anchor at position 0), or None
        when the anchor does not read it. Sequence s's context rows are its positions 0..L_s-1
        from ``context_offsets[s]`` on (``pack_blocks``), and every anchor p <= L_s."""
        if self.anchor_proj is None:
            return None
        p = packed.anchor_positions
        if ctx.shape[0] == 0:  # every anchor at position 0: no context row, nothing before them
            return ctx.new_zeros(p.shape[0], ctx.shape[-1])
        rows = packed.context_offsets[packed.block_sequence_ids()] + p - 1
        return ctx[rows.clamp(min=0)] * (p > 0)[:, None].to(ctx.dtype)

    # ------------------------------------------------------------------ heads
    def head_features(self, hidden: torch.Tensor, prev_tokens: torch.Tensor):
        """Teacher-forced sequential-head features and confidence logits, without any
        vocabulary-sized tensor (the trainer turns rows into logits chunk by chunk).

        Args:
            hidden: [N, K, H] prediction-slot states.
            prev_tokens: int64 [N, K], x_{k-1} of each slot (x_0 = anchor), target ids.
        Returns:
            (features [N, K, r] or None without a sequential head, confidence logits fp32 [N, K]
            or None).
        """
        if self.head is None:
            return None, None
        feat, prev_emb = self.head.features(hidden, self.to_draft_ids(prev_tokens))
        conf = self.confidence(hidden, prev_emb) if self.confidence is not None else None
        return feat, conf

    def logits_from(self, hidden: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """U_k + B_k (Eq. 4) from slot states [..., H] and head features [..., r] (or None):
        fp32 [..., N]."""
        logits = self.draft_head(hidden)
        return logits if features is None else logits + self.head.w2(features).float()

    # ------------------------------------------------------------------ inference
    # Inference protocol shared by every drafter (DSpark, DFlash, Eagle3) and used by the
    # speculative engine: new_draft_state -> extend_context (committed positions) ->
    # propose_block (one block from the anchor), repeated every round.
    def new_draft_state(self) -> DraftContextCache:
        """An empty per-request draft state (the context K/V cache)."""
        return DraftContextCache()

    @torch.no_grad()
    def extend_context(self, cache: DraftContextCache, context_features: torch.Tensor,
                       positions: torch.Tensor, next_tokens: torch.Tensor | None = None) -> None:
        """Append committed positions to the context cache.

        Args:
            context_features: [B, n, m*H_t] target features of the new positions.
            positions: int64 [B, n], consecutive and starting at ``cache.length``.
            next_tokens: int64 [B, n], the token after each position (unused here; Eagle3 pairs
                each target state with it).
        """
        ctx = self.context_states(context_features)
        rope = self.rotary(positions, ctx.dtype)
        new = [layer.self_attn.project_kv(ctx, *rope) for layer in self.layers]
        cache.keys, cache.values = grown_kv(cache, new)
        if self.anchor_proj is not None and ctx.shape[1]:
            cache.last_state = ctx[:, -1]

    @torch.no_grad()
    def extend_context_batch(self, states: list[DraftContextCache],
                             context_features: list[torch.Tensor],
                             next_tokens: list[torch.Tensor]) -> None:
        """Extend R requests' context caches in one packed pass: a position's context keys and
        values depend on its own features and position only (no attention among context rows),
        so every request's new rows go through the projections together, in
        :func:`~drafters.base.row_pieces` of the packed rows (bounded matmul shapes), and are
        split back per request. The caches end as R ``extend_context`` calls would leave them,
        and if anything raises no cache has changed.

        Args:
            states: R caches (each of batch 1).
            context_features: R tensors [n_r, m*H_t]; next_tokens: unused (the protocol's).
        Raises:
            ValueError: ``states`` and ``context_features`` differ in length.
            RuntimeError: features of another width than the context projection reads.
        """
        if len(states) != len(context_features):
            raise ValueError(f"{len(states)} states for {len(context_features)} feature tensors")
        lengths = [f.shape[0] for f in context_features]
        if not any(lengths):
            return
        dev = context_features[0].device
        feats = torch.cat(context_features)  # [N, m*H_t]
        positions = torch.cat([torch.arange(c.length, c.length + n, device=dev)
                               for c, n in zip(states, lengths)])
        pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per piece, per layer
        states_of_rows = []  # the context states H_ctx, kept only where the anchor reads them
        done = 0
        for n in row_pieces(feats.shape[0]):
            ctx = self.context_states(feats[None, done:done + n])
            rope = self.rotary(positions[None, done:done + n], ctx.dtype)
            pieces.append([layer.self_attn.project_kv(ctx, *rope) for layer in self.layers])
            if self.anchor_proj is not None:
                states_of_rows.append(ctx[0])
            done += n
        last_rows = None
        if states_of_rows:  # each request's last new row: [R', H] over the requests with rows
            ends = torch.tensor(lengths, device=dev).cumsum(0) - 1
            last_rows = torch.cat(states_of_rows)[ends[torch.tensor(lengths, device=dev) > 0]]
        per_request: list[list] = [[] for _ in states]  # per request, per layer: (k, v)
        for i in range(len(self.layers)):
            k_rows = torch.cat([p[i][0] for p in pieces], dim=2).split(lengths, dim=2)
            v_rows = torch.cat([p[i][1] for p in pieces], dim=2).split(lengths, dim=2)
            for mine, k, v in zip(per_request, k_rows, v_rows):
                mine.append((k, v))
        grown = [grown_kv(c, kv) for c, kv, n in zip(states, per_request, lengths) if n]
        extended = [c for c, n in zip(states, lengths) if n]
        for j, (cache, (keys, values)) in enumerate(zip(extended, grown)):
            cache.keys, cache.values = keys, values  # only now: all or nothing
            if last_rows is not None:
                cache.last_state = last_rows[j:j + 1]

    def _window_masks(self, ctx_pos: torch.Tensor, q_pos: torch.Tensor) -> dict:
        """Attention masks of one block pass, one per distinct layer window.

        Args:
            ctx_pos: int64 [B, C], the position each context key holds (< 0 = padding).
            q_pos: int64 [B, S], the block queries' positions (the block's keys share them).
        Returns:
            window (None = full) -> bool [B, 1, S, C + S] (True = may attend) or None where
            every key is visible: padding is hidden, and under a window w a query at q sees
            context positions > q - w (the block itself lies within any w >= S).
        """
        b, s = q_pos.shape
        masks = {}
        for window in {layer.window for layer in self.layers}:
            visible = (ctx_pos >= 0)[:, None, :].expand(b, s, -1)
            if window is not None:
                visible = visible & (ctx_pos[:, None, :] > q_pos[:, :, None] - window)
            if bool(visible.all()):
                masks[window] = None
                continue
            block = torch.ones(b, s, s, dtype=torch.bool, device=q_pos.device)
            masks[window] = torch.cat((visible, block), dim=2)[:, None]
        return masks

    @torch.no_grad()
    def block_hidden(self, cache: DraftContextCache, anchor_tokens: torch.Tensor,
                     anchor_positions: torch.Tensor) -> torch.Tensor:
        """Backbone pass for one block per sequence: anchor_tokens, anchor_positions int64 [B]
        -> prediction-slot states [B, K, H]. The cache must hold exactly positions < anchor."""
        s = self.config.num_block_inputs
        dev = anchor_tokens.device
        hidden = self.block_inputs(anchor_tokens, cache.last_state)  # [B, S, H]
        q_pos = anchor_positions[:, None] + torch.arange(s, device=dev)  # [B, S]
        rope = self.rotary(q_pos, hidden.dtype)
        ctx_pos = torch.arange(cache.length, device=dev).expand(len(anchor_tokens), -1)
        masks = self._window_masks(ctx_pos, q_pos)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, rope, (cache.keys[i], cache.values[i]), masks[layer.window])
        off = self.config.anchor_slots
        return self.norm(hidden)[:, off:off + self.config.block_size]

    @torch.no_grad()
    def propose_block(self, cache: DraftContextCache, anchor_tokens: torch.Tensor,
                      anchor_positions: torch.Tensor, num_draft_tokens: int, temperature,
                      generator=None, top_p=1.0) -> BlockProposal:
        """Draft ``num_draft_tokens`` tokens after the anchors: :meth:`block_hidden` then
        :meth:`propose`. anchor_tokens, anchor_positions: int64 [B]; the cache must hold exactly
        the positions < anchor."""
        hidden = self.block_hidden(cache, anchor_tokens, anchor_positions)
        return self.propose(hidden, anchor_tokens, num_draft_tokens, temperature, generator, top_p)

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor_tokens: torch.Tensor,
                max_num_draft_tokens: int, temperature, generator=None, top_p=1.0,
                num_draft_tokens: torch.Tensor | None = None) -> BlockProposal:
        """Sample a block left to right from p_k = softmax((U_k + B_k(x_{k-1})) / T) (Eq. 4).

        Args:
            hidden: [B, K, H] from :meth:`block_hidden`.
            anchor_tokens: int64 [B], x_0.
            max_num_draft_tokens: how many draft tokens to sample (<= K).
            temperature: float or fp32 [B]; <= 0 means greedy (argmax), otherwise the sampling
                temperature, which must be the one the target is verified at (SPEC 5).
            generator: RNG, or one per row.
            top_p: float or fp32 [B], nucleus filter applied to the draft distribution too.
            num_draft_tokens: int64 [B] or None; row b samples only its first
                num_draft_tokens[b] tokens
                (the rest are argmax fillers that draw no randomness and must not be verified).
        Returns:
            a :class:`BlockProposal` with ``max_num_draft_tokens`` target-id tokens (``probs`` over the target
            vocabulary, None when every row is greedy).
        """
        # lazy: import cycle: the package's __init__ imports dspark
        from .sampling import sample_rows

        b = hidden.shape[0]
        base = self.draft_head(hidden[:, :max_num_draft_tokens])
        state = self.head.init_state(b, hidden.device, hidden.dtype) if self.head else None
        prev = self.to_draft_ids(anchor_tokens)
        tokens, probs, confs = [], [], []
        all_greedy = bool((torch.as_tensor(temperature) <= 0).all())
        for k in range(max_num_draft_tokens):
            logits = base[:, k]
            if self.head is not None:
                bias, prev_emb, state = self.head.step(state, hidden[:, k], prev)
                logits = logits + bias.float()
                if self.confidence is not None:
                    confs.append(self.confidence(hidden[:, k], prev_emb))
            if all_greedy:  # argmax only: no distribution is needed to verify greedy drafts
                tok = logits.argmax(-1)
            else:
                active = None if num_draft_tokens is None else num_draft_tokens > k
                tok, p = sample_rows(logits, temperature, top_p, generator, active, slot=k,
                                     target_ids=self.d2t)
                probs.append(p)
            tokens.append(tok)
            prev = tok
        return BlockProposal(
            tokens=self.to_target_ids(torch.stack(tokens, 1)),
            probs=None if all_greedy else self.to_target_probs(torch.stack(probs, 1)),
            confidence_logits=torch.stack(confs, 1) if confs else None,
        )

    @torch.no_grad()
    def propose_block_batch(self, states: list[DraftContextCache], anchor_tokens: torch.Tensor,
                            anchor_positions: torch.Tensor, max_num_draft_tokens: int,
                            temperature, generator=None, top_p=1.0,
                            num_draft_tokens: torch.Tensor | None = None) -> BlockProposal:
        """One batched drafter call for many requests with context caches of different lengths
        (continuous batching): the caches are left-padded into one [R, nkv, C_max, hd] tensor per
        layer with a key-padding mask.

        Args:
            states: R per-request caches; state r must hold exactly positions < anchor_positions[r].
            anchor_tokens, anchor_positions: int64 [R].
            max_num_draft_tokens: draft length of the longest row.
            temperature, top_p: float or fp32 [R]; generator: one per row (list) or shared.
            num_draft_tokens: int64 [R], each row's own draft length (see :meth:`propose`).
        Returns:
            a :class:`BlockProposal` over the R rows.
        """
        r, s = len(states), self.config.num_block_inputs
        lengths = [st.length for st in states]
        c_max = max(lengths)
        dev = anchor_tokens.device
        last = None  # block_inputs names the missing state if the anchor reads it
        if self.anchor_proj is not None and all(st.last_state is not None for st in states):
            last = torch.cat([st.last_state for st in states])
        hidden = self.block_inputs(anchor_tokens, last)  # [R, S, H]
        q_pos = anchor_positions[:, None] + torch.arange(s, device=dev)  # [R, S]
        rope = self.rotary(q_pos, hidden.dtype)
        # right-aligned rows: key j of row r holds position j - (C_max - C_r); < 0 is padding
        ctx_pos = (torch.arange(c_max, device=dev)[None, :]
                   - (c_max - torch.tensor(lengths, device=dev))[:, None])
        masks = self._window_masks(ctx_pos, q_pos)
        for i, layer in enumerate(self.layers):
            keys = torch.zeros(r, *states[0].keys[i].shape[1:2], c_max, states[0].keys[i].shape[-1],
                               dtype=hidden.dtype, device=dev)
            values = torch.zeros_like(keys)
            for j, st in enumerate(states):  # [1, nkv, C_j, hd] -> right-aligned row j
                keys[j, :, c_max - lengths[j]:] = st.keys[i][0]
                values[j, :, c_max - lengths[j]:] = st.values[i][0]
            hidden = layer(hidden, rope, (keys, values), masks[layer.window])
        off = self.config.anchor_slots
        hidden = self.norm(hidden)[:, off:off + self.config.block_size]
        return self.propose(hidden, anchor_tokens, max_num_draft_tokens, temperature, generator,
                            top_p, num_draft_tokens)


def block_position_weights(config: BoundDrafterConfig) -> torch.Tensor:
    """w_k = exp(-(k-1)/loss_decay) over the block (Eq. 9-12): fp32 [block_size]."""
    return position_weights(config.block_size, config.loss_decay)


SPEC = DrafterSpec(
    name="dspark", title="DSpark", model_class=DSparkDrafter, objective="dspark",
    step_weights=block_position_weights, options=DSparkOptions, exporters=EXPORTERS,
    vllm_method="dspark", vllm_architectures=("Qwen3DSparkModel",))
