"""The DSpark drafter (and its DFlash baseline): parallel KV-injection backbone plus sequential and
confidence heads (DSpark paper section 3.1; SPEC section 2).

Shapes: B batch, T context length, A anchors (blocks) per sequence, S block slots (gamma for
DSpark, gamma + 1 for DFlash), K = gamma prediction slots, H hidden size, m target layers, V vocab.

The target's token embedding and LM head are shared and frozen: they are held as non-persistent
buffers, so checkpoints carry only the drafter's own weights and the serving engine binds the
target's tensors at load time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from . import draft_vocab as dv
from .config import DrafterCheckpointError, DSparkConfig, read_drafter_config
from .heads import ConfidenceHead, MarkovHead, RNNHead
from .layers import DrafterLayer, RMSNorm, RotaryEmbedding
from .packing import PackedBlocks

WEIGHTS_NAME = "model.safetensors"


@dataclass
class DraftContextCache:
    """Per-layer context keys/values of the committed prefix (positions 0..length-1).

    keys[i], values[i]: [B, nkv, C, hd] with RoPE applied. Context features of a position never
    change once the target has processed it, so the cache only grows (by accepted tokens).
    """

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[2]


@dataclass
class BlockProposal:
    """One drafted block.

    tokens: int64 [B, K]; probs: fp32 [B, K, V] draft distributions the tokens were sampled from
    (None for greedy); confidence_logits: fp32 [B, K] raw z_k (None without a confidence head).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidence_logits: torch.Tensor | None


