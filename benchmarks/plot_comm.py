"""Bar chart of the communication study (needs matplotlib, not a dependency of pyg_pipe).

    python benchmarks/plot_comm.py docs/results/comm_study.json docs/img/comm_study.png
"""
from __future__ import annotations

import json
import sys

MODES = ("graph_parallel", "hybrid", "gnnpipe")
COLORS = {"graph_parallel": "#c44e52", "hybrid": "#dd8452", "gnnpipe": "#4c72b0"}


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.load(open(src))["rows"]
    panels = sorted({(r["graph"], r["procs"]) for r in rows}, key=lambda k: (k[0] != "flickr", k[0], k[1]))
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), sharey=True, squeeze=False)
    for ax, (graph, procs) in zip(axes[0], panels):
        width = 0.8 / len(MODES)
        for i, mode in enumerate(MODES):
            xs, ys, fs = [], [], []
            for j, model in enumerate(models):
                r = next((r for r in rows if (r["graph"], r["procs"], r["model"], r["mode"]) ==
                          (graph, procs, model, mode)), None)
                if r is None:
                    continue
                xs.append(j + (i - 1) * width)
                ys.append(r["comm"]["total"] / 2**30)
                fs.append(r["formula"]["total"] / 2**30)
            ax.bar(xs, ys, width, color=COLORS[mode], label=mode.replace("_", " "))
            ax.scatter(xs, fs, marker="_", color="black", s=120, zorder=3,
                       label="formula" if i == len(MODES) - 1 else None)
        ax.set_yscale("log")
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models)
        ax.set_title(f"{graph}, {procs} processes")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("GiB per epoch (all ranks)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    fig.suptitle("Bytes per epoch, 32-layer models, hidden 100 (bars: measured; ticks: formula)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
