"""One device, the engine streaming a 16-layer GCNII over chunks, against plain PyG on the same device: the step
time side by side, and what the engine's graph structures hold after the steps.

    python benchmarks/speed/stream_step.py                                  # CPU: 20k community and random, 4 chunks
    python benchmarks/speed/stream_step.py --graphs random --nodes 50000 --chunks 16 --structures

The model and graphs are ``benchmarks/gpu/gpu_summary.py``'s (degree 20, hidden 64, fused kernels on both sides):
``community`` with the default partition (as the GPU summary runs it), ``random`` (8 random blocks: a halo as large
as the rows or larger) in contiguous chunks. Step = forward, loss, backward, Adam; median of ``--steps`` after
``--warmup``. ``--structures``: the megabytes held by the chunked graphs, the local adjacencies, the layer cache
(normalised graphs, ``cached=True`` entries) and the kernels' transposes after the timed steps, each storage once.
Prints only; run it from two checkouts in turn to compare (one machine, one after the other).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _timed(step, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _structures(rt, data) -> str:
    from pyg_pipe.engine.plan.memory_cost import reachable
    from pyg_pipe.ops import aggregate
    seen = set(reachable([data.x, data.adj_t, data.edge_index, data.y, data.train_mask]))
    parts = []
    for name, roots in (("chunked graphs", [rt.chunked]), ("local adjacencies", [rt.adjacency]),
                        ("layer cache", [rt.layer_cache]), ("transposes", [aggregate._transpose_cache])):
        found = reachable(roots, seen)
        seen |= set(found)
        parts.append(f"{name} {sum(found.values()) / 2**20:.1f}")
    return "structures (MB): " + ", ".join(parts)


def main() -> None:
    import torch

    from benchmarks.gpu.gpu_summary import _Engine, _ns, _step_fn
    from benchmarks.speed.gnnpipe_epoch import build
    from pyg_pipe import ops
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--graphs", nargs="+", default=["community", "random"], choices=["community", "random"])
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--structures", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device("cpu")
    for graph in args.graphs:
        data, model = build(_ns(args.nodes, graph=graph))
        plain = copy.deepcopy(model)
        with ops.fused_kernels():
            ops.fuse_messages(plain)
            t_plain = _timed(_step_fn(plain, data), args.steps, args.warmup)
        ops.clear_cache()  # (the kernels' transposes are cached process-wide: plain PyG's are not the engine's)
        cfg = {} if graph == "community" else {"partition": "contiguous"}
        with _Engine(model, dev, num_chunks=args.chunks, **cfg) as engine:
            t_stream = _timed(_step_fn(model, data), args.steps, args.warmup)
            extra = f"; {_structures(engine.runtime, data)}" if args.structures else ""
        print(f"{graph} {args.nodes} vertices, {args.chunks} chunks: plain PyG {t_plain * 1e3:.1f} ms, streamed "
              f"{t_stream * 1e3:.1f} ms, ratio {t_stream / t_plain:.2f}{extra}", flush=True)


if __name__ == "__main__":
    main()
