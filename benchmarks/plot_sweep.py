"""Draws docs/img/sweep.png from the summary ``speed_sweep.py`` prints (its ``sweep.txt``; needs matplotlib).

    python benchmarks/plot_sweep.py docs/results/cores/sweep.txt

One pair of bars per setting: gnnpipe's epoch time divided by graph_parallel's and by one process's (with
as many threads as the setting has processes), each measured side by side within the setting.
"""
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODELS = {"gcn": "GCN", "gcnii": "GCNII", "resgcn": "ResGCN+"}


def rows(path):
    """``(label, ÷ graph_parallel, ÷ one process, bubble share, formula)`` per summary line."""
    out = []
    for line in open(path):
        f = line.split()
        if len(f) >= 14 and f[0] in MODELS and f[2].isdigit():
            label = f"{MODELS[f[0]]}\n{f[1]}, P={f[2]}\n{'loopback' if f[4] == 'loop' else f[4]}"
            out.append((label, float(f[7]), float(f[8]), float(f[12]), float(f[13].strip("()"))))
    return out


def main(path):
    data = rows(path)
    fig, ax = plt.subplots(figsize=(9, 3.8))
    xs = range(len(data))
    ax.bar([x - 0.2 for x in xs], [d[1] for d in data], 0.4, label="gnnpipe ÷ graph_parallel")
    ax.bar([x + 0.2 for x in xs], [d[2] for d in data], 0.4, label="gnnpipe ÷ one process (P threads)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(0.7, color="grey", lw=0.8, ls="--")
    ax.set_xticks(list(xs), [d[0] for d in data], fontsize=7)
    ax.set_ylabel("epoch time ratio")
    ax.set_title("32 layers, 20,000 vertices, 4 chunks per stage; each process on a core of its own (16 cores)",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img", "sweep.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1])
