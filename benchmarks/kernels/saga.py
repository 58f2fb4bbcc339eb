"""SAGA layers with NGra's rewrite and the fused Gather against PyG's own layers, side by side.

Setting (the issue's): a generated graph of 100,000 vertices and 2,000,000 edges (uniform endpoints,
:func:`benchmarks.aggregate.make_graph`), width 64, float32, 2 threads; one layer, forward and backward
(gradients w.r.t. the input and every weight). Compared, interleaved (each repeat runs every method once;
medians and ratios of medians):

==================  ==========================================================================
``pyg``             PyG's layer: ``ResGatedGraphConv`` / ``GCNConv`` / ``GATConv`` (1 head)
``saga``            the SAGA layer (:mod:`pyg_pipe.saga.layers`): rewrite on, fused Gather
``saga_unfused``    rewrite on, PyG's aggregation (messages built per edge)
``saga_no_rewrite`` rewrite off: ``apply_edge`` as written on every edge (its products |E| times)
==================  ==========================================================================

Peak memory: the CPU allocator's peak during one forward + backward beyond what was held before it
(``torch.profiler`` with ``profile_memory``; :func:`benchmarks.aggregate.peak_allocated`), the layer's
output and gradients included. The first call of each method is a warm-up (it builds and caches the
CSR of the graph, timed separately as ``csr_build``).

    python benchmarks/kernels/saga.py --out docs/results/saga_cpu.json          # ~5 min on 2 cores
    python benchmarks/kernels/saga.py --layers ggcn --repeats 3                 # quick look
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

import torch

from aggregate import make_graph, peak_allocated  # noqa: E402


def layers(name: str, width: int):
    """name -> {method: module} with equal weights."""
    from torch_geometric.nn import GATConv, GCNConv, ResGatedGraphConv

    from pyg_pipe.saga import GGCN, SAGAGAT, SAGAGCN

    torch.manual_seed(0)
    if name == "ggcn":
        ref = ResGatedGraphConv(width, width)
        make = lambda **kw: GGCN(width, width, **kw)  # noqa: E731
        pairs = lambda m: [(m.A.weight, ref.lin_key.weight), (m.A.bias, ref.lin_key.bias),  # noqa: E731
                           (m.B.weight, ref.lin_query.weight), (m.B.bias, ref.lin_query.bias),
                           (m.V.weight, ref.lin_value.weight), (m.V.bias, ref.lin_value.bias),
                           (m.U.weight, ref.lin_skip.weight), (m.bias, ref.bias)]
    elif name == "gcn":
        ref = GCNConv(width, width, cached=True)
        make = lambda **kw: SAGAGCN(width, width, **kw)  # noqa: E731
        pairs = lambda m: [(m.lin.weight, ref.lin.weight), (m.bias, ref.bias)]  # noqa: E731
    else:
        ref = GATConv(width, width, heads=1, add_self_loops=False)
        make = lambda **kw: SAGAGAT(width, width, heads=1, add_self_loops=False, **kw)  # noqa: E731
        pairs = lambda m: [(m.lin.weight, ref.lin.weight), (m.att_src, ref.att_src), (m.att_dst, ref.att_dst),  # noqa: E731
                           (m.bias, ref.bias)]
    out = {"pyg": ref}
    for method, kw in (("saga", {}), ("saga_unfused", {"fused": False}), ("saga_no_rewrite", {"rewrite": False})):
        m = make(**kw)
        with torch.no_grad():
            for a, b in pairs(m):
                a.copy_(b)
        out[method] = m
    return out


def step(module, x, edge_index, grad):
    module.zero_grad(set_to_none=True)
    x.grad = None
    out = module(x, edge_index)
    out.backward(grad)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=100_000)
    p.add_argument("--edges", type=int, default=2_000_000)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", default="ggcn,gcn,gat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    _, _, edge_index = make_graph(a.nodes, a.edges, "uniform")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(a.nodes, a.width, generator=gen).requires_grad_()
    grad = torch.randn(a.nodes, a.width, generator=gen)
    results = {"setting": vars(a), "machine": platform.processor() or platform.machine(), "layers": {}}
    from pyg_pipe import ops
    print(f"{a.nodes} vertices, {a.edges} edges, width {a.width}, {a.threads} threads; kernels: {ops.backend()}")
    for name in a.layers.split(","):
        mods = layers(name, a.width)
        times = {m: [] for m in mods}
        outs, first = {}, {}
        for m, mod in mods.items():   # warm-up: caches (CSR, GCN normalisation), and the results to compare
            t0 = time.perf_counter()
            outs[m] = step(mod, x, edge_index, grad).detach()
            first[m] = time.perf_counter() - t0
        worst = max((outs[m] - outs["pyg"]).abs().max().item() for m in mods)
        for _ in range(a.repeats):
            for m, mod in mods.items():
                t0 = time.perf_counter()
                step(mod, x, edge_index, grad)
                times[m].append(time.perf_counter() - t0)
        peak = {m: peak_allocated(lambda mod=mod: step(mod, x, edge_index, grad), "cpu") for m, mod in mods.items()}
        med = {m: statistics.median(t) for m, t in times.items()}
        route = mods["saga"].route
        print(f"\n{name} (SAGA route: {route}; largest difference from PyG's output: {worst:.1e})")
        print(f"{'method':<16}{'fwd+bwd s':>11}{'÷ pyg':>8}{'peak MB':>10}{'÷ pyg':>8}{'first call s':>14}")
        for m in mods:
            print(f"{m:<16}{med[m]:>11.3f}{med[m] / med['pyg']:>8.2f}{peak[m] / 2**20:>10.0f}"
                  f"{peak[m] / peak['pyg']:>8.2f}{first[m]:>14.3f}")
        results["layers"][name] = {"route": route, "max_abs_diff": worst, "median_s": med, "times_s": times,
                                   "peak_bytes": peak, "first_call_s": first}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
