"""Many settings of ``gnnpipe_epoch.py`` on a machine with many cores, each on cores of its own.

On the 2-core development machine four processes share two cores, so a 4- or 8-process row measures
oversubscription as much as the modes (docs/benchmarks.md). On a machine with more physical cores this
driver runs the settings side by side, each pinned (CPU affinity) to as many *physical* cores as it has
processes (one logical CPU per core, hyperthread siblings left idle), so every process of a setting has
a core to itself, and no two settings share one. Within a setting the rows compare as before (gnnpipe,
graph_parallel, one process with as many threads as the setting has processes, and with the fused kernels,
one after the other in fresh processes); settings running at the same time share the memory bandwidth
and the last-level cache, so compare ratios within a setting, not times across settings.

    python benchmarks/speed/speed_sweep.py --out docs/results/sweep --budget 420 --trace \\
        --jobs gcnii:community:4:16:0 gcnii:community:8:32:0 gcn:community:4:16:0 ...

A job is ``model:graph:procs:chunks:bandwidth`` (bandwidth in bytes/s for the simulated link, 0: none).
Jobs start largest first while cores are free; none starts after ``--budget`` seconds, and the summary
lists what ran. ``OUT/all.json`` holds every job's results and output, and with ``--trace`` each rank's
compute, wait and bubble per step (the strategies log only the largest over the ranks). Linux only
(CPU affinity, ``/sys`` topology).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def physical_cpus() -> list:
    """One logical CPU per physical core, among those this process may use (Linux's CPU topology)."""
    seen, cpus = set(), []
    for cpu in sorted(os.sched_getaffinity(0)):
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            core = tuple(open(f"{topo}/{f}").read().strip() for f in ("physical_package_id", "core_id"))
        except OSError:  # no topology: every logical CPU counts as a core
            core = ("", str(cpu))
        if core not in seen:
            seen.add(core)
            cpus.append(cpu)
    return cpus


def job_name(job: str) -> str:
    return job.replace(":", "_").replace(".", "p")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", nargs="+", required=True, help="model:graph:procs:chunks:bandwidth")
    p.add_argument("--out", required=True, help="folder for the summary and all.json (every job's results)")
    p.add_argument("--work", default=None, help="folder for each job's own files (default: OUT/jobs); on a lent "
                   "machine put it outside OUT, so that only OUT's few files travel back")
    p.add_argument("--trace", action="store_true", help="gnnpipe runs write a Chrome trace; all.json gets each "
                   "rank's compute / wait / bubble per step from it")
    p.add_argument("--budget", type=float, default=420.0, help="seconds after which no job starts")
    p.add_argument("--nodes", type=int, default=20000)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--spare", type=int, default=0, help="physical cores left free (for other work)")
    args = p.parse_args()
    work = args.work or os.path.join(args.out, "jobs")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    cpus = physical_cpus()
    free = cpus[args.spare:]
    print(f"{len(cpus)} physical cores; {len(free)} for the jobs", flush=True)
    jobs = sorted(args.jobs, key=lambda j: -int(j.split(":")[2]))
    too_big = [j for j in jobs if int(j.split(":")[2]) > len(free)]
    if too_big:
        print(f"not run (more processes than the {len(free)} free cores): {' '.join(too_big)}", flush=True)
    jobs = [j for j in jobs if j not in too_big]
    running, t0, done, skipped = [], time.time(), [], []
    while jobs or running:
        for proc, cores, job, log in list(running):
            if proc.poll() is not None:
                running.remove((proc, cores, job, log))
                free += cores
                log.close()
                done.append((job, proc.returncode, time.time() - t0))
                print(f"[{time.time() - t0:6.0f} s] done {job} (rc {proc.returncode})", flush=True)
        while jobs and time.time() - t0 < args.budget:
            fit = next((j for j in jobs if int(j.split(":")[2]) <= len(free)), None)
            if fit is None:
                break
            jobs.remove(fit)
            model, graph, procs, chunks, bw = fit.split(":")
            cores, free = free[:int(procs)], free[int(procs):]
            name = job_name(fit)
            cmd = [sys.executable, os.path.join(HERE, "gnnpipe_epoch.py"),
                   "--model", model, "--graph", graph, "--procs", procs, "--chunks", chunks,
                   "--threads-single", procs, "--bandwidth", bw, "--nodes", str(args.nodes),
                   "--layers", str(args.layers), "--epochs", str(args.epochs),
                   "--out", os.path.join(work, f"{name}.json")]
            if args.trace:
                cmd += ["--trace", os.path.join(work, f"{name}.trace.json")]
            log = open(os.path.join(work, f"{name}.txt"), "w")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=lambda cores=tuple(cores): os.sched_setaffinity(0, cores))
            running.append((proc, cores, fit, log))
            print(f"[{time.time() - t0:6.0f} s] start {fit} on cores {cores}", flush=True)
        if jobs and time.time() - t0 >= args.budget and not running:
            skipped, jobs = jobs, []
        time.sleep(0.5)
    summary(work, done, skipped)
    bundle(work, [job for job, _, _ in done], os.path.join(args.out, "all.json"))


