"""The engine's fixed cost per (chunk, layer), and the cost of building the chunk-local graphs.

1. Fixed cost: a graph so small that the arithmetic is negligible (a 16-layer GCNII, hidden 16, on
   a few hundred vertices), one process, one thread. One training step of plain PyG against the same
   step through the engine with one stage and C chunks (history, hooks, halo joins, degrees: all the
   per-chunk machinery, no communication), measured alternately, median of many steps::

       fixed cost per (chunk, layer) = (engine step - plain step) / (C x L)

   Part of that is PyG's own cost of calling each layer once per chunk instead of once (its Python
   and dispatch overhead per call, which dominates on a tiny graph): the same plain model called on
   every chunk's local graph, without the engine, is timed too, so the engine's own machinery is
   ``(engine step - per-chunk calls) / (C x L)``. Those per-chunk calls recompute each layer's
   ``gcn_norm`` every call, which the engine does once per chunk; the split is also given against
   per-chunk copies whose layers cache it (``cached=True``), the fairer reference.

   The operations too (``--ops``): the tensor operations one step dispatches (each a kernel launch or at least a
   trip through PyTorch's dispatcher on a GPU's host), counted by the profiler at the top level (an operation
   called inside another, as ``index_select`` calls ``select`` on the CPU, not counted again), the engine's step
   against the per-chunk copies with cached normalisation, per (chunk, layer), with the operations the engine
   adds, by name.

2. Setup: building the chunk-local graphs of a 200,000-vertex / 4,000,000-edge random graph in 32
   chunks (and the mirror sets of 4 ways), median of 3.

    python benchmarks/speed/engine_overhead.py                  # both
    python benchmarks/speed/engine_overhead.py --skip-setup     # the fixed cost only
    python benchmarks/speed/engine_overhead.py --skip-setup --fused   # with the strategies' default fused kernels
    python benchmarks/speed/engine_overhead.py --skip-setup --chunks 4 --ops   # and the operations a step
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def fixed_cost(nodes: int, layers: int, chunks: int, steps: int, fused: bool = False, ops: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
    from pyg_pipe.graph import sbm_graph
    from pyg_pipe.models import gcnii

    data = sbm_graph(nodes, num_classes=4, avg_degree=8, num_features=16, seed=0)
    torch.manual_seed(0)
    model = gcnii(16, 16, 4, num_layers=layers, dropout=0.0)
    plain = copy.deepcopy(model)
    if fused:  # the strategies' default (fused_kernels=True): the compiled Gather in every layer, plain PyG too
        from pyg_pipe.ops import fuse_messages
        fuse_messages(model), fuse_messages(plain)
    config = PipelineConfig(num_chunks=chunks, balance="layers", streaming=False)
    engine = GNNPipeEngine(model, config, Comm(torch.device("cpu")),
                           num_stages=1, ways=1)

    def step(m):
        t0 = time.perf_counter()
        out = m(data.x, data.edge_index)
        F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
        return time.perf_counter() - t0

    engine.install()
    step(model)  # planning
    graph = engine.runtime.graph

    def per_chunk(models):
        """The plain model called once per chunk on the chunk's local graph (true halo rows), no engine:
        what running PyG's layers once per chunk costs by itself (``models``: the model each chunk runs)."""
        t0 = time.perf_counter()
        for m, lg in zip(models, graph.chunks):
            out = m(data.x[graph.perm[lg.nodes]], lg.edge_index)
            F.cross_entropy(out[:lg.rows], data.y[graph.perm[lg.start:lg.end]]).backward()
        return time.perf_counter() - t0

    # the same, each chunk with its own copy whose layers cache their normalisation (cached=True), as the
    # engine caches gcn_norm per chunk: PyG's per-call cost without the normalisation it recomputes
    copies = [copy.deepcopy(plain) for _ in graph.chunks]
    for m in copies:
        for conv in m.modules():
            if hasattr(conv, "cached"):
                conv.cached = True

    times = {"plain": [], "engine": [], "per_chunk": [], "per_chunk_cached": []}
    for _ in range(steps):
        engine.uninstall()
        times["plain"].append(step(plain))
        times["per_chunk"].append(per_chunk([plain] * len(graph.chunks)))
        times["per_chunk_cached"].append(per_chunk(copies))
        engine.install()
        times["engine"].append(step(model))
    counted = _operations(lambda: step(model), lambda: per_chunk(copies)) if ops else None
    engine.uninstall()
    t = {k: statistics.median(v) for k, v in times.items()}
    cl = chunks * layers
    return {"operations": counted, "nodes": nodes, "edges": data.num_edges, "layers": layers, "chunks": chunks,
            "fused": fused,
            "plain_step_ms": 1e3 * t["plain"], "per_chunk_calls_step_ms": 1e3 * t["per_chunk"],
            "engine_step_ms": 1e3 * t["engine"],
            "per_chunk_layer_ms": 1e3 * (t["engine"] - t["plain"]) / cl,
            "pyg_calls_per_chunk_layer_ms": 1e3 * (t["per_chunk"] - t["plain"]) / cl,
            "engine_net_per_chunk_layer_ms": 1e3 * (t["engine"] - t["per_chunk"]) / cl,
            "per_chunk_cached_calls_step_ms": 1e3 * t["per_chunk_cached"],
            "pyg_cached_calls_per_chunk_layer_ms": 1e3 * (t["per_chunk_cached"] - t["plain"]) / cl,
            "engine_net_of_cached_per_chunk_layer_ms": 1e3 * (t["engine"] - t["per_chunk_cached"]) / cl}