class DrafterBase(nn.Module):
    """What every drafter shares: the frozen target embedding and LM head (non-persistent
    buffers, so checkpoints carry only the drafter's own weights), HF-style checkpoints, and the
    calibrated confidence c_k = sigma(z_k / T_k).

    Subclasses implement the training forward (``forward(packed) -> [N, K, H]``),
    ``draft_logits`` and the inference protocol ``new_draft_state`` / ``extend_context`` /
    ``propose_block`` used by the speculative engine.

    With ``config.draft_vocab_size`` N > 0 the drafter predicts in a frequency-ranked draft
    vocabulary (``drafters/draft_vocab.py``): ``d2t`` (int64 [N], a persistent buffer saved with the
    weights) maps draft ids to target ids, the draft LM head is the frozen target rows
    ``lm_head_weight[d2t]``, and proposals come back as target ids with probabilities that are 0
    outside the subset.

    Args:
        draft_vocab: int64 [N] target ids of the draft vocabulary (most frequent first); None with
            N > 0 means "loaded from a checkpoint next".
    Raises:
        ValueError: the target tensors do not match the config's vocabulary / hidden size, or the
            draft vocabulary is malformed.
    """

    def __init__(self, config: DSparkConfig, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, draft_vocab=None):
        super().__init__()
        v, h = config.target_vocab_size, config.hidden_size
        for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if tuple(w.shape) != (v, h):
                raise ValueError(f"{name} has shape {tuple(w.shape)}, drafter config expects {(v, h)}")
        self.config = config
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        n = config.draft_vocab_size
        if n:
            d2t = torch.as_tensor(draft_vocab if draft_vocab is not None else range(n),
                                  dtype=torch.int64, device=lm_head_weight.device)
            dv.check_draft_vocab(d2t, n, v)
            if draft_vocab is not None:
                config.draft_vocab_sha256 = dv.fingerprint(d2t)
            self.register_buffer("d2t", d2t)
        else:
            self.d2t = None
        self.register_buffer("t2d", None, persistent=False)
        self.register_buffer("draft_head_weight", None, persistent=False)
        self._bind_draft_vocab()
        # a loaded checkpoint brings its own d2t: re-derive the subset head and the inverse map
        self.register_load_state_dict_post_hook(lambda module, _keys: module._bind_draft_vocab())

    def _bind_draft_vocab(self) -> None:
        if self.d2t is None:
            self.draft_head_weight = self.lm_head_weight
            return
        d2t = self.d2t.to(self.lm_head_weight.device)
        self.draft_head_weight = self.lm_head_weight[d2t]
        self.t2d = dv.target_to_draft(d2t, self.config.target_vocab_size)

    def _apply(self, fn, recurse=True):
        # .to(dtype/device) converts every buffer; keep the subset head a view of the same rows
        out = super()._apply(fn, recurse)
        if self.d2t is None:
            self.draft_head_weight = self.lm_head_weight
        return out

    # ------------------------------------------------------------------ draft vocabulary
    def draft_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits through the frozen LM head rows of the draft vocabulary:
        [..., H] -> fp32 [..., N] (N = V without a draft vocabulary)."""
        # as one 2-D product: a strided 3-D slice (the first k of a block's slots) would
        # otherwise run as a batched matmul over a per-row copy of the [H, N] weight (measured:
        # 7x the cost of the whole block at 64 rows on CPU)
        flat = F.linear(hidden.reshape(-1, hidden.shape[-1]), self.draft_head_weight.to(hidden.dtype))
        return flat.view(*hidden.shape[:-1], -1).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """int64 draft ids -> target ids (identity without a draft vocabulary)."""
        return draft_ids if self.d2t is None else self.d2t[draft_ids]

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """int64 target ids -> draft ids, N for ids outside the subset (identity without one)."""
        return target_ids if self.t2d is None else self.t2d[target_ids]

    def to_target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """fp32 [..., N] draft-vocabulary distributions -> [..., V] (0 outside the subset)."""
        if self.d2t is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.config.target_vocab_size)
        return full.index_copy_(-1, self.d2t, probs)

    def calibrated_confidence(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        """c_k = sigma(z_k / T_k) with the checkpoint's STS temperatures: [.., l] -> [.., l] for the
        first l <= K positions."""
        temps = self.config.calibration_temperatures
        if temps is None:
            return torch.sigmoid(confidence_logits)
        l = confidence_logits.shape[-1]
        t = torch.tensor(temps[:l], dtype=confidence_logits.dtype, device=confidence_logits.device)
        return torch.sigmoid(confidence_logits / t)

    def save_pretrained(self, path: str | Path) -> None:
        """Write an HF-style directory: ``config.json`` + ``model.safetensors`` (drafter weights
        only; the shared embedding and LM head stay with the target)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(path)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, path: str | Path, embed_weight: torch.Tensor,
                        lm_head_weight: torch.Tensor, dtype: torch.dtype = torch.float32):
        """Load a drafter directory written by :meth:`save_pretrained`.

        Raises:
            FileNotFoundError: no drafter checkpoint at ``path``.
            DrafterCheckpointError (a ValueError): an invalid config, or weights that are damaged,
                missing tensors or of other shapes (the file named).
            ValueError: the bound target tensors do not match the checkpoint's config.
        """
        path = Path(path)
        if not (path / "config.json").is_file() or not (path / WEIGHTS_NAME).is_file():
            raise FileNotFoundError(f"no drafter checkpoint (config.json + {WEIGHTS_NAME}) at {path}")
        config = read_drafter_config(path)
        model = cls(config, embed_weight, lm_head_weight)
        try:
            model.load_state_dict(load_file(str(path / WEIGHTS_NAME)), strict=True)
        except Exception as err:  # safetensors' own error type, or load_state_dict's RuntimeError
            raise DrafterCheckpointError(
                f"{path / WEIGHTS_NAME}: damaged, or not the weights of {path / 'config.json'} "
                f"({type(err).__name__}: {str(err).strip()})") from err
        if config.draft_vocab_size:
            dv.check_draft_vocab(model.d2t, config.draft_vocab_size, config.target_vocab_size)
            if dv.fingerprint(model.d2t) != config.draft_vocab_sha256:
                raise ValueError(f"{path}: the draft vocabulary map in {WEIGHTS_NAME} does not "
                                 f"match the config's draft_vocab_sha256 (weights and config come "
                                 "from different drafters)")
        # the drafter runs where the target's tensors are (they were bound as buffers)
        return model.to(device=embed_weight.device, dtype=dtype).eval()

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    @torch.no_grad()
    def propose_block_batch(self, states: list, anchor_tokens: torch.Tensor,
                            anchor_positions: torch.Tensor, num_tokens: int, temperature,
                            generator=None, top_p=1.0,
                            row_limits: torch.Tensor | None = None) -> BlockProposal:
        """Draft for R requests (see DSparkDrafter's batched override). This generic version
        calls :meth:`propose_block` once per request (each with its own draft length) and stacks
        the results, padding shorter rows with token 0 / zero probabilities (never verified).

        Args:
            states: R per-request draft states; anchor_tokens, anchor_positions: int64 [R];
            num_tokens: the longest row's length; row_limits: int64 [R] per-row lengths (>= 1);
            temperature, top_p: float or fp32 [R]; generator: one per row (list) or shared.
        """
        r = len(states)
        limits = row_limits.tolist() if row_limits is not None else [num_tokens] * r
        per_row = lambda v, j: v[j:j + 1] if isinstance(v, torch.Tensor) and v.dim() else v
        parts = [self.propose_block(states[j], anchor_tokens[j:j + 1], anchor_positions[j:j + 1],
                                    limits[j], per_row(temperature, j),
                                    generator[j] if isinstance(generator, (list, tuple)) else generator,
                                    per_row(top_p, j)) for j in range(r)]
        pad = lambda t, value=0: torch.nn.functional.pad(
            t, (0, 0) * (t.dim() - 2) + (0, num_tokens - t.shape[1]), value=value)
        probs = [p.probs for p in parts]
        if any(p is not None for p in probs):
            v = self.config.target_vocab_size
            probs = torch.cat([pad(p if p is not None else torch.nn.functional.one_hot(
                q.tokens, v).float()) for p, q in zip(probs, parts)])
        else:
            probs = None
        confs = [p.confidence_logits for p in parts]
        return BlockProposal(tokens=torch.cat([pad(p.tokens) for p in parts]), probs=probs,
                             confidence_logits=None if confs[0] is None
                             else torch.cat([pad(c) for c in confs]))




