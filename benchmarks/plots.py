"""Every figure of docs/img/, drawn from the JSON (or text) a benchmark wrote (needs matplotlib, which pyg_pipe
does not depend on). One function per figure; from the command line, the figure's name, then its inputs:

    python benchmarks/plots.py epoch docs/results/gnnpipe_epoch_community.json docs/results/gnnpipe_epoch_random.json
    python benchmarks/plots.py comm docs/results/comm_study.json docs/img/comm_study.png
    python benchmarks/plots.py convergence docs/results/convergence.json docs/img/convergence.png
    python benchmarks/plots.py memory docs/results/memory_community_16.json
    python benchmarks/plots.py memory_ab BEFORE.json AFTER.json docs/img/memory_2026-11-26.png
    python benchmarks/plots.py memory_prediction docs/results/memory_prediction.json docs/img/memory_prediction.png
    python benchmarks/plots.py speed docs/results/speed_p2_bw0.json docs/results/speed_p2_bw1e8.json ...
    python benchmarks/plots.py sweep docs/results/cores/sweep.txt
    python benchmarks/plots.py timeline docs/results/timeline_p4.json
    python benchmarks/plots.py gpu docs/results/gpu/summary.json
    python benchmarks/plots.py auto_chunks docs/img/auto_chunks.png GRID.json[:CHECK.json] ...
    python benchmarks/plots.py zoo docs/img/zoo_accuracy.png docs/results/zoo_accuracy_2.json docs/results/zoo_accuracy_8.json
    python benchmarks/plots.py copies docs/results/copies_adj_t_a126eda.json docs/results/copies_adj_t.json
"""
import json
import os
import statistics
import sys


import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


# --------------------------------------------------------------------------------------------
# epoch: Draws docs/img/gnnpipe_epoch.png from the JSON written by gnnpipe_epoch.py (needs matplotlib).
# --------------------------------------------------------------------------------------------

def epoch(paths):
    """Draws docs/img/gnnpipe_epoch.png from the JSON written by gnnpipe_epoch.py (needs matplotlib).

    python benchmarks/plots.py epoch docs/results/gnnpipe_epoch_community.json docs/results/gnnpipe_epoch_random.json
    """
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


# --------------------------------------------------------------------------------------------
# comm: Bar chart of the communication study (needs matplotlib, not a dependency of pyg_pipe).
# --------------------------------------------------------------------------------------------

MODES = ("graph_parallel", "hybrid", "gnnpipe")


COLORS = {"graph_parallel": "#c44e52", "hybrid": "#dd8452", "gnnpipe": "#4c72b0"}


def comm(src: str, dst: str) -> None:
    """Bar chart of the communication study (needs matplotlib, not a dependency of pyg_pipe).

    python benchmarks/plots.py comm docs/results/comm_study.json docs/img/comm_study.png
    """
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


# --------------------------------------------------------------------------------------------
# convergence: Draws the accuracy-per-epoch picture of ``convergence.py --out`` (needs matplotlib).
# --------------------------------------------------------------------------------------------

def convergence(path, out):
    """Draws the accuracy-per-epoch picture of ``convergence.py --out`` (needs matplotlib).

        python benchmarks/plots.py convergence docs/results/convergence.json docs/img/convergence.png

    One panel per (model, graph, chunks): test accuracy per epoch, the mean over the seeds, one line per mode
    (one process in black), the drift the meter measured in a second row.
    """
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


# --------------------------------------------------------------------------------------------
# memory: Draws docs/img/memory.png from the JSON written by memory.py (needs matplotlib).
# --------------------------------------------------------------------------------------------

def memory(path):
    """Draws docs/img/memory.png from the JSON written by memory.py (needs matplotlib).

        python benchmarks/plots.py memory docs/results/memory_community_16.json
    python benchmarks/plots.py memory_ab BEFORE.json AFTER.json docs/img/memory_2026-11-26.png
    python benchmarks/plots.py memory_prediction docs/results/memory_prediction.json docs/img/memory_prediction.png

    One panel per process count: the worst process's net peak ÷ single-process PyG for every mode and
    chunk count, the per-rank values as dots, and step time ÷ single process as text above each bar.
    Green bars are NGra streaming on one process (all on the device, on disk, on disk beyond a budget).
    """
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


