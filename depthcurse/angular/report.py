"""`angular-distance` results as figures and on screen: the heatmap, the per-layer panels, the table."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from depthcurse.angular.result import MASSIVE_MAGNITUDE, MASSIVE_RATIO, AngularResult
from depthcurse.io import save_figure


def plot_angular(result: AngularResult, path: Path, *, normalize: bool = True, title: str | None = None) -> Path:
    """Heatmap of d(x_l, x_{l+n}): x = l, y = n; cells with l+n > L masked; l* of each row marked."""
    import matplotlib  # lazy: only figures need matplotlib (1 s to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    L, max_n = result.num_layers, result.max_n
    grid = np.array([[np.nan if v is None else v for v in row] for row in result.matrix()], dtype=float)
    shown = grid.copy()
    if normalize:
        for i, row in enumerate(grid):
            lo, hi = np.nanmin(row), np.nanmax(row)
            shown[i] = (row - lo) / (hi - lo) if hi > lo else np.where(np.isnan(row), np.nan, 0.0)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#e6e6e6")
    fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * L + 3), max(4.5, 0.22 * max_n + 2.5)), dpi=120)
    im = ax.imshow(np.ma.masked_invalid(shown), origin="lower", aspect="auto", cmap=cmap,
                   extent=(-0.5, L - 0.5, 0.5, max_n + 0.5), interpolation="nearest")
    best = result.best_blocks()
    ax.scatter([b["l"] for b in best], [b["n"] for b in best], marker="x", s=18, c="red", lw=1.2, label="l* = argmin over l")
    ax.set_xlabel("l, first block of the pruned run (stream x_l)")
    ax.set_ylabel("n, number of blocks skipped")
    ax.set_xlim(-0.5, L - 0.5)
    ax.set_ylim(0.5, max_n + 0.5)
    run = result.run or {}
    where = "last non-pad token" if result.position == "last" else "all non-pad tokens"
    ax.set_title(title or f"{run.get('model', 'model')}: angular distance d(x_l, x_l+n)\n{where}, {result.samples} samples, data {run.get('data', '?')}", fontsize=10)
    bar = fig.colorbar(im, ax=ax)
    bar.set_label("d, min-max normalised per row (n)" if normalize else "d = arccos(cos)/pi")
    ax.legend(loc="upper right", fontsize=8, framealpha=0.8)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_layers(result: AngularResult, path: Path, *, title: str | None = None) -> Path:
    """Six panels by depth: Block Influence, relative update size, residual norm, variance (all
    channels, and the bulk without each token's largest few), the largest activation with its
    channel, and each block's identity distance with its branches' gains."""
    import matplotlib  # lazy: only figures need matplotlib (1 s to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = result.num_layers
    blocks, depths = list(range(L)), list(range(L + 1))
    depth_label = "depth l (L = after last block, before final norm)"
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), dpi=110)
    panels = [
        (axes[0, 0], [(blocks, result.block_influence, None)], "Block Influence 1 - cos(x_l, x_l+1)", "block l", False),
        (axes[0, 1], [(blocks, result.relative_update, None)], "relative update |x_l+1 - x_l| / |x_l|", "block l", False),
        (axes[0, 2], [(depths, result.norm, None)], "mean L2 norm of x_l", depth_label, True),
        (axes[1, 0], [(depths, result.variance, "all channels"), (depths, result.variance_bulk, "without each token's 4 largest")],
         "mean per-token variance of x_l", depth_label, True),
        (axes[1, 1], [(depths, result.max_activation, "largest |activation| (its channel)"),
                      (depths, (result.massive() or {}).get("ratio"), "largest / median |activation|")],
         f"largest |activation| in x_l; massive: > {MASSIVE_MAGNITUDE:g} and > {MASSIVE_RATIO:g}x the median", depth_label, True),
    ]
    ident = result.identity or {}
    gains = [(blocks, ident.get(k), label) for k, label in
             (("identity_distance", "block: E|Jv - v| / |v|"), ("attn_gain", "attention: E|J_attn v| / |v|"), ("mlp_gain", "MLP: E|J_mlp v| / |v|"))]
    panels.append((axes[1, 2], gains, f"distance from the identity ({ident.get('probes', 0)} probes, {ident.get('tokens', 0)} tokens)", "block l", True))
    for ax, lines, label, xlabel, log in panels:
        drawn = [(xs, ys, name) for xs, ys, name in lines if ys]
        for xs, ys, name in drawn:
            ax.plot(xs[: len(ys)], ys, marker="o", ms=3, lw=1.3, label=name)
        if not drawn:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel(xlabel, fontsize=9)
        if log and drawn and all(min(ys) > 0 for _, ys, _ in drawn):
            ax.set_yscale("log")
        if any(name for _, _, name in drawn):
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if result.max_activation and result.max_channel:  # say where the channel of the largest activation changes
        previous = None
        for l, (value, channel) in enumerate(zip(result.max_activation, result.max_channel)):
            if channel != previous:
                axes[1, 1].annotate(str(channel), (l, value), fontsize=7, xytext=(2, 4), textcoords="offset points")
            previous = channel
    run = result.run or {}
    fig.suptitle(title or f"{run.get('model', 'model')}: per-layer statistics over {result.stat_tokens} tokens ({run.get('data', '?')})", fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path)


def angular_table(result: AngularResult) -> Table:
    """Best block per n: the run of n blocks whose input and output streams are closest."""
    run = result.run or {}
    table = Table(title=f"{run.get('model', 'model')} · most redundant run of n blocks (l* = argmin_l d(x_l, x_l+n))", header_style="bold")
    for col in ("n", "l*", "blocks", "d(x_l*, x_l*+n)"):
        table.add_column(col, justify="right")
    for b in result.best_blocks():
        table.add_row(str(b["n"]), str(b["l"]), b["layers"], f"{b['distance']:.4f}")
    return table


def massive_summary(result: AngularResult) -> str:
    """One line on the stream's massive activation (Sun et al. 2024): where it first is, the block
    that writes it, its channel and token, its size against the median, and every block that writes one."""
    m = result.massive()
    if m is None:
        return "massive activations: not measured (a result written before they were)"
    if m["first_depth"] is None:
        ratio = [r for r in m["ratio"] if r != float("inf")]
        peak = max(range(len(ratio)), key=ratio.__getitem__) if ratio else 0
        return (f"no massive activation ({m['definition']}): the largest is {result.max_activation[peak]:.4g}, "
                f"{ratio[peak] if ratio else float('nan'):,.0f} x the median, in x_{peak}")
    by = f"block {m['written_by']}" if m["written_by"] is not None else "the embedding"
    token = f"token {m['token_text']!r} (id {m['token']})" if m.get("token_text") else f"token id {m['token']}"
    first = m["first_depth"]
    return (f"massive activation ({m['definition']}): first in x_{first}, written by {by}: channel {m['channel']}, {token} at position "
            f"{m['position']}, |x| = {m['value']:,.4g}, {m['ratio'][first]:,.0f} x the median {m['median']:.3g}; "
            f"blocks that write one: {', '.join(map(str, m['writers'])) or 'none'}")
