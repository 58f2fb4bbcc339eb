"""Fused CSR aggregation against PyG's default path, torch.sparse.mm and torch-sparse, side by side.

Setting: 100,000 vertices and 2,000,000 edges, uniform or power-law degrees; feature widths
16, 64, 128, 256; reductions sum, mean and max; forward alone and forward + backward (gradient w.r.t. the
features). Compared in one run, interleaved (each repeat runs every method once, so load from other
processes hits all of them alike; the table shows medians and the ratios of medians):

=================  =====================================================================================
``pyg``            PyG's default message passing: ``x.index_select(0, src)`` then
                   ``torch_geometric.utils.scatter(..., reduce)`` (what ``MessagePassing`` does with an
                   ``edge_index``); builds the [E, d] message tensor
``sparse_mm``      ``torch.sparse.mm(adj_t, x, reduce)`` with a torch CSR ``adj_t`` (PyG's sparse path)
``torch_sparse``   ``torch_sparse.matmul(SparseTensor, x, reduce)``, only if torch-sparse is installed
``kernel``         ``pyg_pipe.ops.csr_aggregate`` (the compiled kernel; its backend is printed)
=================  =====================================================================================

Peak extra memory: on CPU, ``torch.profiler`` with ``profile_memory=True`` records every allocation and
free of the CPU allocator; the peak of its running total during one call (output included, inputs and
the graph excluded) is reported. On CUDA, ``torch.cuda.max_memory_allocated`` minus the memory held
before the call. The claim checked: the kernel allocates its output (and, for max, an int32 arg-max of
the same size) and nothing of size |E| x d.

On CUDA the script also prints the achieved bandwidth of the kernel's forward: bytes it must touch
(one source row per edge, the indices, the values, the output) over its time.

    python benchmarks/kernels/aggregate.py --out docs/results/aggregate_cpu.json        # full run, ~10 min on 2 cores
    python benchmarks/kernels/aggregate.py --widths 128 --reduces sum --repeats 3       # quick look
    python benchmarks/kernels/aggregate.py --device cuda --out docs/results/aggregate_cuda.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import torch

METHODS = ("pyg", "sparse_mm", "torch_sparse", "kernel")


def make_graph(num_nodes: int, num_edges: int, kind: str, seed: int = 0):
    """CSR (rowptr, col) and the matching edge_index, rows = destinations, sorted by (dst, src).

    ``uniform``: both endpoints uniform. ``powerlaw``: Chung-Lu style, both endpoints drawn with
    probability proportional to rank^(-2/3) (degree exponent about 2.5) over randomly permuted ids;
    the top in-degree is then tens of thousands. Multi-edges are kept, so E is exact.
    """
    gen = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        dst = torch.randint(0, num_nodes, (num_edges,), generator=gen)
        src = torch.randint(0, num_nodes, (num_edges,), generator=gen)
    else:
        weight = torch.arange(1, num_nodes + 1, dtype=torch.float64).pow(-2.0 / 3.0)
        ids = torch.randperm(num_nodes, generator=gen)
        dst = ids[torch.multinomial(weight, num_edges, replacement=True, generator=gen)]
        src = ids[torch.multinomial(weight, num_edges, replacement=True, generator=gen)]
    order = torch.argsort(dst * num_nodes + src)
    dst, src = dst[order], src[order]
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.int64)
    rowptr[1:] = torch.cumsum(torch.bincount(dst, minlength=num_nodes), 0)
    return rowptr, src, torch.stack([src, dst])


def methods(rowptr, col, edge_index, num_nodes, device):
    """name -> fn(x, reduce) for every method available here."""
    from torch_geometric.utils import scatter

    from pyg_pipe import ops

    src, dst = edge_index[0].to(device), edge_index[1].to(device)
    rowptr, col = rowptr.to(device), col.to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adj = torch.sparse_csr_tensor(rowptr, col, torch.ones(col.numel(), device=device), (num_nodes, num_nodes))
    sparse_reduce = {"sum": "sum", "mean": "mean", "max": "amax"}

    def pyg(x, reduce):
        return scatter(x.index_select(0, src), dst, dim=0, dim_size=num_nodes, reduce=reduce)

    def sparse_mm(x, reduce):
        a = adj.to(x.dtype)
        if device == "cuda" and reduce != "sum":  # torch.sparse.mm's reductions are CPU-only
            if reduce == "max":
                raise NotImplementedError
            deg = (rowptr[1:] - rowptr[:-1]).clamp(min=1).to(x.dtype).unsqueeze(1)
            return torch.sparse.mm(a, x) / deg
        return torch.sparse.mm(a, x, sparse_reduce[reduce]) if device == "cpu" else torch.sparse.mm(a, x)

    rp32, col32 = rowptr.int(), col.int()

    def kernel(x, reduce):
        return ops.csr_aggregate(rp32, col32, x, reduce=reduce)

    out = {"pyg": pyg, "sparse_mm": sparse_mm, "kernel": kernel}
    try:
        import torch_sparse

        sp = torch_sparse.SparseTensor(rowptr=rowptr, col=col, sparse_sizes=(num_nodes, num_nodes))
        out["torch_sparse"] = lambda x, reduce: torch_sparse.matmul(sp, x, reduce=reduce)
    except ImportError:
        pass
    return out


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_once(fn, x, reduce, backward, grad, device):
    sync(device)
    t0 = time.perf_counter()
    out = fn(x, reduce)
    if backward:
        out.backward(grad)
    sync(device)
    return time.perf_counter() - t0


def peak_extra_bytes(fn, x, reduce, backward, grad, device) -> int:
    """Peak bytes allocated during one call, beyond what was allocated before it."""
    def call():
        out = fn(x, reduce)
        if backward:
            out.backward(grad)
    return peak_allocated(call, device)


def peak_allocated(call, device) -> int:
    """Peak bytes the allocator held during ``call()`` beyond what it held before (module docstring)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        call()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not mem:
        return 0
    # "Total Allocated" is the allocator's running total; the baseline is its value before the first event
    base = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    return max(0, max(e["args"]["Total Allocated"] for e in mem) - base)


