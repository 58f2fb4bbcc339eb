"""What a gnnpipe stage holds, by kind: the bytes of every tensor the engine keeps between steps.

One process runs the chunked engine (one stage, ``streaming=False``, recomputation on) for two training
steps on the graph and model of ``benchmarks/memory/memory.py`` (16-layer GCNII, 20k-vertex community graph),
then walks the runtime's objects and adds up the bytes of the tensors they reach, each storage once:

- graph structures: the chunked graphs (renumbered edges, every chunk's local graph, the
  one-chunk-per-way chunking, transposes);
- per-layer caches: local adjacencies, cached normalisations, layer decisions;
- history: buffers of the rows other chunks read, T2 snapshots, pending gradients;

against ``|V|·d`` (one hidden value of the whole graph) and plain PyG's net peak in the same process
(the model trained on the whole graph first), and the peak of each step net of what the process held
when it began (run it with ``MALLOC_MMAP_THRESHOLD_=131072`` as memory.py does). A pipeline stage with ``L/S`` of the layers holds ``1/S``
of the per-layer kinds and all of the graph structures.

    python benchmarks/memory/memory_breakdown.py                   # 20k vertices, 16 layers, 8 chunks
    python benchmarks/memory/memory_breakdown.py --chunks 16 --graph random
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph", choices=["community", "random"], default="community")
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--degree", type=float, default=20.0)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--snapshot-period", dest="snapshot_period", type=int, default=23)
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    from benchmarks.speed import gnnpipe_epoch as ge
    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
    from pyg_pipe.engine.plan.memory_cost import reachable

    torch.set_num_threads(1)
    args.epochs, args.procs, args.threads_single, args.model = 2, 1, 1, "gcnii"
    data, model = ge.build(args)
    plain = copy.deepcopy(model)

    from pyg_pipe.memory import PeakMemory

    def step(m, opt):
        out = m(data.x, data.adj_t)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()

    peaks = {}
    popt = torch.optim.Adam(plain.parameters(), lr=0.01)
    for i in range(2):
        pm = PeakMemory().start()
        step(plain, popt)
        peaks[f"plain PyG, step {i + 1}"] = pm.net_bytes()
    del popt
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=args.chunks, recompute=True, streaming=False,
                                                 balance="layers", snapshot_period=args.snapshot_period),
                           Comm(torch.device("cpu")), num_stages=1)
    engine.install()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for i in range(3):
        pm = PeakMemory().start()
        step(model, opt)
        peaks[f"engine, step {i + 1}" + (" (plan, exact pass filling history)" if i == 0 else "")] = pm.net_bytes()
    rt = engine.runtime
    user = [data.x, data.adj_t, data.y, data.train_mask, data.edge_index] + list(plain.parameters())
    inputs = reachable(user)  # the user's data: shared storages are not the engine's
    kinds = {
        "graph structures (chunked graphs, local graphs, way chunking, transposes)":
            [rt.chunked, rt._way_chunked, rt._derived],
        "per-layer caches (local adjacencies, normalisations, layer decisions)": [rt.layer_cache, rt.adjacency],
        "history (buffers, snapshots, pending gradients)": [rt.history],
    }
    counted = dict(inputs)
    vd = data.num_nodes * args.hidden * 4
    held = rt.history.rows.numel() if getattr(rt.history, "rows", None) is not None else data.num_nodes
    print(f"{args.layers}-layer GCNII, {data.num_nodes:,} vertices ({args.graph}), {data.num_edges:,} edges, "
          f"{args.chunks} chunks; |V|·d = {vd / 2**20:.1f} MB; history keeps {held:,} rows "
          f"({held / data.num_nodes:.2f} of |V|)")
    for name, roots in kinds.items():
        found = {k: v for k, v in reachable(roots).items() if k not in counted}
        counted.update(found)
        total = sum(found.values())
        print(f"  {name:<75} {total / 2**20:8.1f} MB  {total / vd:6.2f} |V|·d  "
              f"{total / max(data.num_edges, 1):6.1f} B/edge")
    rest = {k: v for k, v in reachable([rt]).items() if k not in counted}
    print(f"  {'everything else the runtime reaches':<75} {sum(rest.values()) / 2**20:8.1f} MB")
    print("peak of each step, net of what the process held when it started:")
    for name, b in peaks.items():
        print(f"  {name:<75} {b / 2**20:8.1f} MB")
    engine.uninstall()


if __name__ == "__main__":
    main()