class DSparkDrafter(DrafterBase):
    """DSpark / DFlash drafter.

    Args:
        config: a :class:`DSparkConfig`.
        embed_weight: the target's input embedding, [V, H] (frozen, shared).
        lm_head_weight: the target's LM head, [V, H] (frozen, shared).
    Raises:
        ValueError: the tensors do not match the config's vocabulary / hidden size.
    """

    def __init__(self, config: DSparkConfig, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, draft_vocab=None):
        super().__init__(config, embed_weight, lm_head_weight, draft_vocab)
        h = config.hidden_size
        n = config.draft_vocab_len
        n_in = n + 1 if config.draft_vocab_size else n  # + "previous token outside the subset"
        m_h = config.num_context_layers * config.target_hidden_size
        self.context_proj = nn.Linear(m_h, h, bias=False)  # W_c of Eq. 2
        self.context_norm = RMSNorm(h, config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.randn(h) * float(embed_weight.float().std()))
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        if config.head_type == "markov":
            self.head = MarkovHead(n_in, config.markov_rank, n)
        elif config.head_type == "rnn":
            self.head = RNNHead(n_in, config.markov_rank, h, n)
        else:
            self.head = None
        self.confidence = ConfidenceHead(h, config.markov_rank) if config.confidence_head else None

    @torch.no_grad()
    def init_from_target(self, layer_states: list[dict], norm_state: dict) -> None:
        """Start the backbone from the target's last decoder layers instead of random weights.

        The drafter layers take the weights of the target's last ``num_hidden_layers`` decoder
        layers (same parameter names and shapes: Llama / Qwen3 layers), the final norm the
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
            ValueError: wrong number of layers; RuntimeError: names or shapes do not match.
        """
        if len(layer_states) != len(self.layers):
            raise ValueError(f"init_from_target needs {len(self.layers)} layer states, got "
                             f"{len(layer_states)}")
        for layer, state in zip(self.layers, layer_states):
            own = layer.state_dict()
            state = {k: v.to(own[k].dtype) for k, v in state.items()
                     if not k.endswith("rotary_emb.inv_freq")}
            # q/k norms the target's layers lack (drafter.qk_norm on a Llama target) keep their
            # own values (1 in a fresh drafter)
            missing = {k for k in own if k not in state and k.endswith(("q_norm.weight",
                                                                       "k_norm.weight"))}
            layer.load_state_dict({**state, **{k: own[k] for k in missing}}, strict=True)
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

    def block_inputs(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """Anchor embedding followed by S-1 mask embeddings: int64 [...] -> [..., S, H]."""
        anchor = F.embedding(anchor_tokens, self.embed_weight).to(self.mask_embedding.dtype)
        masks = self.mask_embedding.expand(*anchor_tokens.shape, self.config.num_slots - 1, -1)
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
            self.config.num_slots, device=ctx.device)  # [N, S]
        block_rope = self.rotary(q_pos, ctx.dtype)
        hidden = self.block_inputs(packed.anchor_tokens)  # [N, S, H]
        for layer in self.layers:
            ctx_kv = layer.self_attn.project_packed_context(ctx, *ctx_rope)
            hidden = layer(hidden, block_rope, ctx_kv, packed=packed)
        off = self.config.prediction_offset
        return self.norm(hidden)[:, off:off + self.config.block_size]

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

    def draft_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor):
        """Teacher-forced corrected draft logits and confidence logits (dense; small shapes).

        Args:
            hidden: [N, K, H] prediction-slot states.
            prev_tokens: int64 [N, K], x_{k-1} of each slot (x_0 = anchor), ground truth.
        Returns:
            (logits fp32 [N, K, N_d] = U_k + B_k (Eq. 4) over the draft vocabulary, confidence
            logits fp32 [N, K] or None).
        """
        feat, conf = self.head_features(hidden, prev_tokens)
        return self.logits_from(hidden, feat), conf

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
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, *rope)
            if len(cache.keys) <= i:
                cache.keys.append(k)
                cache.values.append(v)
            else:
                cache.keys[i] = torch.cat((cache.keys[i], k), dim=2)
                cache.values[i] = torch.cat((cache.values[i], v), dim=2)

    @torch.no_grad()
    def block_hidden(self, cache: DraftContextCache, anchor_tokens: torch.Tensor,
                     anchor_positions: torch.Tensor) -> torch.Tensor:
        """Backbone pass for one block per sequence: anchor_tokens, anchor_positions int64 [B]
        -> prediction-slot states [B, K, H]. The cache must hold exactly positions < anchor."""
        s = self.config.num_slots
        dev = anchor_tokens.device
        hidden = self.block_inputs(anchor_tokens)  # [B, S, H]
        rope = self.rotary(anchor_positions[:, None] + torch.arange(s, device=dev), hidden.dtype)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, rope, (cache.keys[i], cache.values[i]), None)
        off = self.config.prediction_offset
        return self.norm(hidden)[:, off:off + self.config.block_size]

    @torch.no_grad()
    def propose_block(self, cache: DraftContextCache, anchor_tokens: torch.Tensor,
                      anchor_positions: torch.Tensor, num_tokens: int, temperature,
                      generator=None, top_p=1.0) -> BlockProposal:
        """Draft ``num_tokens`` tokens after the anchors: :meth:`block_hidden` then
        :meth:`propose`. anchor_tokens, anchor_positions: int64 [B]; the cache must hold exactly
        the positions < anchor."""
        hidden = self.block_hidden(cache, anchor_tokens, anchor_positions)
        return self.propose(hidden, anchor_tokens, num_tokens, temperature, generator, top_p)

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, num_tokens: int,
                temperature, generator=None, top_p=1.0,
                row_limits: torch.Tensor | None = None) -> BlockProposal:
        """Sample a block left to right from p_k = softmax((U_k + B_k(x_{k-1})) / T) (Eq. 4).

        Args:
            hidden: [B, K, H] from :meth:`block_hidden`.
            anchor_tokens: int64 [B], x_0.
            num_tokens: how many draft tokens to sample (<= K).
            temperature: float or fp32 [B]; <= 0 means greedy (argmax), otherwise the sampling
                temperature, which must be the one the target is verified at (SPEC 5).
            generator: RNG, or one per row.
            top_p: float or fp32 [B], nucleus filter applied to the draft distribution too.
            row_limits: int64 [B] or None; row b samples only its first row_limits[b] tokens
                (the rest are argmax fillers that draw no randomness and must not be verified).
        Returns:
            a :class:`BlockProposal` with ``num_tokens`` target-id tokens (``probs`` over the target
            vocabulary, None when every row is greedy).
        """
        from .sampling import sample_rows

        b = hidden.shape[0]
        base = self.draft_head(hidden[:, :num_tokens])
        state = self.head.init_state(b, hidden.device, hidden.dtype) if self.head else None
        prev = self.to_draft_ids(anchor_tokens)
        tokens, probs, confs = [], [], []
        all_greedy = bool((torch.as_tensor(temperature) <= 0).all())
        for k in range(num_tokens):
            logits = base[:, k]
            if self.head is not None:
                bias, prev_emb, state = self.head.step(state, hidden[:, k], prev)
                logits = logits + bias.float()
                if self.confidence is not None:
                    confs.append(self.confidence(hidden[:, k], prev_emb))
            if all_greedy:  # argmax only: no distribution is needed to verify greedy drafts
                tok = logits.argmax(-1)
            else:
                active = None if row_limits is None else row_limits > k
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
                            anchor_positions: torch.Tensor, num_tokens: int, temperature,
                            generator=None, top_p=1.0,
                            row_limits: torch.Tensor | None = None) -> BlockProposal:
        """One batched drafter call for many requests with context caches of different lengths
        (continuous batching): the caches are left-padded into one [R, nkv, C_max, hd] tensor per
        layer with a key-padding mask.

        Args:
            states: R per-request caches; state r must hold exactly positions < anchor_positions[r].
            anchor_tokens, anchor_positions: int64 [R].
            num_tokens: draft length of the longest row.
            temperature, top_p: float or fp32 [R]; generator: one per row (list) or shared.
            row_limits: int64 [R], each row's own draft length (see :meth:`propose`).
        Returns:
            a :class:`BlockProposal` over the R rows.
        """
        r, s = len(states), self.config.num_slots
        lengths = [st.length for st in states]
        c_max = max(lengths)
        dev = anchor_tokens.device
        hidden = self.block_inputs(anchor_tokens)  # [R, S, H]
        rope = self.rotary(anchor_positions[:, None] + torch.arange(s, device=dev), hidden.dtype)
        # key-padding mask [R, 1, S, C_max + S]: left padding is invisible, the block is visible
        valid = torch.arange(c_max, device=dev)[None, :] >= (c_max - torch.tensor(lengths, device=dev))[:, None]
        mask = torch.cat((valid, torch.ones(r, s, dtype=torch.bool, device=dev)), dim=1)
        mask = mask[:, None, None, :].expand(r, 1, s, c_max + s)
        for i, layer in enumerate(self.layers):
            keys = torch.zeros(r, *states[0].keys[i].shape[1:2], c_max, states[0].keys[i].shape[-1],
                               dtype=hidden.dtype, device=dev)
            values = torch.zeros_like(keys)
            for j, st in enumerate(states):  # [1, nkv, C_j, hd] -> right-aligned row j
                keys[j, :, c_max - lengths[j]:] = st.keys[i][0]
                values[j, :, c_max - lengths[j]:] = st.values[i][0]
            hidden = layer(hidden, rope, (keys, values), mask)
        off = self.config.prediction_offset
        hidden = self.norm(hidden)[:, off:off + self.config.block_size]
        return self.propose(hidden, anchor_tokens, num_tokens, temperature, generator, top_p,
                            row_limits)


