"""Draws docs/img/speed.png from the JSON files written by ``gnnpipe_epoch.py --out`` (needs matplotlib).

    python benchmarks/plot_speed.py docs/results/speed_p2_bw0.json docs/results/speed_p2_bw1e8.json \\
        docs/results/speed_p4_bw0.json docs/results/speed_p4_bw1e8.json

One group of bars per file (processes, link): epoch time of plain PyG in one process, the same with
pyg_pipe's fused kernels, graph_parallel and gnnpipe, each the median of the second half of its epochs.
"""
import json
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _med(ts):
    return statistics.median(ts[len(ts) // 2:])


def main(paths):
    runs = [(os.path.basename(p), json.load(open(p))) for p in paths]
    names = ["plain PyG, 1 process", "plain PyG + kernels", "graph_parallel", "gnnpipe"]
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs, ys = [], []
        for i, (_, r) in enumerate(runs):
            y = {0: lambda: _med(r["single"]["times"]), 1: lambda: _med(r["single_kernels"]["times"]),
                 2: lambda: r["graph_parallel_summary"]["epoch_s"], 3: lambda: r["rows"][0]["epoch_s"]}[k]()
            xs.append(i + k * width)
            ys.append(y)
        ax.bar(xs, ys, width, label=name)
    labels = []
    for path, r in runs:
        link = "loopback" if "bw0" in path else "100 MB/s link"
        labels.append(f"{r['setting']['procs']} processes, {r['rows'][0]['chunks']} chunks\n{link}")
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(runs))], labels, fontsize=8)
    ax.set_ylabel("epoch time (s)")
    s = runs[0][1]["setting"]
    ax.set_title(f"{s['layers']}-layer GCNII, {s['nodes']:,} vertices ({s['graph']}); 2 cores", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img", "speed.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1:])
