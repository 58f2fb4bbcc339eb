"""Cost of chunking alone: one process, one thread, plain PyG against the engine with one stage and C chunks.

With one stage nothing overlaps, so the ratio is pure chunking overhead: halo rows gathered and
aggregated per layer, per-chunk sparse products (and their transposes in backward), history writes.
It is what keeps the pipelined epoch time above the ideal (S+C-1)/(S·C) of a one-process epoch.

    python benchmarks/speed/chunk_overhead.py --graph community      # 50,000 vertices, 32-layer GCNII
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph", choices=["community", "random"], default="community")
    p.add_argument("--nodes", type=int, default=50_000)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 8])
    args = p.parse_args()

    import copy

    import torch
    import torch.nn.functional as F
    from torch_geometric.utils import to_torch_csr_tensor

    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
    from pyg_pipe.graph import sbm_graph
    from pyg_pipe.models import gcnii

    torch.set_num_threads(1)
    if args.graph == "community":
        data = sbm_graph(args.nodes, num_classes=args.nodes // 125, avg_degree=20, homophily=0.9, num_features=64)
        data.y = data.y % 8
    else:
        data = sbm_graph(args.nodes, num_classes=8, avg_degree=20, num_features=64)
    adj = to_torch_csr_tensor(data.edge_index.flip(0), size=(data.num_nodes, data.num_nodes))
    torch.manual_seed(0)
    base = gcnii(64, 64, 8, num_layers=args.layers, dropout=0.0, cached=True)

    def steady(model):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out = model(data.x, adj)
            loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    plain = steady(copy.deepcopy(base))
    print(f"{args.graph} graph, {args.nodes:,} vertices, {args.layers}-layer GCNII, 1 thread")
    print(f"plain PyG: {plain:.2f} s/epoch")
    for c in args.chunks:
        model = copy.deepcopy(base)
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=c, streaming=False), Comm(torch.device("cpu")), num_stages=1)
        engine.install()
        t = steady(model)
        g = engine.runtime.graph
        halo = sum(ch.halo.numel() for ch in g.chunks) / data.num_nodes
        print(f"engine, 1 stage, {c} chunk(s): {t:.2f} s/epoch = {t / plain:.2f}x plain "
              f"(halo rows per chunk row: {halo:.2f})")


if __name__ == "__main__":
    main()