def memory_ab(before, after, out):
    """Draws a before/after figure from two JSON files written by memory.py with the same command.

        python benchmarks/plots.py memory_ab docs/results/memory_2026-11-26/before_7583b9a.json \
            docs/results/memory_2026-11-26/after.json docs/img/memory_2026-11-26.png

    Paired bars per (mode, chunks, recompute) of the first process count: the worst process's net peak ÷
    single-process PyG, before (grey) and after (blue), with the value above each bar.
    """
    runs = [json.load(open(p))["runs"] for p in (before, after)]
    P = runs[0][0]["procs"]
    key = lambda r: (r["mode"], r["chunks"], r["recompute"])  # noqa: E731
    old = {key(r): r for r in runs[0] if r["procs"] == P}
    new = [r for r in runs[1] if r["procs"] == P and key(r) in old]
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    for i, r in enumerate(new):
        for dx, val, color in ((-0.2, old[key(r)]["net_ratio"], "tab:grey"), (0.2, r["net_ratio"], "tab:blue")):
            ax.bar(i + dx, val, width=0.4, color=color)
            ax.text(i + dx, val + 0.02, f"{val:.2f}", ha="center", fontsize=7)
    labels = [("graph\nparallel" if r["mode"] == "graph_parallel" else
               f"gnnpipe{'' if r['recompute'] in (None, 'off') else ' +rc'}\n{r['chunks']} chunks") for r in new]
    ax.set_xticks(range(len(new)), labels, fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    from matplotlib.patches import Patch

    line = ax.axhline(0.55, color="tab:red", lw=1, ls="--", label="target 0.55")
    ax.legend(handles=[Patch(color="tab:grey", label=os.path.basename(before)),
                       Patch(color="tab:blue", label=os.path.basename(after)), line], fontsize=7)
    s = json.load(open(after))["setting"]
    ax.set_title(f"net peak per process ÷ one process, {P} processes; {s['layers']}-layer GCNII, {s['nodes']:,} "
                 f"vertices ({s['graph']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


def memory_prediction(path, out):
    """Draws the memory model's check from the JSON written by ``memory_prediction.py``: every rank's measured
    peak against its predicted one, for the run's own setting of ``recompute`` (filled) and for the other
    setting predicted from the same run (open), with the ±15 % band of the target.

        python benchmarks/plots.py memory_prediction docs/results/memory_prediction.json docs/img/memory_prediction.png
    """
    runs = json.load(open(path))["runs"]
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    MB = 2 ** 20
    colors = {("community", 2): "tab:blue", ("community", 4): "tab:cyan", ("random", 2): "tab:red",
              ("random", 4): "tab:orange"}
    for key, color in colors.items():
        mine = [r for r in runs if (r["graph"], r["procs"]) == key]
        if not mine:
            continue
        ax.scatter([r["predicted"] / MB for r in mine], [r["measured"] / MB for r in mine], s=14, color=color,
                   label=f"{key[0]} graph, {key[1]} processes")
        ax.scatter([r["other_predicted"] / MB for r in mine], [r["other_measured"] / MB for r in mine], s=22,
                   facecolors="none", edgecolors=color)
    lo = min(min(r["predicted"], r["measured"]) for r in runs) / MB * 0.9
    hi = max(max(r["predicted"], r["measured"]) for r in runs) / MB * 1.1
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.12,
                    label="within 15 %")
    ax.set_xlabel("predicted peak after the first step (MB)")
    ax.set_ylabel("measured peak of the fit (MB)")
    ax.set_title("each rank; filled: the run's own recompute setting,\nopen: the other setting, predicted from "
                 "the same run", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


def auto_chunks(args):
    """Draws ``num_chunks="auto"``'s choice against measured grids of chunk counts: per setting, the epoch ÷
    graph_parallel's for every count of the grid (``gnnpipe_epoch.py --chunks 2 4 8 16 auto``), the count the
    current model chose circled. ``OUT`` first, then ``GRID.json`` or ``GRID.json:CHECK.json`` (the choice from a
    later ``--chunks auto`` run, where the grid's own ``auto`` ran an older model):

        R=docs/results/auto_chunks
        python benchmarks/plots.py auto_chunks docs/img/auto_chunks.png \
            $R/gcnii_20k_2procs.json:$R/check_training_pass_gcnii_20k_2procs_community.json \
            $R/resgcn_20k_2procs.json:$R/check_training_pass_resgcn_20k_2procs_community.json \
            $R/gcnii_20k_2procs_random.json:$R/check_training_pass_gcnii_20k_2procs_random.json \
            $R/resgcn_20k_2procs_random.json \
            $R/gcnii_20k_4procs.json:$R/check_shared_cores_gcnii_20k_4procs_community.json $R/resgcn_20k_4procs.json \
            $R/gcnii_20k_4procs_random.json:$R/check_shared_cores_gcnii_20k_4procs_random.json \
            $R/resgcn_20k_4procs_random.json
    """
    out, specs = args[0], args[1:]
    fig, axes = plt.subplots(2, (len(specs) + 1) // 2, figsize=(2.6 * ((len(specs) + 1) // 2), 5.2), sharey=True)
    for ax, spec in zip(axes.flat, specs):
        grid_path, _, check_path = spec.partition(":")
        grid = json.load(open(grid_path))
        gp = grid["graph_parallel_summary"]["epoch_s"]
        counts = [(r["chunks"], r["epoch_s"] / gp) for r in grid["rows"] if isinstance(r["chunks"], int)]
        auto = [r for r in grid["rows"] if str(r["chunks"]).startswith("auto:")]
        chosen = int(str(auto[0]["chunks"]).split(":")[1]) if auto else None
        if check_path:
            chosen = json.load(open(check_path))["gnnpipe_cauto"][0]["plan_check"]["num_chunks"]
        xs, ys = zip(*counts)
        ax.plot(xs, ys, "o-", color="tab:blue", ms=4)
        for x, y in counts:
            if x == chosen:
                ax.scatter([x], [y], s=160, facecolors="none", edgecolors="tab:red", lw=1.6, zorder=3)
        best = min(ys)
        ax.axhspan(best, best * 1.1, color="tab:green", alpha=0.12)
        ax.axhline(1.0, color="grey", lw=0.7, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs], fontsize=7)
        st = grid["setting"]
        ax.set_title(f"{st['model']}, {st['graph']}, {st['procs']} processes", fontsize=8)
        ax.set_xlabel("chunks", fontsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel("epoch ÷ graph_parallel", fontsize=8)
    fig.suptitle("num_chunks='auto': the grid (blue), within 10 % of its fastest (green), the choice (red)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


# --------------------------------------------------------------------------------------------
# speed: Draws docs/img/speed.png from the JSON files written by ``gnnpipe_epoch.py --out`` (needs matplotlib).
# --------------------------------------------------------------------------------------------

def _med(ts):
    return statistics.median(ts[len(ts) // 2:])


def speed(paths):
    """Draws docs/img/speed.png from the JSON files written by ``gnnpipe_epoch.py --out`` (needs matplotlib).

        python benchmarks/plots.py speed docs/results/speed_p2_bw0.json docs/results/speed_p2_bw1e8.json \
            docs/results/speed_p4_bw0.json docs/results/speed_p4_bw1e8.json

    One group of bars per file (processes, link): epoch time of plain PyG in one process, the same with
    pyg_pipe's fused kernels, graph_parallel and gnnpipe, each the median of the second half of its epochs.
    """
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


# --------------------------------------------------------------------------------------------
# sweep: Draws docs/img/sweep.png from the summary ``speed_sweep.py`` prints (its ``sweep.txt``; needs matplotlib).
# --------------------------------------------------------------------------------------------

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


def sweep(path):
    """Draws docs/img/sweep.png from the summary ``speed_sweep.py`` prints (its ``sweep.txt``; needs matplotlib).

        python benchmarks/plots.py sweep docs/results/cores/sweep.txt

    One pair of bars per setting: gnnpipe's epoch time divided by graph_parallel's and by one process's (with
    as many threads as the setting has processes), each measured side by side within the setting.
    """
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


# --------------------------------------------------------------------------------------------
# timeline: Draws docs/img/timeline.png from a Chrome trace written by ``timeline_trace=`` (needs matplotlib).
# --------------------------------------------------------------------------------------------

def timeline(path):
    """Draws docs/img/timeline.png from a Chrome trace written by ``timeline_trace=`` (needs matplotlib).

        python benchmarks/speed/gnnpipe_epoch.py --nodes 20000 --layers 16 --procs 4 --chunks 16 --epochs 4 \
            --trace docs/results/timeline_p4.json
        python benchmarks/plots.py timeline docs/results/timeline_p4.json

    One row per rank (stage), the last step's chunks: fill in blue, drain in orange, and over them the
    time each chunk waited (grey; the bubble darker), drawn where the chunk started. The fill ends with the
    "output" span: every rank receives the last stage's output rows.
    """
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


# --------------------------------------------------------------------------------------------
# gpu: Draws docs/img/gpu_capture.png from the summary.json benchmarks/gpu/gpu_summary.py wrote.
# --------------------------------------------------------------------------------------------

def gpu(path):
    """Draws docs/img/gpu_capture.png: one GPU's training step at 20k and 200k vertices (16-layer GCNII,
    4 chunks streamed), plain PyG against the engine uncaptured and captured as CUDA graphs, replaying each
    chunk's forward in the backward or keeping its activations (where the summary has both).

        python benchmarks/plots.py gpu docs/results/gpu/summary.json
    """
    summary = json.load(open(path))
    sizes = [k for k in ("detail_20k", "detail_200k") if k in summary]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    # (summaries before the fifth GPU run name the capture keeping activations "kept_inside_capture_s" and the
    # one replaying them "stream_s"; later ones "stream_s" and "replayed_in_capture_s")
    old = all("kept_inside_capture_s" in summary[k] for k in sizes)
    bars = [("plain PyG", "plain_s"), ("streamed, uncaptured", "uncaptured_s"),
            ("captured, forward replayed in the backward", "stream_s" if old else "replayed_in_capture_s"),
            ("captured, activations kept (the default)", "kept_inside_capture_s" if old else "stream_s")]
    bars = [b for b in bars if all(b[1] in summary[k] for k in sizes)]
    w = 0.8 / len(bars)
    for i, (label, key) in enumerate(bars):
        xs = [j + (i - (len(bars) - 1) / 2) * w for j in range(len(sizes))]
        ms = [summary[k][key] * 1e3 for k in sizes]
        ax.bar(xs, ms, w, label=label)
        for x, v in zip(xs, ms):
            ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(sizes)), [f"{summary[k]['nodes'] // 1000}k vertices" for k in sizes])
    ax.set_ylabel("ms per training step")
    ax.set_title(f"{summary['device']}, {summary['model']}, 4 chunks", fontsize=8)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.35)
    ax.legend(fontsize=7, ncols=2, loc="upper center")
    fig.tight_layout()
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img", "gpu_capture.png")
    fig.savefig(out, dpi=110)
    print(out)


def zoo(args):
    """Draws what chunks cost each PyG conv class (``zoo_accuracy.py``'s JSON, one file per chunk count): the
    test accuracy's difference to one process in points, a bar per layer and count, sorted by the last file's.

        python benchmarks/plots.py zoo OUT.png RESULT.json ...
    """
    out, paths = args[0], args[1:]
    runs = []
    for path in paths:
        d = json.load(open(path))
        for c in d["setting"]["chunks"]:
            deltas = {name: 100 * (statistics.mean(r[str(c)]) - statistics.mean(r["one"]))
                      for name, r in d["results"].items() if not isinstance(r[str(c)], str)}
            runs.append((f"{c} chunks", deltas))
    names = sorted(runs[-1][1], key=lambda n: runs[-1][1][n])
    fig, ax = plt.subplots(figsize=(6.5, 0.16 * len(names) + 1.2))
    h = 0.8 / len(runs)
    for i, (label, deltas) in enumerate(runs):
        ys = [j + (i - (len(runs) - 1) / 2) * h for j in range(len(names))]
        ax.barh(ys, [deltas.get(n, 0.0) for n in names], h, label=label)
    ax.axvline(0, color="black", lw=0.6)
    for x in (-1, 1):
        ax.axvline(x, color="grey", lw=0.5, ls=":")
    ax.set_yticks(range(len(names)), names, fontsize=6)
    ax.set_xlabel("test accuracy, points against one process (mean over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


def zoo_causes(args):
    """Why a conv class loses accuracy with chunks: each layer's loss at C chunks (``zoo_accuracy.py``) against the
    size of the gradient error chunks make (``zoo_gradients.py``: lin_in's, the farthest from the output) and against
    what random gradient noise costs it without chunks (``zoo_gradients.py --noise``), with Pearson's r.

        python benchmarks/plots.py zoo_causes OUT.png ACCURACY.json GRADIENTS.json NOISE.json [CHUNKS [NOISE_REL]]
    """
    out, acc_path, grad_path, noise_path = args[:4]
    c = args[4] if len(args) > 4 else "8"
    rel = str(float(args[5])) if len(args) > 5 else "0.01"
    acc = json.load(open(acc_path))["results"]
    grads = json.load(open(grad_path))["results"]
    noise = json.load(open(noise_path))["results"]

    def delta(r, key, base):
        return 100 * (statistics.mean(r[key]) - statistics.mean(r[base]))

    def pearson(xs, ys):
        mx, my = statistics.mean(xs), statistics.mean(ys)
        cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
        return cov / ((sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys)) ** 0.5)

    names = [n for n, r in acc.items() if not isinstance(r.get(c), str)]
    loss = {n: delta(acc[n], c, "one") for n in names}
    panels = [([n for n in names if n in grads and isinstance(grads[n].get(c), dict)],
               lambda n: grads[n][c]["lin_in"], f"relative error of lin_in's gradient, {c} chunks"),
              ([n for n in names if n in noise],
               lambda n: delta(noise[n], rel, "0.0"), f"test accuracy with {rel} gradient noise, points against none "
                                                       f"(one process)")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, (keep, x_of, label) in zip(axes, panels):
        xs, ys = [x_of(n) for n in keep], [loss[n] for n in keep]
        ax.scatter(xs, ys, s=12)
        for n, x, y in zip(keep, xs, ys):
            if y < -4 or x_of(n) < -8:
                ax.annotate(n, (x, y), fontsize=6, xytext=(3, -3), textcoords="offset points")
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xlabel(label)
        ax.set_title(f"r = {pearson(xs, ys):+.2f} over {len(keep)} layers", fontsize=9)
    axes[0].set_ylabel(f"test accuracy at {c} chunks, points against one process")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


def grid_choice(path, out="docs/img/grid_choice.png"):
    """Draws ``grid="auto"``'s check from the JSON of ``grid_choice.py --out``: per setting, every candidate grid's
    measured step against its predicted one, the choice and the fastest marked (needs matplotlib)."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = json.load(open(path))["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(3.0 * len(results), 3.4), sharey=False)
    for ax, res in zip(axes, results):
        rows = res["rows"]
        fastest = min(rows, key=lambda r: r["measured_s"])
        for r in rows:
            S, W, k = r["grid"]
            chosen = r["grid"] == res["chosen"]
            ax.scatter(r["predicted_s"] * 1e3, r["measured_s"] * 1e3, s=40 if chosen else 14,
                       c="C3" if chosen else ("C2" if r is fastest else "C0"), zorder=3)
            ax.annotate(f"{S}x{W},{W * k}", (r["predicted_s"] * 1e3, r["measured_s"] * 1e3), fontsize=6,
                        xytext=(3, 2), textcoords="offset points")
        hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.1
        ax.plot([0, hi], [0, hi], color="black", lw=0.5)
        link = "loopback" if not res["bandwidth"] else f"{res['bandwidth'] / 1e6:.0f} MB/s"
        ax.set_title(f"{res['model']}, {res['graph']}\n{res['procs']} procs, {link}", fontsize=8)
        ax.set_xlabel("predicted step, ms", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("measured step, ms (red: chosen, green: fastest)", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


def copies(before, after, out="docs/img/copies.png"):
    """Draws the row copies of one training step by the line that made them, before and after, from two JSON files
    of ``copies.py --out`` (streaming and history side by side; needs matplotlib).

    python benchmarks/plots.py copies docs/results/copies_adj_t_a126eda.json docs/results/copies_adj_t.json
    """
    runs = [(os.path.basename(path).replace(".json", ""), {r["mode"]: r for r in json.load(open(path))})
            for path in (before, after)]
    modes = list(runs[0][1])
    fig, axes = plt.subplots(1, len(modes), figsize=(6.2 * len(modes), 3.6))
    for ax, mode in zip(axes, modes):
        def by_function(counts):  # (line numbers move between commits; the function a copy is made in stays)
            out = {}
            for site, n in counts.items():
                op, where = site.split(" ", 1)
                key = f"{op} {where.split(':')[0]} {where.split(' ', 1)[-1] if '(' in where else ''}".strip()
                out[key] = out.get(key, 0) + n
            return out
        runs_mode = [(label, by_function(by_mode[mode]["sites"]), by_mode[mode]) for label, by_mode in runs]
        sites = {}
        for _, got, _ in runs_mode:
            for site, n in got.items():
                sites[site] = max(sites.get(site, 0), n)
        top = [site for site, _ in sorted(sites.items(), key=lambda kv: -kv[1])[:7]]
        for i, (label, got, res) in enumerate(runs_mode):
            left = 0
            for j, site in enumerate(top + ["other"]):
                n = got.get(site, 0) if site != "other" else sum(v for k, v in got.items() if k not in top)
                ax.barh(i, n, left=left, color=f"C{j}", label=site if i == 0 else None)
                left += n
            ax.text(left + 4, i, f"{left} ({res['memcpys_per_step']} block)", va="center", fontsize=7)
        ax.set_yticks(range(len(runs)), [label for label, _ in runs], fontsize=7)
        ax.set_xlabel("row copies per training step", fontsize=8)
        ax.set_title(f"{mode}: 16-layer GCNII, {runs[0][1][mode]['chunks']} chunks, one process", fontsize=8)
        ax.set_xlim(0, max(sum(r[mode]["sites"].values()) for _, r in runs) * 1.25)
        ax.legend(fontsize=5.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


#: figure name -> (function, whether it takes a list of inputs)
FIGURES = {"epoch": (epoch, True), "comm": (comm, False), "convergence": (convergence, False), "memory": (memory, False),
           "memory_ab": (memory_ab, False), "memory_prediction": (memory_prediction, False), "speed": (speed, True), "sweep": (sweep, False), "timeline": (timeline, False),
           "gpu": (gpu, False), "auto_chunks": (auto_chunks, True), "zoo": (zoo, True),
           "zoo_causes": (zoo_causes, True), "grid_choice": (grid_choice, False), "copies": (copies, False)}

if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in FIGURES:
        sys.exit(f"usage: python benchmarks/plots.py {{{'|'.join(FIGURES)}}} INPUT... (see the module docstring)")
    fn, many = FIGURES[sys.argv[1]]
    fn(sys.argv[2:]) if many else fn(*sys.argv[2:])