def bandwidth_bytes(rowptr, col, d, elem, index_elem) -> int:
    """Bytes the forward must move at least: a source row per edge, indices, output rows."""
    n = rowptr.numel() - 1
    return col.numel() * (d * elem + index_elem) + (n + 1) * index_elem + n * d * elem


def model_epochs(args) -> dict:
    """End to end: training epochs of a 32-layer GCNII (hidden 64) on a torch.sparse CSR ``adj_t``,
    plain PyG against the same model with ``pyg_pipe.ops.fused_kernels()``, epochs interleaved.

    Same setting as the single-process baseline of ``benchmarks/speed/gnnpipe_epoch.py`` (50,000 vertices,
    about 1,000,000 edges, ``cached=True`` normalisation, one optimizer step per epoch).
    """
    import torch.nn.functional as F
    from torch_geometric.utils import to_torch_csr_tensor

    from pyg_pipe import ops
    from pyg_pipe.graph import sbm_graph
    from pyg_pipe.models import gcnii

    data = sbm_graph(args.model_nodes, num_classes=8, avg_degree=20, num_features=64, seed=0)
    n = data.num_nodes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adj_t = to_torch_csr_tensor(data.edge_index.flip(0), size=(n, n))
    torch.manual_seed(0)
    model = gcnii(64, 64, 8, num_layers=args.model_layers, dropout=0.0, cached=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: both variants see the same weights

    def epoch():
        t0 = time.perf_counter()
        out = model(data.x, adj_t)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        return time.perf_counter() - t0, loss.item()

    times = {"pyg": [], "fused": []}
    losses = {}
    for i in range(args.model_epochs + 1):
        for name in ("pyg", "fused"):
            if name == "fused":
                with ops.fused_kernels():
                    t, loss = epoch()
            else:
                t, loss = epoch()
            losses[name] = loss
            if i:  # the first epoch builds caches (normalisation, transposes)
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"GCNII {args.model_layers} layers, hidden 64, {n} vertices, {data.edge_index.size(1)} edges, "
          f"torch.sparse CSR adj_t: epoch {med['pyg'] * 1e3:.0f} ms plain PyG, {med['fused'] * 1e3:.0f} ms with "
          f"pyg_pipe.ops.fused_kernels() ({med['pyg'] / med['fused']:.2f}x); loss {losses['pyg']:.6f} vs "
          f"{losses['fused']:.6f}")
    return {"layers": args.model_layers, "nodes": n, "edges": int(data.edge_index.size(1)),
            "epoch_ms": {k: v * 1e3 for k, v in med.items()},
            "all_ms": {k: [t * 1e3 for t in v] for k, v in times.items()}, "loss": losses}


