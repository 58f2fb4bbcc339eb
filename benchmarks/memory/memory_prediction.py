"""The memory model checked: each process's predicted peak against its measured peak, over a grid of plans.

For every setting (graph, model, processes) and every plan (chunks, recompute off / on) it runs a real
Lightning fit (the workers of ``benchmarks/speed/gnnpipe_epoch.py``, one thread a process) and reads
``strategy.memory_check``: the peak the first step predicted for the step on each rank
(:mod:`pyg_pipe.engine.plan.memory_cost`), against the fit's measured peak on that rank
(:class:`pyg_pipe.memory.PeakMemory`: the resident-set high-water mark from the strategy's start, net of
what the process held then; every process runs with ``MALLOC_MMAP_THRESHOLD_=131072`` so that the resident
size follows the live tensors, as ``benchmarks/memory/memory.py`` does).

The prediction of the *other* setting of ``recompute`` is checked too: what a run replaying predicted for
keeping, against the measured peak of the run that keeps, and the other way round.

``--budget``: a third fit per plan, ``recompute="auto"`` with ``memory_budget`` 1 MB below the smallest
counted peak of keeping the keeping run predicted (structures, history, gradients, optimizer state,
activations, the drain's working set): the rank with that peak (and any other above the budget) must
replay from the second step; its measured peak is printed against the keeping and replaying runs'.

    python benchmarks/memory/memory_prediction.py                                  # the grid (about 15 min)
    python benchmarks/memory/memory_prediction.py --graphs community --models gcnii --procs 2 --chunks 4
    python benchmarks/memory/memory_prediction.py --out docs/results/memory_prediction.json
    python benchmarks/memory/memory_prediction.py --budget --graphs community --chunks 4 --out F

Prints, per run and rank, measured ÷ predicted; the target is within 15 % (0.85 - 1.15).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmarks.speed import gnnpipe_epoch as ge  # noqa: E402  (the workers)

MB = 2 ** 20


def run(args, tmp: str, name: str, **extra) -> list:
    """One fit; per rank: ``(measured, predicted, predicted keep, predicted replay)`` bytes and the parts."""
    path = os.path.join(tmp, name)
    ge.launch(args, "pipe", json=path, **extra)
    check = json.load(open(f"{path}.rank0"))["memory_check"]
    if not check:
        raise RuntimeError(f"{name}: no memory check (streaming, or the fit did not finish)")
    return check["ranks"]


def counted_keep(rank: dict) -> int:
    """The counted part of a keeping run's predicted peak (what ``memory_budget`` is set against)."""
    return sum(rank[k] for k in ("resident_bytes", "state_bytes", "activation_bytes", "transient_bytes"))


def budget_run(args, tmp: str, name: str, got: dict, setting: dict) -> dict:
    """``recompute="auto"`` under a budget 1 MB below the smallest counted keeping peak (``--budget``)."""
    keeping = got["off"]
    budget = min(counted_keep(r) for r in keeping) - MB
    ranks = run(args, tmp, name, chunks=setting["chunks"], recompute="auto", **{"memory-budget": budget})
    out = dict(setting, budget=budget, ranks=[])
    for r, (mine, kept, replayed) in enumerate(zip(ranks, keeping, got["on"])):
        over = counted_keep(kept) > budget
        row = dict(rank=r, counted_keep=counted_keep(kept), replays=mine["recompute"], should_replay=over,
                   measured=mine["measured_peak_bytes"], measured_keeping=kept["measured_peak_bytes"],
                   measured_replaying=replayed["measured_peak_bytes"])
        out["ranks"].append(row)
        print(f"  budget {budget / MB:.0f} MB, rank {r}: counted keeping peak {row['counted_keep'] / MB:.0f} MB -> "
              f"{'replays' if row['replays'] else 'keeps'} ({'right' if row['replays'] == over else 'WRONG'}); "
              f"measured peak {row['measured'] / MB:.0f} MB (keeping {row['measured_keeping'] / MB:.0f}, "
              f"replaying {row['measured_replaying'] / MB:.0f})", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", nargs="+", choices=["community", "random"], default=["community", "random"])
    p.add_argument("--models", nargs="+", choices=["gcnii", "resgcn", "gcn"], default=["gcnii", "resgcn"])
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8], help="chunks in all (counts below the "
                   "processes are skipped)")
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--budget", action="store_true", help="also a recompute='auto' fit under a memory_budget "
                   "keeping does not fit (module docstring)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # inherited by every worker (module docstring)
    args.degree, args.features, args.classes, args.threads_single = 20.0, 64, 8, 1
    args.snapshot_period, args.input, args.fused_kernels, args.history_dtype = 23, "adj_t", 1, "none"
    args.trace, args.device = "", "cpu"
    rows, budgets, procs = [], [], args.procs
    print(f"{'graph':>9} {'model':>6} {'P':>2} {'chunks':>6} {'recompute':>9} {'rank':>4} {'measured MB':>11} "
          f"{'predicted':>9} {'ratio':>6} {'other mode: measured / predicted':>32}")
    for graph in args.graphs:
        for model in args.models:
            for P in procs:
                args.graph, args.model, args.procs = graph, model, P
                with tempfile.TemporaryDirectory() as tmp:
                    for c in args.chunks:
                        if c < P:
                            continue
                        got = {rc: run(args, tmp, f"{graph}{model}{P}{c}{rc}", chunks=c, recompute=rc)
                               for rc in ("off", "on")}
                        for rc, ranks in got.items():
                            other = got["on" if rc == "off" else "off"]
                            for r, (mine, theirs) in enumerate(zip(ranks, other)):
                                m, pr = mine["measured_peak_bytes"], mine["predicted_peak_bytes"]
                                # what this run predicted for the other setting, against that run's measure
                                alt = mine["replay_peak_bytes" if rc == "off" else "keep_peak_bytes"]
                                row = dict(graph=graph, model=model, procs=P, chunks=c, recompute=rc, rank=r,
                                           measured=m, predicted=pr, ratio=m / pr,
                                           other_measured=theirs["measured_peak_bytes"], other_predicted=alt,
                                           other_ratio=theirs["measured_peak_bytes"] / alt,
                                           parts={k: v for k, v in mine.items() if k.endswith("_bytes")})
                                rows.append(row)
                                print(f"{graph:>9} {model:>6} {P:>2} {c:>6} {rc:>9} {r:>4} {m / MB:>11.0f} "
                                      f"{pr / MB:>9.0f} {m / pr:>6.2f} {row['other_measured'] / MB:>14.0f} / "
                                      f"{alt / MB:.0f} ({row['other_ratio']:.2f})", flush=True)
                        if args.budget:
                            budgets.append(budget_run(args, tmp, f"{graph}{model}{P}{c}budget", got,
                                                      dict(graph=graph, model=model, procs=P, chunks=c)))
    within = sum(0.85 <= r["ratio"] <= 1.15 for r in rows)
    within_other = sum(0.85 <= r["other_ratio"] <= 1.15 for r in rows)
    print(f"\nwithin 15 %: {within} of {len(rows)} (this run's setting), {within_other} of {len(rows)} (the other "
          f"setting, predicted from this run)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"setting": {k: getattr(args, k) for k in ("nodes", "layers", "hidden", "epochs")},
                       "runs": rows, "budget_runs": budgets}, f, indent=1)


if __name__ == "__main__":
    main()
