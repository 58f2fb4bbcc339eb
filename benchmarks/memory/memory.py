"""Peak memory per process against single-process PyG, side by side in one run.

For each process count P (default 2 and 4) it runs, each in fresh processes, one after the other:
plain PyG in one process (P threads, its fastest path: a torch.sparse CSR adjacency with ``cached=True``),
``strategy="graph_parallel"`` on P processes, ``strategy="gnnpipe"`` on P processes for every chunk
count with ``recompute`` off, on, and on with the history on the ``disk`` tier, and (P >= 4) a hybrid
grid of 2 stages x P/2 ways. Each gnnpipe / graph_parallel process has one thread. Then, on one
process (``--stream``), NGra streaming (``devices=1``: the model layer group by layer group over the
chunks, exact) with every buffer on the device, in memory-mapped files, and in files beyond a budget
of a quarter of single-process PyG's peak.

Memory = peak resident set size of a process over the whole run net of what it held after imports and
graph generation (the data, which every setup pays alike); the worst process counts. Every process runs
with ``MALLOC_MMAP_THRESHOLD_=131072``: glibc then maps every block above 128 KiB on its own and hands it
back when freed, so the resident size follows the live tensors (as ``torch.cuda.max_memory_allocated``
does on a GPU) instead of what the allocator kept from earlier phases; ``--default-malloc`` turns this
off. Time = median step time over the second half of the epochs. The workers are those of
``benchmarks/speed/gnnpipe_epoch.py``.

    python benchmarks/memory/memory.py                                   # 20k vertices, 16 layers (about 15 min)
    python benchmarks/memory/memory.py --nodes 5000 --layers 8 --chunks 4 --procs 2 --epochs 3   # a quick look
    python benchmarks/memory/memory.py --out docs/results/memory_community_16.json

Ratios printed: net peak ÷ single process, and epoch time ÷ single process and ÷ graph_parallel; and the
largest difference of a step's loss from single-process PyG's (exact modes — graph_parallel, streaming —
stay near 1e-6; gnnpipe's historical embeddings move it by design).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmarks.speed import gnnpipe_epoch as ge  # noqa: E402  (the workers)


def _med(ts):
    return statistics.median(ts[len(ts) // 2:])


def _pipe(args, tmp, name, **extra):
    path = os.path.join(tmp, name)
    ge.launch(args, "pipe", json=path, **extra)
    ranks = [json.load(open(f"{path}.rank{r}")) for r in range(args.procs)]
    return {"epoch_s": _med(ranks[0]["times"]),
            "net_mb": [r["peak_mb"] - r["base_mb"] for r in ranks],
            "peak_mb": [r["peak_mb"] for r in ranks],
            "bytes": ranks[0]["comm"].get("total", 0), "losses": ranks[-1]["losses"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph", choices=["community", "random"], default="community")
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--degree", type=float, default=20.0)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    p.add_argument("--snapshot-period", dest="snapshot_period", type=int, default=23)
    p.add_argument("--offload", nargs="*", default=["disk"], help="offload tiers to run with recompute on")
    p.add_argument("--recompute-off", dest="recompute_off", nargs="*", type=int, default=None,
                   help="chunk counts also run with recompute off (default: all)")
    p.add_argument("--stream", nargs="*", type=int, default=[8, 16], help="chunk counts streamed on one process")
    p.add_argument("--default-malloc", dest="default_malloc", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not args.default_malloc:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # inherited by every worker (module docstring)
    procs_list = args.procs
    results = {"setting": {k: getattr(args, k) for k in ("graph", "nodes", "degree", "features", "classes",
                                                         "layers", "hidden", "epochs", "snapshot_period")},
               "runs": []}
    lines = []
    for P in procs_list:
        args.procs, args.threads_single = P, P
        single = json.loads(ge.launch(args, "single").stdout.strip().splitlines()[-1])
        s_net, s_t = single["peak_mb"] - single["base_mb"], _med(single["times"])
        with tempfile.TemporaryDirectory() as tmp:
            gp = _pipe(args, tmp, "gp", chunks=P, strategy="graph_parallel")
            rows = [("graph_parallel", P, None, gp)]
            for c in args.chunks:
                if c < P:
                    continue
                for rc in ("off", "on"):
                    if rc == "off" and args.recompute_off is not None and c not in args.recompute_off:
                        continue
                    rows.append(("gnnpipe", c, rc, _pipe(args, tmp, f"c{c}{rc}", chunks=c, recompute=rc)))
                for tier in args.offload:
                    rows.append((f"gnnpipe {tier}", c, "on", _pipe(args, tmp, f"c{c}{tier}", chunks=c, recompute="on",
                                                                   offload=tier)))
                if P >= 4 and c % (P // 2) == 0:
                    rows.append((f"hybrid 2x{P // 2}", c, "on", _pipe(args, tmp, f"h{c}", chunks=c, recompute="on",
                                                                     strategy="hybrid")))
        if P == procs_list[0] and args.stream:  # one process streaming, against the same single-process run
            procs, args.procs = args.procs, 1
            with tempfile.TemporaryDirectory() as tmp:
                for c in args.stream:
                    rows.append(("stream", c, "-", _pipe(args, tmp, f"s{c}", chunks=c)))
                    rows.append(("stream disk", c, "-", _pipe(args, tmp, f"s{c}d", chunks=c, offload="disk")))
                    budget = int(s_net * 2**20 / 4)
                    rows.append((f"stream disk {budget >> 20}MB", c, "-",
                                 _pipe(args, tmp, f"s{c}b", chunks=c, offload="disk", offload_budget=budget)))
            args.procs = procs
        lines.append(f"\nP = {P}: single process ({P} threads): net peak {s_net:.0f} MB, epoch {s_t:.3f} s")
        lines.append(f"{'mode':>15} {'chunks':>6} {'recompute':>9} {'net MB (worst)':>14} {'÷ single':>8} "
                     f"{'per rank ÷ single':>22} {'epoch s':>8} {'÷ single':>8} {'÷ gp':>6} {'loss − single':>13}")
        for mode, c, rc, r in rows:
            worst = max(r["net_mb"])
            per = " ".join(f"{m / s_net:.2f}" for m in r["net_mb"])
            r["loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"], single["losses"]))  # every step's loss
            lines.append(f"{mode:>15} {c:>6} {rc or '-':>9} {worst:>14.0f} {worst / s_net:>8.2f} {per:>22} "
                         f"{r['epoch_s']:>8.3f} {r['epoch_s'] / s_t:>8.2f} {r['epoch_s'] / gp['epoch_s']:>6.2f} "
                         f"{r['loss_diff']:>13.1e}")
            results["runs"].append({"procs": P, "mode": mode, "chunks": c, "recompute": rc, **r,
                                    "single_net_mb": s_net, "single_epoch_s": s_t, "single_losses": single["losses"],
                                    "net_ratio": worst / s_net, "time_ratio": r["epoch_s"] / s_t,
                                    "time_vs_gp": r["epoch_s"] / gp["epoch_s"]})
        print("\n".join(lines[-len(rows) - 2:]), flush=True)
    print(f"\nsetting: {results['setting']}")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