def fmt_ms(t):
    return "-" if t is None else f"{t * 1e3:8.1f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=100_000)
    p.add_argument("--edges", type=int, default=2_000_000)
    p.add_argument("--graphs", nargs="+", default=["uniform", "powerlaw"], choices=["uniform", "powerlaw"])
    p.add_argument("--widths", nargs="+", type=int, default=[16, 64, 128, 256])
    p.add_argument("--reduces", nargs="+", default=["sum", "mean", "max"], choices=["sum", "mean", "max"])
    p.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per method (after one warm-up)")
    p.add_argument("--slow-repeats", type=int, default=1,
                   help="repeats for a method whose warm-up call took over --slow-s seconds (PyG's default "
                        "path, torch.sparse.mm's backward): keeps the full run near 10 minutes on 2 cores")
    p.add_argument("--slow-s", type=float, default=0.5)
    p.add_argument("--very-slow-s", type=float, default=5.0,
                   help="a warm-up call slower than this counts as the measurement (no further repeats)")
    p.add_argument("--memory-widths", nargs="+", type=int, default=[128],
                   help="widths at which the peak extra memory is measured (one more call per method)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--pyg-max-gb", type=float, default=4.0,
                   help="skip PyG's default path where its estimated peak (|E| x d messages; about 6.5x that "
                        "for max with backward) exceeds this many GB: on a shared 23 GB machine it got "
                        "processes OOM-killed")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--model", action="store_true",
                   help="also time training epochs of GCNII on a sparse adj_t with and without the fused kernels")
    p.add_argument("--model-only", action="store_true", help="only the --model measurement")
    p.add_argument("--model-nodes", type=int, default=50_000)
    p.add_argument("--model-layers", type=int, default=32)
    p.add_argument("--model-epochs", type=int, default=5)
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    from pyg_pipe import ops

    backend = ops.backend(device)
    try:
        cpu_model = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu_model = next((ln.split(":", 1)[1].strip() for ln in cpu_model.splitlines()
                          if ln.startswith("Model name")), platform.processor())
    except OSError:
        cpu_model = platform.processor()
    dev_name = torch.cuda.get_device_name() if device == "cuda" else f"{cpu_model}, {torch.get_num_threads()} threads"
    slice_edges = ops.build._kernels("cuda").slice_edges() if backend == "cuda" else None
    print(f"device: {dev_name}; torch {torch.__version__}; kernel backend: {backend}"
          + (f"; sum/mean kernel: {slice_edges} edges per slice (0: a group per row; "
             f"PYG_PIPE_CUDA_SLICE_EDGES)" if slice_edges is not None else ""))
    print(f"graph: {args.nodes} vertices, {args.edges} edges; float32; repeats {args.repeats} "
          f"({args.slow_repeats} for calls over {args.slow_s} s); times in ms (median), ratio = method / kernel")

    results = {"device": dev_name, "torch": torch.__version__, "backend": backend, "slice_edges": slice_edges,
               "nodes": args.nodes,
               "edges": args.edges, "threads": torch.get_num_threads(), "rows": []}
    header = f"{'graph':9}{'reduce':7}{'pass':8}{'d':>5}" + "".join(f"{m:>13}" for m in args.methods) \
        + "".join(f"{'x ' + m:>15}" for m in args.methods if m != "kernel")
    if device == "cuda":
        header += f"{'GB/s':>8}"
    if not args.no_memory:
        header += "".join(f"{'MB ' + m:>16}" for m in args.methods) + f"{'MB out':>9}"
    print(header)
    started = time.time()
    load_start = os.getloadavg()[0]
    print(f"load average (1 min) at start: {load_start:.1f} on {os.cpu_count()} CPUs: other jobs slow every method alike")
    if args.model or args.model_only:
        results["model"] = model_epochs(args)
    for kind in ([] if args.model_only else args.graphs):
        rowptr, col, edge_index = make_graph(args.nodes, args.edges, kind)
        fns = methods(rowptr, col, edge_index, args.nodes, device)
        names = [m for m in args.methods if m in fns]
        for d in args.widths:
            gen = torch.Generator().manual_seed(d)
            x0 = torch.randn(args.nodes, d, generator=gen).to(device)
            grad = torch.randn(args.nodes, d, generator=gen).to(device)
            for reduce in args.reduces:
                for pss in args.passes:
                    backward = pss == "fwd+bwd"
                    x = x0.clone().requires_grad_(backward)
                    times = {m: [] for m in names}
                    skipped = set()
                    slow = set()  # warm-up below also builds caches (the kernel's transposed adjacency)
                    msg_gb = args.edges * d * 4 / 1e9 * (6.5 if (backward and reduce == "max") else 1.1)
                    if "pyg" in names and msg_gb > args.pyg_max_gb:
                        skipped.add("pyg")
                    for m in names:
                        if m in skipped:
                            continue
                        try:
                            t = run_once(fns[m], x, reduce, backward, grad, device)
                            if t > args.slow_s:
                                slow.add(m)
                            if t > args.very_slow_s:  # the warm-up is the measurement (PyG's max backward)
                                times[m].append(t)
                        except (NotImplementedError, RuntimeError):
                            skipped.add(m)
                        x.grad = None
                    for _ in range(args.repeats):
                        for m in names:
                            if m in skipped or (m in slow and len(times[m]) >= args.slow_repeats):
                                continue
                            times[m].append(run_once(fns[m], x, reduce, backward, grad, device))
                            x.grad = None
                    med = {m: (statistics.median(t) if t else None) for m, t in times.items()}
                    row = {"graph": kind, "reduce": reduce, "pass": pss, "d": d,
                           "ms": {m: (None if v is None else v * 1e3) for m, v in med.items()},
                           "all_ms": {m: [v * 1e3 for v in t] for m, t in times.items()}}
                    line = f"{kind:9}{reduce:7}{pss:8}{d:5}" + "".join(f"{fmt_ms(med.get(m)):>13}" for m in args.methods)
                    k = med.get("kernel")
                    ratios = {}
                    for m in args.methods:
                        if m == "kernel":
                            continue
                        r = med.get(m) / k if (med.get(m) and k) else None
                        ratios[m] = r
                        line += f"{('-' if r is None else f'{r:.2f}x'):>15}"
                    row["ratio_vs_kernel"] = ratios
                    if device == "cuda" and k:
                        gbs = bandwidth_bytes(rowptr, col, d, 4, 4) / k / 1e9 if not backward else None
                        row["kernel_GBps"] = gbs
                        line += f"{('-' if gbs is None else f'{gbs:.0f}'):>8}"
                    if not args.no_memory and d in args.memory_widths:
                        mem = {}
                        for m in names:
                            if m in skipped:
                                mem[m] = None
                                continue
                            mem[m] = peak_extra_bytes(fns[m], x, reduce, backward, grad, device) / 2**20
                            x.grad = None
                        out_mb = args.nodes * d * 4 / 2**20
                        row["peak_extra_MB"] = mem
                        row["output_MB"] = out_mb
                        line += "".join(f"{('-' if mem.get(m) is None else f'{mem[m]:.0f}'):>16}"
                                        for m in args.methods) + f"{out_mb:9.0f}"
                    print(line, flush=True)
                    results["rows"].append(row)
    results["wall_s"] = time.time() - started
    results["loadavg_1min_start_end"] = [load_start, os.getloadavg()[0]]
    print(f"done in {results['wall_s']:.0f} s; load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    if device == "cuda":
        print("GB/s: the kernel forward's minimum traffic (a source row per edge + indices + output) over its "
              "time; compare with the device's memory bandwidth (H100 SXM ~3350 GB/s, H200 ~4800 GB/s).")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