def _operations(engine_step, per_chunk_step) -> dict:
    """Top-level tensor operations of one engine step and of the per-chunk calls (module docstring)."""
    import collections

    from torch.profiler import profile

    def count(fn) -> collections.Counter:
        with profile() as prof:
            fn()
        top = collections.Counter()
        for e in prof.events():
            parent = e.cpu_parent
            if e.name.startswith("aten::") and not (parent is not None and parent.name.startswith("aten::")):
                top[e.name] += 1
        return top

    engine, plain = count(engine_step), count(per_chunk_step)
    added = engine.copy()
    added.subtract(plain)
    return {"engine": sum(engine.values()), "per_chunk_cached": sum(plain.values()),
            "added": dict(sorted(((k, v) for k, v in added.items() if v), key=lambda kv: -kv[1]))}


def setup_cost(nodes: int, edges: int, chunks: int, ways: int) -> dict:
    import torch

    from pyg_pipe.graph import ChunkedGraph

    gen = torch.Generator().manual_seed(0)
    src, dst = torch.randint(0, nodes, (edges,), generator=gen), torch.randint(0, nodes, (edges,), generator=gen)
    perm = torch.randperm(nodes, generator=gen)
    ptr = torch.linspace(0, nodes, chunks + 1).long()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        g = ChunkedGraph(src, dst, nodes, perm, ptr, ways=ways)
        g.mirrors()
        times.append(time.perf_counter() - t0)
    return {"nodes": nodes, "edges": edges, "chunks": chunks, "ways": ways, "seconds": statistics.median(times)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=400)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--skip-setup", action="store_true")
    p.add_argument("--fused", action="store_true", help="route every layer through pyg_pipe.ops.fuse_messages "
                   "(what the strategies do by default), in the plain model too")
    p.add_argument("--ops", action="store_true", help="count the tensor operations a step dispatches, too")
    p.add_argument("--out", default=None, help="write the results as JSON")
    args = p.parse_args()
    import torch
    torch.set_num_threads(1)
    result = {"fixed": fixed_cost(args.nodes, args.layers, args.chunks, args.steps, args.fused, args.ops)}
    f = result["fixed"]
    print(f"fixed cost: {f['layers']}-layer GCNII, {f['nodes']} vertices / {f['edges']} edges, {f['chunks']} chunks: "
          f"plain {f['plain_step_ms']:.1f} ms, PyG's layers called per chunk {f['per_chunk_calls_step_ms']:.1f} ms, "
          f"engine {f['engine_step_ms']:.1f} ms per step")
    print(f"  (engine - plain) / (C x L) = {f['per_chunk_layer_ms']:.3f} ms per (chunk, layer), of which PyG's own "
          f"per-call cost {f['pyg_calls_per_chunk_layer_ms']:.3f} ms and the engine's machinery "
          f"{f['engine_net_per_chunk_layer_ms']:.3f} ms")
    print(f"  with the layers' normalisation cached per chunk (as the engine does): PyG's per-call cost "
          f"{f['pyg_cached_calls_per_chunk_layer_ms']:.3f} ms, the engine's machinery "
          f"{f['engine_net_of_cached_per_chunk_layer_ms']:.3f} ms")
    if f["operations"] is not None:
        o, cl = f["operations"], f["chunks"] * f["layers"]
        print(f"  operations a step: engine {o['engine']}, PyG's layers called per chunk (cached) "
              f"{o['per_chunk_cached']}; per (chunk, layer) {o['engine'] / cl:.1f} against "
              f"{o['per_chunk_cached'] / cl:.1f}, "
              f"the engine's own {(o['engine'] - o['per_chunk_cached']) / cl:.1f}; the most added: "
              + ", ".join(f"{k[6:]} {v}" for k, v in list(o["added"].items())[:8]))
    if not args.skip_setup:
        result["setup"] = setup_cost(200_000, 4_000_000, 32, 4)
        s = result["setup"]
        print(f"setup: {s['nodes']:,} vertices / {s['edges']:,} edges, {s['chunks']} chunks, {s['ways']} ways: "
              f"{s['seconds']:.2f} s")
    result["load_average"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
