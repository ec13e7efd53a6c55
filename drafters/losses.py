"""Training losses of DSpark and DFlash (DSpark paper Eqs. 9-12; SPEC section 3).

With position weights w_k = exp(-(k-1)/decay):
- L_ce: weighted cross entropy of the corrected draft distribution on the true token;
- L_tv: weighted L1 distance ||p_d - p_t||_1 (twice the TV distance) to the target distribution;
- L_conf: BCE of the confidence logit against the soft label c*_k = 1 - 0.5 ||p_d - p_t||_1
  (detached), i.e. the probability that token k is accepted by rejection sampling;
- L = 0.1 L_ce + 0.9 L_tv + 1.0 L_conf (DFlash: L_ce only);
- Eagle3 (training-time test): soft cross entropy -sum_v p_t(v) log p_d(v) against the target
  distribution, step weights 0.8^(k-1) (EAGLE-3; SPEC 2).

Shapes: N blocks, K = gamma slots, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .draft_vocab import target_to_draft


def position_weights(block_size: int, decay: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/decay) for k = 1..gamma: fp32 [K]."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / decay)


def eagle3_step_weights(block_size: int, base: float = 0.8) -> torch.Tensor:
    """Training-time-test step weights base^(k-1) for k = 1..gamma (EAGLE-3; SPEC 2): fp32 [K]."""
    return base ** torch.arange(block_size, dtype=torch.float32)


OBJECTIVES = ("dspark", "ce", "soft_ce")
DEFAULT_CHUNK_ROWS = 1024


# rows of a [rows, V] target-logit matrix converted and normalised at a time: at V = 49k a slice
# is ~12 MB in fp32 and stays in cache between its conversion, log-sum-exp and gather, where the
# whole matrix (~170 MB at 880 rows) went through memory several times (1.16x a training step,
# ~330 MB less peak: benchmarks/results/train_throughput/2026-12-02_unrecorded_loss_path.md)
TARGET_SLICE_ROWS = 64


def target_terms(target_logits: torch.Tensor, draft_vocab: torch.Tensor | None = None,
                 slice_rows: int = TARGET_SLICE_ROWS):
    """The target side of the losses for rows: (p_t on the drafter's vocabulary fp32 [R, N],
    target mass outside it fp32 [R] or None without a draft vocabulary). No grad needed.

    ``target_logits`` [R, V] may be bf16 (the LM head under autocast): each slice of
    ``slice_rows`` rows (>= 1) is converted to fp32 before its log-sum-exp.

    Raises:
        ValueError: ``slice_rows`` < 1.
    """
    if slice_rows < 1:
        raise ValueError(f"slice_rows must be >= 1, got {slice_rows}")
    target_logits = target_logits.detach()
    if draft_vocab is not None:
        draft_vocab = draft_vocab.to(target_logits.device)
    rows = target_logits.shape[0]
    width = target_logits.shape[-1] if draft_vocab is None else draft_vocab.numel()
    p_t = torch.empty(rows, width, dtype=torch.float32, device=target_logits.device)
    for start in range(0, rows, slice_rows):
        x = target_logits[start:start + slice_rows].float()
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        picked = x if draft_vocab is None else x.index_select(-1, draft_vocab)
        torch.sub(picked, lse, out=p_t[start:start + slice_rows])
    p_t.exp_()
    if draft_vocab is None:
        return p_t, None
    return p_t, (1.0 - p_t.sum(-1)).clamp(min=0.0)


def row_loss_terms(draft_logits: torch.Tensor, target_logits: torch.Tensor | None,
                   labels: torch.Tensor, draft_vocab: torch.Tensor | None = None,
                   target_parts: tuple | None = None):
    """Per-row loss terms of supervised slots (the one definition every loss path uses).

    With a draft vocabulary (``drafters/draft_vocab.py``) the draft distribution p_d lives on the
    N subset tokens and is 0 elsewhere, while the target distribution p_t is the full softmax:
    - L1 = sum_{v in subset} |p_d(v) - p_t(v)| + p_t(outside), i.e. target mass outside the subset
      counts as rejected mass, exactly as rejection sampling sees it;
    - CE: a label outside the subset cannot be predicted; its row gets CE 0 and ``in_vocab`` False
      (the caller averages CE over in-vocabulary rows only; the L1 term still penalises the row);
    - soft CE = -sum_{v in subset} p_t(v) log p_d(v) (the outside mass only adds a constant).

    Args:
        draft_logits: fp32 [R, N] (N = V without a draft vocabulary).
        target_logits: [R, V] (no grad needed), computed in fp32; or None with ``target_parts``.
        labels: int64 [R], target ids of the true next tokens.
        draft_vocab: int64 [N] draft -> target ids, or None (full vocabulary).
        target_parts: :func:`target_terms` of the rows, when already computed.
    Returns:
        (ce [R], l1 [R] in [0, 2], soft_ce [R], in_vocab bool [R]).
    """
    p_t_sub, outside = target_parts if target_parts is not None else target_terms(
        target_logits, draft_vocab)
    if draft_vocab is None:
        labels_d, in_vocab = labels, torch.ones_like(labels, dtype=torch.bool)
    else:
        n = draft_vocab.numel()
        vocab = max(int(draft_vocab.max()), int(labels.max())) + 1
        labels_d = target_to_draft(draft_vocab.to(labels.device), vocab)[labels]  # n = outside
        in_vocab = labels_d < n
        labels_d = labels_d.clamp(max=n - 1)
    logp_d = torch.log_softmax(draft_logits, dim=-1)
    ce = -logp_d.gather(-1, labels_d[:, None]).squeeze(-1) * in_vocab
    l1 = (logp_d.exp() - p_t_sub).abs().sum(-1)
    if outside is not None:
        l1 = l1 + outside
    soft = -(p_t_sub * logp_d).sum(-1)
    return ce, l1, soft, in_vocab


def chunked_drafter_losses(draft_logits_fn, target_logits_fn, labels: torch.Tensor,
                           valid: torch.Tensor, weights: torch.Tensor,
                           confidence_logits: torch.Tensor | None = None,
                           coefficients: tuple[float, float, float] = (0.1, 0.9, 1.0),
                           objective: str = "dspark", draft_vocab: torch.Tensor | None = None,
                           chunk_rows: int = DEFAULT_CHUNK_ROWS, recompute: bool | None = None,
                           target_slice_rows: int = TARGET_SLICE_ROWS
                           ) -> dict[str, torch.Tensor]:
    """The drafter losses computed over the R supervised rows in chunks of ``chunk_rows``: no
    fp32 [rows, V] tensor lives longer than one chunk. With the full vocabulary, or with several
    chunks, each chunk's work (target and draft logits and the three terms) runs under activation
    checkpointing, so the backward pass recomputes it chunk by chunk instead of keeping it. A
    draft vocabulary makes what one chunk keeps small ([c, N] subset probabilities and [c]
    outside mass of the target; the draft log-probabilities, probabilities and their difference
    from the target's, 12 B per [row, N] entry): when all rows fit one chunk (the usual CPU
    micro-batch) nothing is recomputed, which is pure saving, as backward would recompute the
    same chunk at once (1.13x a step: ``benchmarks/results/train_throughput/2026-12-02_unrecorded_loss_path.md``).

    Args:
        draft_logits_fn: ``fn(idx int64 [c]) -> fp32 [c, N]``, draft logits of supervised rows
            ``idx`` (with grad).
        target_logits_fn: ``fn(idx) -> [c, V]``, the target's logits of the same rows (no grad).
        labels: int64 [N_blocks, K]; valid: bool [N_blocks, K] (a prefix of each block);
        weights: fp32 [K] position weights; confidence_logits: fp32 [N_blocks, K] or None;
        coefficients, objective: see :func:`drafter_losses`;
        draft_vocab: int64 [N] or None (see :func:`row_loss_terms`);
        chunk_rows: rows per chunk (>= 1).
        recompute: run each chunk's terms under activation checkpointing (None: without a draft
            vocabulary or with more than one chunk, as above; False keeps every chunk's tensors,
            memory growing with the rows); target_slice_rows: see :func:`target_terms` (>= 1).
    Returns / Raises: as :func:`drafter_losses`.
    """
    from torch.utils.checkpoint import checkpoint

    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; expected one of {OBJECTIVES}")
    if not bool(valid.any()):
        raise ValueError("drafter_losses got a batch without any supervised slot")
    if chunk_rows < 1 or target_slice_rows < 1:
        raise ValueError(f"chunk_rows and target_slice_rows must be >= 1, got {chunk_rows} and "
                         f"{target_slice_rows}")
    device = valid.device
    w = weights.to(device)[None, :].expand_as(valid)[valid]  # [R]
    labels_v = labels[valid]
    rows = labels_v.numel()
    if recompute is None:
        recompute = draft_vocab is None or rows > chunk_rows

    def chunk_terms(idx: torch.Tensor, w_c: torch.Tensor, p_t_sub=None, outside=None):
        if p_t_sub is None:
            with torch.no_grad():
                parts = target_terms(target_logits_fn(idx), draft_vocab, target_slice_rows)
        else:
            parts = (p_t_sub, outside)
        ce, l1, soft, in_vocab = row_loss_terms(draft_logits_fn(idx), None, labels_v[idx],
                                                draft_vocab, parts)
        return (w_c * ce).sum(), (w_c * l1).sum(), (w_c * soft).sum(), l1.detach(), in_vocab

    sums = [torch.zeros((), device=device) for _ in range(3)]
    l1_parts, in_vocab_parts = [], []
    for start in range(0, rows, chunk_rows):
        idx = torch.arange(start, min(rows, start + chunk_rows), device=device)
        w_c = w[idx]
        parts = ()
        if draft_vocab is not None:  # small: keep it instead of recomputing [c, V] in backward
            with torch.no_grad():
                parts = target_terms(target_logits_fn(idx), draft_vocab, target_slice_rows)
        if torch.is_grad_enabled() and recompute:
            out = checkpoint(chunk_terms, idx, w_c, *parts, use_reentrant=False)
        else:
            out = chunk_terms(idx, w_c, *parts)
        for i in range(3):
            sums[i] = sums[i] + out[i]
        l1_parts.append(out[3])
        in_vocab_parts.append(out[4])
    l1_rows = torch.cat(l1_parts)
    in_vocab = torch.cat(in_vocab_parts)
    w_sum = w.sum()
    ce = sums[0] / (w * in_vocab).sum().clamp(min=1e-12)
    tv, soft_ce = sums[1] / w_sum, sums[2] / w_sum
    conf = torch.zeros((), device=device)
    if confidence_logits is not None:
        soft_label = (1.0 - 0.5 * l1_rows).clamp(0.0, 1.0)
        conf = F.binary_cross_entropy_with_logits(confidence_logits[valid].float(), soft_label)
    c_ce, c_tv, c_conf = coefficients
    if objective == "dspark":
        loss = c_ce * ce + c_tv * tv + c_conf * conf
    else:  # conf is 0 without a confidence head (DFlash, Eagle3)
        loss = (ce if objective == "ce" else soft_ce) + c_conf * conf

    with torch.no_grad():
        accept = torch.zeros(valid.shape, device=device)
        accept[valid] = 1.0 - 0.5 * l1_rows
        survival = accept.cumprod(dim=1)  # 0 after the first unsupervised slot
        counts = valid.sum(0).clamp(min=1)
        accept_rate = survival.sum(0) / counts
        has_slot = valid[:, 0]  # padding blocks (no supervised slot) do not count
        tau = 1.0 + survival[has_slot].sum(1).mean()
    return {"loss": loss, "ce": ce.detach(), "tv": tv.detach(), "conf": conf.detach(),
            "soft_ce": soft_ce.detach(), "accept_rate": accept_rate, "tau": tau,
            "draft_vocab_coverage": in_vocab.float().mean()}


def drafter_losses(draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor,
                   valid: torch.Tensor, weights: torch.Tensor,
                   confidence_logits: torch.Tensor | None = None,
                   coefficients: tuple[float, float, float] = (0.1, 0.9, 1.0),
                   objective: str = "dspark",
                   draft_vocab: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Losses and per-step training metrics from dense logits (small shapes and tests; training
    uses :func:`chunked_drafter_losses`, which this calls with one chunk).

    Args:
        draft_logits: fp32 [N, K, Nd], U_k + B_k (Nd = V without a draft vocabulary).
        target_logits: fp32 [N, K, V], LM_head(last_hidden[p+j]) (no grad needed).
        labels: int64 [N, K], the true next tokens (target ids).
        valid: bool [N, K], supervised slots (a prefix of each block).
        weights: fp32 [K], position weights w_k.
        confidence_logits: fp32 [N, K] or None.
        coefficients: (ce, tv, conf) mixing weights; ``"ce"`` and ``"soft_ce"`` use only conf's.
        objective: ``"dspark"`` (Eq. 12 mix), ``"ce"`` (DFlash: L = L_ce) or ``"soft_ce"``
            (Eagle3: L = weighted -sum p_t log p_d); the latter two add conf * L_conf when the
            drafter has a confidence head (a DSpark trained with another objective). Every term
            is reported whatever the objective.
        draft_vocab: int64 [Nd] draft -> target ids, or None (see :func:`row_loss_terms`).
    Returns:
        dict with ``loss`` (scalar with grad), ``ce``, ``tv``, ``conf``, ``soft_ce`` (detached
        scalars), ``accept_rate`` fp32 [K] (accept_rate@k = mean over blocks whose slot k is
        supervised of prod_{i<=k}(1 - TV_i)), ``tau`` (probabilistic accepted length
        1 + sum_k prod_{i<=k}(1 - TV_i), averaged over blocks with a supervised first slot;
        truncated blocks count what they have) and ``draft_vocab_coverage`` (share of supervised
        labels inside the draft vocabulary).
    Raises:
        ValueError: no supervised slot at all, or an unknown objective.
    """
    logits_v, target_v = draft_logits[valid], target_logits[valid]
    return chunked_drafter_losses(lambda idx: logits_v[idx], lambda idx: target_v[idx], labels,
                                  valid, weights, confidence_logits, coefficients, objective,
                                  draft_vocab, chunk_rows=max(1, logits_v.shape[0]))
