"""What every drafter shares (:class:`DrafterBase`): the frozen target embedding and LM head, the
draft vocabulary, HF-style checkpoints, calibrated confidence, anchor packing by the type's rule,
and the generic batched proposal; plus :class:`BlockProposal`, the drafted block every drafter
returns, and the check of a checkpoint against the serving target.

Shapes: B batch, R requests, K = block_size draft tokens, H hidden size, V target vocabulary,
N draft vocabulary.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from . import draft_vocab as dv
from .config import DrafterCheckpointError, read_drafter_config
from .packing import PackedBlocks, pack_blocks

if TYPE_CHECKING:
    from .config import BoundDrafterConfig

WEIGHTS_NAME = "model.safetensors"


def row_pieces(n: int, small: int = 8) -> list[int]:
    """Split ``n`` rows of an inference product into pieces of bounded shapes: powers of two
    >= ``small``, largest first, then one remainder piece < ``small`` (150 -> [128, 16, 6]).

    Why: on CPU every new row count of a bf16 matmul makes oneDNN build a kernel, which costs
    ~4x the product itself (measured on the reference drafter's context extension: 45 against
    11 us a position), and a served request's context backlog has a length seen for the first
    time almost every call. With these pieces the row counts come from a set of ~15, so kernels
    are built once, and a kernel cache capped for memory (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``)
    keeps them.

    Args:
        n: rows (>= 0).
        small: a power of two; pieces below it are not split further (one call, not several
            tiny ones).
    Returns:
        positive piece lengths summing to ``n`` (empty for 0).
    Raises:
        ValueError: a negative ``n``, or ``small`` not a power of two.
    """
    if n < 0 or small < 1 or small & (small - 1):
        raise ValueError(f"row_pieces needs n >= 0 and a power-of-two small, got {n}, {small}")
    pieces, size = [], 1 << max(n.bit_length() - 1, 0)
    while n >= small and size >= small:
        if n >= size:
            pieces.append(size)
            n -= size
        size //= 2
    if n:
        pieces.append(n)
    return pieces


@dataclass
class BlockProposal:
    """One drafted block.

    tokens: int64 [B, K]; probs: fp32 [B, K, V] draft distributions the tokens were sampled from
    (None for greedy); confidence_logits: fp32 [B, K] raw z_k (None without a confidence head).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidence_logits: torch.Tensor | None