def _model_basename(name: str) -> str:
    """'Qwen/Qwen3-4B', '/models/Qwen3-4B/' and '~/x/qwen3-4b' all give 'qwen3-4b'."""
    return name.rstrip("/").split("/")[-1].lower()


def check_target_compatibility(config: DSparkConfig, target_name: str, vocab_size: int,
                               hidden_size: int, num_layers: int,
                               allow_name_mismatch: bool = False) -> None:
    """Reject a drafter trained for another target.

    The names are compared by their last path component (a hub id and a local copy of the same
    model match); a renamed copy can be accepted with ``allow_name_mismatch``, the shapes never.

    Raises:
        ValueError: naming each mismatch (model name, vocabulary, hidden size, layer ids).
    """
    problems = []
    trained, serving = _model_basename(config.target_name_or_path), _model_basename(target_name)
    if not allow_name_mismatch and trained and serving and trained != serving:
        problems.append(f"model name {trained!r} != serving target's {serving!r} (a fine-tune of "
                        "the same base still changes acceptance; pass allow_name_mismatch for a "
                        "renamed copy)")
    if config.target_vocab_size != vocab_size:
        problems.append(f"vocab size {config.target_vocab_size} != target's {vocab_size}")
    if config.target_hidden_size != hidden_size:
        problems.append(f"hidden size {config.target_hidden_size} != target's {hidden_size}")
    if min(config.target_layer_ids) < 0 or max(config.target_layer_ids) >= num_layers:
        problems.append(f"layer ids {config.target_layer_ids} exceed the target's {num_layers} layers")
    if problems:
        raise ValueError(f"drafter was trained for target {config.target_name_or_path!r}, serving "
                         f"target is {target_name!r}: " + "; ".join(problems))


def describe(config: DSparkConfig) -> str:
    """One-line JSON summary used in logs."""
    keys = ("drafter_type", "target_name_or_path", "block_size", "num_hidden_layers", "head_type",
            "target_layer_ids")
    return json.dumps({k: getattr(config, k) for k in keys})