def bundle(work: str, jobs: list, path: str) -> None:
    """Every job's results, output and (with traces) per-rank timeline in one file (few files to bring back
    from a lent machine)."""
    everything = {}
    for job in jobs:
        name = job_name(job)
        entry = {}
        for key, file in (("result", f"{name}.json"), ("output", f"{name}.txt"), ("ranks", f"{name}.trace.json")):
            full = os.path.join(work, file)
            if not os.path.exists(full):
                continue
            with open(full) as f:
                entry[key] = per_rank(json.load(f)) if key == "ranks" else json.load(f) if key == "result" \
                    else f.read()
        everything[job] = entry
    with open(path, "w") as f:
        json.dump(everything, f)


def per_rank(trace: dict) -> dict:
    """Seconds per step on each rank, from a ``timeline_trace``: ``compute`` (the chunks' spans less their
    waits), ``wait``, ``bubble``, and the bubble at the end of the fill (``output``: waiting for the last
    stage's output), the averages over the traced steps."""
    ranks: dict = {}
    for e in trace.get("traceEvents", []):
        r = ranks.setdefault(e["pid"], {"compute": 0.0, "wait": 0.0, "bubble": 0.0, "output": 0.0, "steps": set()})
        r["steps"].add(e["args"]["step"])
        seconds = e["dur"] / 1e6
        if e["tid"] == 1:
            r[e["name"]] += seconds
            r["compute"] -= seconds
            if e["args"]["chunk"] == -1:
                r["output"] += seconds
        else:
            r["compute"] += seconds
    return {str(rank): {k: v / max(len(r["steps"]), 1) for k, v in r.items() if k != "steps"}
            for rank, r in sorted(ranks.items())}


def summary(folder: str, done: list, skipped: list) -> None:
    """The table of ratios (printed), from each job's JSON in ``folder``."""
    from pyg_pipe.engine.runtime.timeline import bubble_share
    print("\nmodel    graph      P  C   link   gnnpipe s  gp s    ÷gp   ÷1proc ÷1proc+k  net÷1proc net÷gp  bubble(formula)"
          "  imbalance  split")
    for job, rc, _ in done:
        path = os.path.join(folder, f"{job_name(job)}.json")
        if rc != 0 or not os.path.exists(path):
            print(f"{job}: failed (rc {rc}), see {job_name(job)}.txt")
            continue
        r = json.load(open(path))
        model, graph, procs, chunks, bw = job.split(":")
        row = r["rows"][0]
        gp = r["graph_parallel_summary"]
        tl = r.get(f"timeline_c{chunks}", {})
        link = "loop" if float(bw) == 0 else f"{float(bw) / 1e6:.0f}MB/s"
        print(f"{model:8s} {graph:10s} {procs:>2s} {chunks:>3s} {link:>7s} {row['epoch_s']:9.3f} {gp['epoch_s']:6.3f} "
              f"{row['epoch_s'] / gp['epoch_s']:6.2f} {row['time_ratio']:7.2f} {row['time_ratio_single_kernels']:8.2f} "
              f"{row['net_ratio']:9.2f} {row['net_mb'] / max(gp['net_mb'], 1e-9):7.2f}  "
              f"{tl.get('bubble_share', float('nan')):.3f} ({bubble_share(int(procs), int(chunks)):.3f})  "
              f"{tl.get('stage_imbalance', float('nan')):9.2f}  {r[f'gnnpipe_c{chunks}'][0].get('sizes')}")
    if skipped:
        print(f"not started (budget): {' '.join(skipped)}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    main()