class DrafterBase(nn.Module, metaclass=ABCMeta):
    """What every drafter shares: the frozen target embedding and LM head (non-persistent
    buffers, so checkpoints carry only the drafter's own weights), HF-style checkpoints, and the
    calibrated confidence c_k = sigma(z_k / T_k).

    A drafter type implements the abstract methods below, which are everything training
    (``forward``, ``head_features``, ``logits_from``), calibration, evaluation and serving
    (``new_draft_state``, ``extend_context``, ``propose_block``) call; the batched inference
    calls and ``draft_logits`` have generic versions here that a type may override for speed.
    A class that leaves one out cannot be built, and ``drafters.registry.register`` refuses it
    naming what is missing. Types whose options offer ``init`` (a start from the target's layers)
    also implement ``init_from_target``; exporters read their own type's parameters.

    With ``config.draft_vocab_size`` N > 0 the drafter predicts in a frequency-ranked draft
    vocabulary (``drafters/draft_vocab.py``): ``d2t`` (int64 [N], a persistent buffer saved with the
    weights) maps draft ids to target ids, the draft LM head is the frozen target rows
    ``lm_head_weight[d2t]``, and proposals come back as target ids with probabilities that are 0
    outside the subset.

    Args:
        draft_vocab: int64 [N] target ids of the draft vocabulary (most frequent first); None with
            N > 0 means "loaded from a checkpoint next".
    Raises:
        ValueError: the config's type is built by another class, the target tensors do not match
            the config's vocabulary / hidden size, or the draft vocabulary is malformed.
    """

    def __init__(self, config: BoundDrafterConfig, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, draft_vocab=None):
        super().__init__()
        if not issubclass(config.spec.model_class, type(self)):
            raise ValueError(f"{type(self).__name__} cannot build a {config.drafter_type} drafter "
                             f"(its class is {config.spec.model_class.__name__})")
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
        self.config.save(path)
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

    # ------------------------------------------------------------------ the interface
    @abstractmethod
    def forward(self, packed: PackedBlocks) -> torch.Tensor:
        """Teacher-forced training forward over packed blocks (SPEC 3).

        Args:
            packed: a :class:`~drafters.packing.PackedBlocks` from :meth:`pack_blocks` (N blocks).
        Returns:
            the K = block_size prediction-slot states [N, K, H] (after the final norm), in the
            drafter's parameter dtype; slot k predicts x_{p+k}.
        """

    @abstractmethod
    def head_features(self, hidden: torch.Tensor, prev_tokens: torch.Tensor):
        """Teacher-forced sequential-head features and confidence logits, without any
        vocabulary-sized tensor (the trainer turns rows into logits chunk by chunk).

        Args:
            hidden: [N, K, H] slot states from :meth:`forward`.
            prev_tokens: int64 [N, K], x_{k-1} of each slot (x_0 = the anchor), target ids.
        Returns:
            (features [N, K, r] or None without a sequential head, confidence logits fp32
            [N, K] or None without a confidence head).
        """

    @abstractmethod
    def logits_from(self, hidden: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """Draft logits from slot states [..., H] and :meth:`head_features`' features [..., r]
        (or None): fp32 [..., N] over the draft vocabulary."""

    @abstractmethod
    def new_draft_state(self):
        """An empty per-request draft state with a ``length`` (committed positions it holds)."""

    @abstractmethod
    def extend_context(self, state, context_features: torch.Tensor, positions: torch.Tensor,
                       next_tokens: torch.Tensor | None = None) -> None:
        """Append committed positions to a draft state (it only grows, by accepted tokens).

        Args:
            state: from :meth:`new_draft_state`.
            context_features: [B, n, m*H_t] target features of the new positions.
            positions: int64 [B, n], consecutive from ``state.length``.
            next_tokens: int64 [B, n], the token after each position (or None where unused).
        """

    @abstractmethod
    def propose_block(self, state, anchor_tokens: torch.Tensor, anchor_positions: torch.Tensor,
                      num_draft_tokens: int, temperature, generator=None,
                      top_p=1.0) -> BlockProposal:
        """Draft ``num_draft_tokens`` (<= block_size, or more for a chained type) tokens after
        the anchors.

        Args:
            state: a draft state holding exactly the positions < anchor.
            anchor_tokens, anchor_positions: int64 [B], x_p and p.
            temperature: float or fp32 [B] (<= 0: greedy); the one the target verifies at.
            generator: RNG, or one per row; top_p: float or fp32 [B].
        Returns:
            a :class:`BlockProposal` in target ids (``probs`` None when every row is greedy).
        """

    def draft_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor):
        """Teacher-forced draft logits and confidence logits, dense (small shapes; tests and
        calibration): :meth:`head_features` then :meth:`logits_from`.

        Args:
            hidden: [N, K, H]; prev_tokens: int64 [N, K], x_{k-1} of each slot, target ids.
        Returns:
            (logits fp32 [N, K, N_d] over the draft vocabulary, confidence logits fp32 [N, K]
            or None).
        """
        features, confidence = self.head_features(hidden, prev_tokens)
        return self.logits_from(hidden, features), confidence

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def pack_blocks(self, samples: list[dict], num_anchors: int, generators) -> PackedBlocks:
        """Teacher-forced training blocks for this drafter (:func:`drafters.packing.pack_blocks`):
        its block size, anchors from its type's ``min_anchor`` on (the anchor rule)."""
        cfg = self.config
        return pack_blocks(samples, num_anchors, cfg.block_size, generators,
                           min_anchor=cfg.spec.min_anchor)

    @torch.no_grad()
    def extend_context_batch(self, states: list, context_features: list[torch.Tensor],
                             next_tokens: list[torch.Tensor]) -> None:
        """Extend R requests' draft contexts by their committed positions (each from its state's
        ``length`` on). This generic version calls ``extend_context`` per request, in
        :func:`row_pieces` (the same context as one call: extension is causal); DSpark's packs
        every request into one product. If a request's extension raises, the requests before
        it are extended and the later ones untouched (a caller tells them apart by
        ``length``).

        Args:
            states: R per-request draft states (``new_draft_state``).
            context_features: R tensors [n_r, m*H_t], the target features of the new positions.
            next_tokens: R int64 [n_r], the token after each new position.
        Raises:
            ValueError: the three lists differ in length; whatever ``extend_context`` raises.
        """
        if not len(states) == len(context_features) == len(next_tokens):
            raise ValueError(f"{len(states)} states, {len(context_features)} feature tensors and "
                             f"{len(next_tokens)} token tensors")
        for state, feats, tokens in zip(states, context_features, next_tokens):
            done = 0
            for n in row_pieces(feats.shape[0]):
                start = state.length
                self.extend_context(state, feats[None, done:done + n],
                                    torch.arange(start, start + n, device=feats.device)[None],
                                    tokens[None, done:done + n])
                done += n

    @torch.no_grad()
    def propose_block_batch(self, states: list, anchor_tokens: torch.Tensor,
                            anchor_positions: torch.Tensor, max_num_draft_tokens: int,
                            temperature, generator=None, top_p=1.0,
                            num_draft_tokens: torch.Tensor | None = None) -> BlockProposal:
        """Draft for R requests (see DSparkDrafter's batched override). This generic version
        calls :meth:`propose_block` once per request (each with its own draft length) and stacks
        the results, padding shorter rows with token 0 / zero probabilities (never verified).

        Args:
            states: R per-request draft states; anchor_tokens, anchor_positions: int64 [R];
            max_num_draft_tokens: the longest row's draft length; num_draft_tokens: int64 [R],
                each row's own (>= 1; None = all the longest);
            temperature, top_p: float or fp32 [R]; generator: one per row (list) or shared.
        """
        r = len(states)
        limits = (num_draft_tokens.tolist() if num_draft_tokens is not None
                  else [max_num_draft_tokens] * r)
        per_row = lambda v, j: v[j:j + 1] if isinstance(v, torch.Tensor) and v.dim() else v
        parts = [self.propose_block(states[j], anchor_tokens[j:j + 1], anchor_positions[j:j + 1],
                                    limits[j], per_row(temperature, j),
                                    generator[j] if isinstance(generator, (list, tuple)) else generator,
                                    per_row(top_p, j)) for j in range(r)]
        pad = lambda t, value=0: torch.nn.functional.pad(
            t, (0, 0) * (t.dim() - 2) + (0, max_num_draft_tokens - t.shape[1]), value=value)
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


def _model_basename(name: str) -> str:
    """'Qwen/Qwen3-4B', '/models/Qwen3-4B/' and '~/x/qwen3-4b' all give 'qwen3-4b'."""
    return name.rstrip("/").split("/")[-1].lower()


def check_target_compatibility(config: BoundDrafterConfig, target_name: str, vocab_size: int,
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
