"""`strata profile show`: tokens seen, skew, per-layer entropy, and a layer x expert heatmap.

Skew at x %: the share of a layer's routings that go to its top x % of experts (rounded up to
whole experts), averaged over layers; uniform routing gives x %. Entropy is in bits per layer;
uniform routing over E experts gives log2(E).
"""
import logging
import math

import numpy as np

log = logging.getLogger(__name__)

SKEW_SHARES = (0.10, 0.25, 0.50)


def summarize(profile, phase="all"):
    counts = profile.counts(phase).astype(np.float64)  # [L, E]
    totals = counts.sum(axis=1, keepdims=True)  # [L, 1]
    shares = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)  # [L, E]
    ranked = -np.sort(-shares, axis=1)  # [L, E], each layer descending
    used = totals[:, 0] > 0
    skew = {}
    for share in SKEW_SHARES:
        top = max(1, math.ceil(share * profile.num_experts))
        skew[share] = float(ranked[used, :top].sum(axis=1).mean()) if used.any() else 0.0
    logs = np.log2(shares, out=np.zeros_like(shares), where=shares > 0)
    entropy = -(shares * logs).sum(axis=1)  # [L]
    return {"model_id": profile.model_id, "num_layers": profile.num_layers, "num_experts": profile.num_experts,
            "num_experts_per_tok": profile.num_experts_per_tok, "phase": phase,
            "tokens_prefill": profile.tokens_prefill, "tokens_decode": profile.tokens_decode,
            "routings": int(counts.sum()), "skew": skew, "entropy_bits": entropy.tolist(),
            "max_entropy_bits": math.log2(profile.num_experts), "sources": profile.sources}


def format_summary(summary):
    lines = [f"model      {summary['model_id']}  ({summary['num_layers']} layers x {summary['num_experts']} experts, "
             f"top-{summary['num_experts_per_tok']})",
             f"tokens     {summary['tokens_prefill']} prefill, {summary['tokens_decode']} decode "
             f"({summary['routings']} {summary['phase']} routings)",
             "skew       " + ", ".join(f"top {share:.0%} of experts: {value:.1%}"
                                      for share, value in summary["skew"].items()),
             f"entropy    bits per layer (uniform = {summary['max_entropy_bits']:.2f}):"]
    entropy = summary["entropy_bits"]
    for start in range(0, len(entropy), 8):
        lines.append(f"  {start:3d}-{min(start + 8, len(entropy)) - 1:3d}  "
                     + " ".join(f"{value:5.2f}" for value in entropy[start:start + 8]))
    if summary["sources"]:
        lines.append(f"sources    {', '.join(summary['sources'])}")
    return "\n".join(lines)


def write_heatmap(profile, path, phase="all"):
    """Writes a PNG of each layer's routing shares; False (with a log message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'strata[plot]'): no heatmap written")
        return False
    counts = profile.counts(phase).astype(np.float64)  # [L, E]
    totals = counts.sum(axis=1, keepdims=True)
    shares = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    fig, ax = plt.subplots(figsize=(min(4 + profile.num_experts / 8, 24), min(2 + profile.num_layers / 4, 16)))
    image = ax.imshow(shares, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(f"{profile.model_id}: share of each layer's {phase} routings")
    fig.colorbar(image, ax=ax, label="share")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return True
