"""Training steps through the engine in one process: time per step and peak memory.

A 16-layer GCNII (hidden 32) on a 3,000-vertex community graph, one stage, 8 chunks (history, hooks,
halo joins and the drain all in play, no communication), Adam, one thread. Prints the median step time
after two warm-up steps, the peak resident memory of the process, and the final loss (to compare two
versions of the engine: the same loss means the same computation). Run it in two checkouts, in turn::

    git worktree add /tmp/before <commit>
    cp benchmarks/speed/engine_steps.py /tmp/before/benchmarks/
    for i in 1 2 3; do (cd /tmp/before && python benchmarks/speed/engine_steps.py); python benchmarks/speed/engine_steps.py; done
"""
import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nodes", type=int, default=3000)
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
    from pyg_pipe.graph import sbm_graph
    from pyg_pipe.models import gcnii

    torch.set_num_threads(1)
    data = sbm_graph(args.nodes, num_classes=4, avg_degree=8, num_features=16, seed=0)
    torch.manual_seed(0)
    model = gcnii(16, 32, 4, num_layers=16, dropout=0.0)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=args.chunks, balance="layers", streaming=False),
                           Comm(torch.device("cpu")), num_stages=1, ways=1)
    engine.install()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = model(data.x, data.edge_index)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    engine.uninstall()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"step {1e3 * statistics.median(times[2:]):.1f} ms (median of {len(times) - 2}), peak {peak:.0f} MiB, "
          f"final loss {float(loss.detach()):.10f}")


if __name__ == "__main__":
    main()
