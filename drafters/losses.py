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


def position_weights(block_size: int, decay: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/decay) for k = 1..gamma: fp32 [K]."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / decay)


def eagle3_step_weights(block_size: int, base: float = 0.8) -> torch.Tensor:
    """Training-time-test step weights base^(k-1) for k = 1..gamma (EAGLE-3; SPEC 2): fp32 [K]."""
    return base ** torch.arange(block_size, dtype=torch.float32)


OBJECTIVES = ("dspark", "ce", "soft_ce")


def drafter_losses(draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor,
                   valid: torch.Tensor, weights: torch.Tensor,
                   confidence_logits: torch.Tensor | None = None,
                   coefficients: tuple[float, float, float] = (0.1, 0.9, 1.0),
                   objective: str = "dspark") -> dict[str, torch.Tensor]:
    """Losses and per-step training metrics.

    Args:
        draft_logits: fp32 [N, K, V], U_k + B_k.
        target_logits: fp32 [N, K, V], LM_head(last_hidden[p+j]) (no grad needed).
        labels: int64 [N, K], the true next tokens.
        valid: bool [N, K], supervised slots (a prefix of each block).
        weights: fp32 [K], position weights w_k.
        confidence_logits: fp32 [N, K] or None.
        coefficients: (ce, tv, conf) mixing weights.
        objective: ``"dspark"`` (Eq. 12 mix), ``"ce"`` (DFlash: L = L_ce) or ``"soft_ce"``
            (Eagle3: L = weighted -sum p_t log p_d). Every term is reported whatever the objective.
    Returns:
        dict with ``loss`` (scalar with grad), ``ce``, ``tv``, ``conf``, ``soft_ce`` (detached
        scalars),
        ``accept_rate`` fp32 [K] (accept_rate@k = mean over blocks whose slot k is supervised of
        prod_{i<=k}(1 - TV_i)) and ``tau`` (probabilistic accepted length
        1 + sum_k prod_{i<=k}(1 - TV_i), averaged over blocks with a supervised first slot;
        truncated blocks count what they have).
    Raises:
        ValueError: no supervised slot at all, or an unknown objective.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; expected one of {OBJECTIVES}")
    if not bool(valid.any()):
        raise ValueError("drafter_losses got a batch without any supervised slot")
    w = weights.to(draft_logits.device)[None, :].expand_as(valid)
    wv = w[valid]
    logits_v = draft_logits[valid]  # [R, V]
    ce_rows = F.cross_entropy(logits_v, labels[valid], reduction="none")
    ce = (wv * ce_rows).sum() / wv.sum()
    p_t = torch.softmax(target_logits[valid].float(), dim=-1)
    with torch.set_grad_enabled(torch.is_grad_enabled() and objective == "dspark"):
        p_d = torch.softmax(logits_v, dim=-1)
        l1_rows = (p_d - p_t).abs().sum(-1)  # [R], in [0, 2]
    tv = (wv * l1_rows).sum() / wv.sum()
    with torch.set_grad_enabled(torch.is_grad_enabled() and objective == "soft_ce"):
        soft_rows = -(p_t * torch.log_softmax(logits_v, dim=-1)).sum(-1)
    soft_ce = (wv * soft_rows).sum() / wv.sum()
    conf = torch.zeros((), device=draft_logits.device)
    if confidence_logits is not None:
        soft_label = (1.0 - 0.5 * l1_rows).detach().clamp(0.0, 1.0)
        conf = F.binary_cross_entropy_with_logits(confidence_logits[valid].float(), soft_label)
    if objective == "ce":
        loss = ce
    elif objective == "soft_ce":
        loss = soft_ce
    else:
        c_ce, c_tv, c_conf = coefficients
        loss = c_ce * ce + c_tv * tv + c_conf * conf

    with torch.no_grad():
        accept = torch.zeros(valid.shape, device=draft_logits.device)
        accept[valid] = 1.0 - 0.5 * l1_rows.detach()
        survival = accept.cumprod(dim=1)  # 0 after the first unsupervised slot
        counts = valid.sum(0).clamp(min=1)
        accept_rate = survival.sum(0) / counts
        has_slot = valid[:, 0]  # padding blocks (no supervised slot) do not count
        tau = 1.0 + survival[has_slot].sum(1).mean()
    return {"loss": loss, "ce": ce.detach(), "tv": tv.detach(), "conf": conf.detach(),
            "soft_ce": soft_ce.detach(),
            "accept_rate": accept_rate, "tau": tau}

