"""``grid="auto"``'s first-step memory estimates against the memory model's count and the measured peak.

For each candidate grid (stages x ways x chunks a way) of 2 processes: the estimate ``grid="auto"`` makes before
any step under a memory budget (:func:`pyg_pipe.engine.plan.memory_fit.first_step_estimate`, read from the
choice's report), then the grid run for one Adam step with ``recompute=True``: the memory model's counted peak
after it (:func:`pyg_pipe.engine.plan.memory_cost.predict`, replaying) and the step's measured net peak
(:class:`pyg_pipe.memory.PeakMemory`, the resident set on a CPU), per rank. 16-layer GCNII, hidden 64, 20,000
vertices, as ``benchmarks/speed/gnnpipe_epoch.py`` builds it.

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/memory/grid_memory.py --out docs/results/grid_memory.json
"""
import argparse
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

GRIDS = [(1, 2, 1), (2, 1, 1), (2, 1, 4)]


def worker(rank, world, graph, path):
    import torch
    import torch.nn.functional as F

    from benchmarks.speed.gnnpipe_epoch import build
    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, sync_module_state
    from pyg_pipe.engine.plan.memory_cost import predict
    from pyg_pipe.memory import PeakMemory

    ns = argparse.Namespace(graph=graph, nodes=20000, degree=10.0, features=64, classes=8, model="gcnii", layers=16,
                            hidden=64)
    data, model0 = build(ns)
    comm = Comm(torch.device("cpu"))

    def step(m, opt):
        out = m(data.x, data.adj_t)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()

    def engine(**kw):
        m = copy.deepcopy(model0)
        sync_module_state(m, {}, [0])
        e = GNNPipeEngine(m, PipelineConfig(**kw.pop("config")), comm, **kw)
        e.install()
        return m, e, torch.optim.Adam(m.parameters(), lr=0.01)

    m, e, opt = engine(config=dict(grid="auto", memory_budget=1 << 34))
    step(m, opt)
    e.uninstall()
    report = comm.all_gather_objects(e.grid_report, "the report")[0]
    rows = []
    for S, W, k in GRIDS:
        m, e, opt = engine(config=dict(num_chunks=W * k, recompute=True, balance="layers"), num_stages=S, ways=W)
        pm = PeakMemory().start()
        step(m, opt)
        measured = comm.all_gather_objects(pm.net_bytes(), "the peaks")
        counted = comm.all_gather_objects(predict(e.runtime, m.parameters(), [opt]).peak(True), "the counts")
        e.uninstall()
        rows.append({"grid": [S, W, k], "estimate_mb": report.peaks[(S, W, k)] / 2**20,
                     "counted_mb": [c / 2**20 for c in counted], "measured_mb": [c / 2**20 for c in measured]})
    if rank == 0:
        with open(path, "w") as f:
            json.dump(rows, f)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", nargs="+", default=["community", "random"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from tests.dist import run_distributed
    results = {}
    for graph in args.graphs:
        path = f"/tmp/grid_memory_{graph}.json"
        run_distributed(worker, 2, graph, path, timeout=900)
        results[graph] = json.load(open(path))
        for r in results[graph]:
            print(f"{graph:>9} {'x'.join(map(str, r['grid'][:2]))}, {r['grid'][2]} chunk(s) a way: estimate "
                  f"{r['estimate_mb']:.0f} MB, counted {' / '.join(f'{c:.0f}' for c in r['counted_mb'])} MB "
                  f"(estimate / largest {r['estimate_mb'] / max(r['counted_mb']):.2f}), measured "
                  f"{' / '.join(f'{c:.0f}' for c in r['measured_mb'])} MB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
