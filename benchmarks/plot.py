"""Draws docs/img/gnnpipe_epoch.png from the JSON written by gnnpipe_epoch.py (needs matplotlib).

    python benchmarks/plot.py docs/results/gnnpipe_epoch_community.json docs/results/gnnpipe_epoch_random.json
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(paths):
    results = [json.load(open(p)) for p in paths]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        rows = r["rows"]
        xs = [j + i * width for j in range(len(rows))]
        label = f"{r['setting']['graph']} graph"
        axes[0].bar(xs, [row["time_ratio"] for row in rows], width, label=label)
        axes[1].bar(xs, [row["mem_ratio"] for row in rows], width, label=label)
    for ax, title, target in ((axes[0], "epoch time ÷ single process", 1.25),
                              (axes[1], "peak memory per process ÷ single process", 0.7)):
        ticks = [j + width * (len(results) - 1) / 2 for j in range(len(results[0]["rows"]))]
        ax.set_xticks(ticks, [f"{row['chunks']} chunk{'s' if row['chunks'] > 1 else ''}" for row in results[0]["rows"]])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(target, color="tab:red", lw=1, ls="--", label=f"target {target}")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    s = results[0]["setting"]
    fig.suptitle(f"gnnpipe, {s['procs']} processes × 1 thread vs PyG, 1 process × {s['threads_single']} threads: "
                 f"{s['layers']}-layer GCNII, {s['nodes']:,} vertices", fontsize=10)
    fig.tight_layout()
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img", "gnnpipe_epoch.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1:])
