"""Draws the accuracy-per-epoch picture of ``convergence.py --out`` (needs matplotlib).

    python benchmarks/plot_convergence.py docs/results/convergence.json docs/img/convergence.png

One panel per (model, graph, chunks): test accuracy per epoch, the mean over the seeds, one line per mode
(one process in black), the drift the meter measured in a second row.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path, out):
    res = json.load(open(path))
    runs = res["runs"]
    panels = sorted({(r["model"], r["graph"], r["chunks"]) for r in runs if r["mode"] != "one process"})
    modes = [m for m in res["setting"]["modes"]]
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 6), squeeze=False, sharex=True)
    for j, (model, graph, chunks) in enumerate(panels):
        ax, ax_d = axes[0][j], axes[1][j]
        for mode in ["one process"] + modes:
            sel = [r for r in runs if (r["model"], r["graph"], r["mode"]) == (model, graph, mode)
                   and (mode == "one process" or r["chunks"] == chunks)]
            if not sel:
                continue
            n = min(len(r["curve"]) for r in sel)
            acc = [sum(r["curve"][i]["test"] for r in sel) / len(sel) for i in range(n)]
            style = dict(color="black", lw=2) if mode == "one process" else dict(lw=1.2)
            ax.plot(range(1, n + 1), acc, label=mode, **style)
            if mode != "one process":
                drift = [max(r["curve"][i].get("drift", 0.0) for r in sel) for i in range(n)]
                ax_d.plot(range(1, n + 1), drift, label=mode, lw=1.2)
        ax.set_title(f"{model}, {graph}, {chunks} chunks", fontsize=10)
        ax.set_ylabel("test accuracy")
        ax_d.set_ylabel("max drift (meter)")
        ax_d.set_xlabel("epoch")
        ax_d.set_yscale("log")
        ax.grid(alpha=0.3)
        ax_d.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
