"""Report figures (PNG) for calibration and speculative-decoding evaluation.

The only plotting module of the project. matplotlib is imported inside each function, and figures
are drawn on an explicit Agg canvas instead of pyplot: no GUI backend, no global figure state, so
plotting is safe inside Ray workers and threads and importing this module stays cheap.

Source: DSpark paper Figures 2, 5 and 6; SPEC sections 4-6.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from drafters.calibration import DEFAULT_NUM_BINS, cumulative_survival, reliability_bins
from drafters.calibration import expected_calibration_error, survival_labels

logger = logging.getLogger(__name__)

DEFAULT_POSITIONS = (1, 3, 5, 7)  # the paper's Figure 6 panels


def _new_figure(width_in: float, height_in: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | os.PathLike) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", bbox_inches="tight")
    logger.info("wrote %s", out)
    return out


def reliability_diagram(conf_logits, accepted, temperatures, path: str | os.PathLike,
                        positions=None, num_bins: int = DEFAULT_NUM_BINS,
                        title: str = "Prefix-survival reliability before/after STS") -> Path:
    """Reliability diagram of the prefix survival a_k before (T = 1) and after calibration.

    One panel per position; per confidence bin, bars show the empirical survival rate (fraction
    of rounds with positions 1..k all accepted) against the diagonal, with each curve's ECE in the
    legend.

    Args:
        conf_logits: [N, K] float, raw confidence logits of full-block rounds.
        accepted: [N] int in [0, K], accepted draft tokens per round (bonus excluded).
        temperatures: [K] positive floats (calibrated T_k).
        path: output PNG file (parent folders are created).
        positions: 1-based positions to draw; default 1, 3, 5, 7 restricted to those <= K.
        num_bins: equal-width confidence bins.
        title: figure title.
    Returns:
        The written path.
    Raises:
        ValueError: invalid inputs (see `drafters.calibration`), or a position outside [1, K].
    Source: DSpark paper Figure 6; SPEC 4.
    """
    before = cumulative_survival(conf_logits, [1.0] * len(temperatures))  # [N, K]
    after = cumulative_survival(conf_logits, temperatures)  # [N, K]
    gamma = before.shape[1]
    labels = survival_labels(accepted, gamma)  # [N, K]
    if positions is None:
        positions = [p for p in DEFAULT_POSITIONS if p <= gamma]
    bad = [p for p in positions if not 1 <= p <= gamma]
    if bad or not positions:
        raise ValueError(f"positions must be a non-empty subset of 1..{gamma}, got {positions}")

    fig = _new_figure(3.2 * len(positions), 3.4)
    axes = fig.subplots(1, len(positions), squeeze=False)[0]
    width = 1.0 / num_bins
    for ax, pos in zip(axes, positions):
        y = labels[:, pos - 1]
        for probs, name, color, shift in ((before, "before", "tab:red", -width / 4),
                                          (after, "after", "tab:blue", width / 4)):
            p = probs[:, pos - 1]
            bins = reliability_bins(p, y, num_bins)
            centers = (bins["lower"] + bins["upper"]) / 2
            filled = bins["count"] > 0
            ece = expected_calibration_error(p, y, num_bins)
            ax.bar(centers[filled] + shift, bins["mean_label"][filled], width=width / 2,
                   color=color, alpha=0.7, label=f"{name} (ECE {100 * ece:.1f}%)")
        ax.plot([0, 1], [0, 1], "k--", linewidth=1)
        ax.set(xlim=(0, 1), ylim=(0, 1), title=f"position {pos}", xlabel="confidence $a_k$")
        ax.legend(loc="upper left", fontsize=8)
    axes[0].set_ylabel("empirical survival rate")
    fig.suptitle(title)
    return _save(fig, path)


def conditional_acceptance_plot(curves: dict[str, list[float]], path: str | os.PathLike,
                                title: str = "Conditional acceptance by draft position") -> Path:
    """One line per drafter: P(token k accepted | tokens < k accepted) against k = 1..gamma.

    Args:
        curves: drafter name -> conditional acceptance at positions 1..K (values in [0, 1];
            None where no round reached position k: not drawn, the line stops there).
        path: output PNG file.
        title: figure title.
    Returns:
        The written path.
    Raises:
        ValueError: `curves` is empty.
    Source: DSpark paper Figure 2; SPEC 5 (conditional acceptance).
    """
    if not curves:
        raise ValueError("curves is empty: need at least one drafter")
    fig = _new_figure(5.0, 3.5)
    ax = fig.subplots()
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), [float("nan") if y is None else y for y in ys],
                marker="o", label=name)
    ax.set(ylim=(0, 1.02), xlabel="draft position k",
           ylabel="P(k accepted | <k accepted)", title=title)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def threshold_sweep_plot(sweep: list[dict], path: str | os.PathLike,
                         title: str = "Static confidence threshold sweep") -> Path:
    """Per-step token counts and acceptance rate against a static confidence threshold.

    Args:
        sweep: dicts with keys ``threshold``, ``committed_per_step``, ``accepted_per_step``,
            ``rejected_per_step`` and ``acceptance_rate`` (e.g. from
            `drafters.calibration.static_threshold_sweep`).
        path: output PNG file.
        title: figure title.
    Returns:
        The written path.
    Raises:
        ValueError: `sweep` is empty; KeyError: a dict lacks one of the keys.
    Source: DSpark paper Figure 5; SPEC 6 (static threshold baseline).
    """
    if not sweep:
        raise ValueError("sweep is empty")
    rows = sorted(sweep, key=lambda r: r["threshold"])
    x = [r["threshold"] for r in rows]
    fig = _new_figure(5.5, 3.5)
    ax = fig.subplots()
    for key, label in (("committed_per_step", "tokens per step (committed)"),
                       ("accepted_per_step", "accepted drafts per step"),
                       ("rejected_per_step", "rejected drafts per step")):
        ax.plot(x, [r[key] for r in rows], marker=".", label=label)
    ax.set(xlabel="confidence threshold", ylabel="tokens per step", title=title)
    ax.grid(alpha=0.3)
    rate_ax = ax.twinx()  # rates live on [0, 1], counts on [0, gamma + 1]
    rate_ax.plot(x, [r["acceptance_rate"] for r in rows], "k--", label="acceptance rate")
    rate_ax.set(ylim=(0, 1.02), ylabel="acceptance rate")
    handles, labels = ax.get_legend_handles_labels()
    rate_handles, rate_labels = rate_ax.get_legend_handles_labels()
    # Below the axes: inside, it would cover one of the four curves wherever it went.
    ax.legend(handles + rate_handles, labels + rate_labels, fontsize=8, ncol=2,
              loc="upper center", bbox_to_anchor=(0.5, -0.18))
    return _save(fig, path)


def tau_bar_plot(table: dict[str, dict[str, float | None]], path: str | os.PathLike,
                 title: str = "Accepted length tau by dataset") -> Path:
    """Grouped bars: datasets on x, one bar per drafter (like the paper's Table 1 as a chart).

    Args:
        table: drafter name -> {dataset name -> value (e.g. tau incl. bonus)}. Datasets are
            ordered by first appearance; a drafter missing a dataset, or whose value is None
            (unmeasured: no round drafted), leaves a gap.
        path: output PNG file.
        title: figure title.
    Returns:
        The written path.
    Raises:
        ValueError: `table` is empty or has no datasets.
    Source: DSpark paper Table 1; SPEC 7.
    """
    datasets = list(dict.fromkeys(d for row in table.values() for d in row))
    if not table or not datasets:
        raise ValueError("table is empty: need drafter -> {dataset -> value}")
    group_width = 0.8
    bar_width = group_width / len(table)
    fig = _new_figure(max(5.0, 0.9 * len(datasets) + 2), 3.5)
    ax = fig.subplots()
    for i, (drafter, row) in enumerate(table.items()):
        offset = -group_width / 2 + (i + 0.5) * bar_width
        # a dataset missing or unmeasured (None: no round drafted) leaves a gap
        kept = [(j, row[d]) for j, d in enumerate(datasets) if row.get(d) is not None]
        ax.bar([j + offset for j, _ in kept], [v for _, v in kept], width=bar_width,
               label=drafter)
    ax.set_xticks(range(len(datasets)), datasets, rotation=30, ha="right")
    ax.set(ylabel="tau (tokens per round)", title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
