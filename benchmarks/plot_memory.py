"""Draws docs/img/memory.png from the JSON written by memory.py (needs matplotlib).

    python benchmarks/plot_memory.py docs/results/memory_community_16.json

One panel per process count: the worst process's net peak ÷ single-process PyG for every mode and
chunk count, the per-rank values as dots, and step time ÷ single process as text above each bar.
Green bars are NGra streaming on one process (all on the device, on disk, on disk beyond a budget).
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path):
    r = json.load(open(path))
    procs = sorted({run["procs"] for run in r["runs"]})
    fig, axes = plt.subplots(1, len(procs), figsize=(7.5 * len(procs), 4.4), squeeze=False)
    for ax, P in zip(axes[0], procs):
        runs = [run for run in r["runs"] if run["procs"] == P]
        labels, worst, per_rank, times = [], [], [], []
        for run in runs:
            if run["mode"] == "graph_parallel":
                label = "graph\nparallel"
            elif run["mode"].startswith("stream"):  # one process: "stream", "stream disk", "stream disk 81MB"
                tier = run["mode"].split(" ")[1:]
                label = f"1 proc\n{tier[-1] if tier else 'stream'}\n{run['chunks']} ch"
            else:
                name = {"gnnpipe": "pipe"}.get(run["mode"], run["mode"].replace("gnnpipe ", "").split(" ")[0])
                label = f"{name}{'' if run['recompute'] in (None, 'off') else '+rc'}\n{run['chunks']} ch"
            labels.append(label)
            worst.append(run["net_ratio"])
            per_rank.append([m / run["single_net_mb"] for m in run["net_mb"]])
            times.append(run["time_ratio"])
        xs = range(len(runs))
        bars = ax.bar(xs, worst, color=["tab:grey" if "graph" in lab else "tab:green" if "1 proc" in lab
                                        else "tab:blue" for lab in labels])
        for x, ranks in zip(xs, per_rank):
            ax.plot([x] * len(ranks), ranks, "k.", ms=4)
        for bar, t in zip(bars, times):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.02, f"{t:.2f}x t", ha="center",
                    fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(0.55, color="tab:red", lw=1, ls="--", label="target 0.55 (all on the device)")
        ax.axhline(0.3, color="tab:orange", lw=1, ls=":", label="target 0.3 (offloaded)")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_title(f"{P} processes: peak per process ÷ one process (dots: each rank)", fontsize=9)
        ax.legend(fontsize=7)
    s = r["setting"]
    fig.suptitle(f"{s['layers']}-layer GCNII, {s['nodes']:,} vertices ({s['graph']}), hidden {s['hidden']}; "
                 f"bar labels: step time ÷ one process (under MALLOC_MMAP_THRESHOLD_, see memory.md)", fontsize=9)
    fig.tight_layout()
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img", "memory.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1])
