"""Draws docs/img/timeline.png from a Chrome trace written by ``timeline_trace=`` (needs matplotlib).

    python benchmarks/gnnpipe_epoch.py --nodes 20000 --layers 16 --procs 4 --chunks 16 --epochs 4 \\
        --trace docs/results/timeline_p4.json
    python benchmarks/plot_timeline.py docs/results/timeline_p4.json

One row per rank (stage), the last step's chunks: fill in blue, drain in orange, and over them the
time each chunk waited (grey; the bubble darker), drawn where the chunk started. The fill ends with the
"output" span: every rank receives the last stage's output rows.
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path):
    events = json.load(open(path))["traceEvents"]
    last = max(e["args"]["step"] for e in events)
    events = [e for e in events if e["args"]["step"] == last]
    t0 = min(e["ts"] for e in events)
    ranks = sorted({e["pid"] for e in events})
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.7 * len(ranks)))
    colors = {"fill": "tab:blue", "drain": "tab:orange", "wait": "lightgrey", "bubble": "dimgrey"}
    for e in events:
        y = ranks.index(e["pid"])
        start, width = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
        kind = e["name"] if e["tid"] == 1 else e["cat"]
        h, off = (0.8, 0.1) if e["tid"] == 0 else (0.3, 0.35)
        ax.broken_barh([(start, width)], (y + off, h), facecolors=colors[kind], edgecolor="white", linewidth=0.3,
                       zorder=3 if e["tid"] == 1 else 2)
    ax.set_yticks([r + 0.5 for r in range(len(ranks))], [f"stage {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms (last step)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, ["fill (forward) chunk", "drain (backward) chunk", "wait for a transfer", "bubble"],
              fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=4, frameon=False)
    ax.set_title(f"{len(ranks)} stages, {len([e for e in events if e['tid'] == 0 and e['pid'] == ranks[0]]) // 2} "
                 f"chunks: one training step per stage", fontsize=9, loc="left")
    fig.tight_layout()
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img", "timeline.png")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(out)


if __name__ == "__main__":
    main(sys.argv[1])
