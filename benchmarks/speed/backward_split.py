"""What a zero-bubble schedule could buy a GNN pipeline: one chunk's backward split into its input part
(B: the gradient a stage sends to the stage before it, and the halo rows' gradients) and its weight
part (W: the parameters' gradients, which nothing downstream waits for).

Zero-bubble schedules (Qi et al. 2023; ``torch.distributed.pipelining``'s ZB1P) run B first, send its
result on, and push W into what would otherwise be the bubble. Per phase pair, with ``p`` stages and one
chunk's forward, input-backward and weight-backward taking ``F``, ``B`` and ``W``::

    GPipe / 1F1B bubble  (p - 1)(F + B + W)
    ZB-H1 bubble         (p - 1)(F + B - W)        (same memory as 1F1B)
    ZB-H2 bubble         ~0                         (more activations kept, optimizer step unsynchronised)

so ZB-H1 saves ``2W / (F + B + W)`` of the bubble. ZB-H1 interleaves each chunk's backward with later
chunks' forwards (1F1B); a GNNPipe step cannot, since the user's loss needs every vertex's output
before any backward starts (fill, then drain). What is left to a fill/drain schedule is to send each
chunk's B on before its W, which takes W off the drain's critical path only::

    fill/drain, W after the send   (p - 1)(F + B)              saves W / (F + B + W) of the bubble The usual estimate ``(p - 1)/(3m)`` assumes F = B = W,
as in a transformer's matmuls. In a GNN layer the sparse aggregation's backward is part of B only (its
gradient flows to the source rows, not to a weight), so W is a dense ``X^T dY`` per weight and B carries
the aggregation: W is a smaller share. This script measures F, B and W for one chunk of a stage of the
models of the speed benchmark (``gnnpipe_epoch.py``), in one process, alternating the three, median of
``--repeats``::

    B: torch.autograd.grad(out, x, dy)              (autograd skips the weight-gradient products)
    W: (full backward) - B

    python benchmarks/speed/backward_split.py --out docs/results/backward_split.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def chunk_graph(nodes: int, chunks: int, degree: float):
    """One chunk of the speed benchmark's community graph, cut as the strategies cut it (``make_chunks``):
    the row graph of its rows, a CSR ``[rows, rows + halo]`` (sources among the chunk's local vertices)."""
    import torch
    from torch_geometric.utils import to_torch_csr_tensor

    from pyg_pipe.graph import ChunkedGraph, sbm_graph
    from pyg_pipe.graph.partition import make_chunks

    data = sbm_graph(nodes, num_classes=max(nodes // 125, 8), avg_degree=degree, homophily=0.9, num_features=8,
                     seed=0)
    perm, ptr = make_chunks(data.edge_index, nodes, chunks)
    cg = ChunkedGraph(data.edge_index[0], data.edge_index[1], nodes, perm, ptr)
    lg = cg.chunks[0]
    ei = lg.edge_index[:, lg.edge_index[1] < lg.rows]
    return to_torch_csr_tensor(ei.flip(0), size=(lg.rows, lg.num_local)), lg.rows, lg.num_local


def measure(model_name: str, layers: int, hidden: int, adj, rows: int, num_local: int, repeats: int) -> dict:
    """F, B and W of ``layers`` layers on one chunk, written as the engine runs PyG's layers: per-vertex work
    on the chunk's rows only, the halo rows of each propagate's source read from history (constants here),
    the aggregation pyg_pipe's fused CSR kernel over ``[rows | halo]`` (the strategies' default)."""
    import torch
    from torch.nn import Linear

    from pyg_pipe.ops import csr_aggregate

    rowptr, col, value = adj.crow_indices(), adj.col_indices(), torch.rand(adj._nnz())

    def aggregate(src):  # the strategies' fused Gather (normalised edge weights as values)
        return csr_aggregate(rowptr, col, src, value)

    torch.manual_seed(0)
    lins = torch.nn.ModuleList([Linear(hidden, hidden) for _ in range(layers)])
    norms = torch.nn.ModuleList([torch.nn.LayerNorm(hidden) for _ in range(layers)])
    params = list(lins.parameters()) + (list(norms.parameters()) if model_name == "resgcn" else [])
    halo = torch.randn(num_local - rows, hidden)
    alpha, beta = 0.1, [0.5 / (i + 1) for i in range(layers)]  # GCN2Conv's alpha, log(theta / l + 1) ~ theta / l

    def forward(x, x0):
        h = x
        for i, (lin, norm) in enumerate(zip(lins, norms)):
            if model_name == "gcnii":   # GCN2Conv: (1-a) A h + a x0, then (1-b) I + b W, relu
                s = aggregate(torch.cat([h, halo])) * (1 - alpha) + alpha * x0
                h = torch.relu(s * (1 - beta[i]) + beta[i] * (s @ lin.weight.t()))
            elif model_name == "gcn":   # GCNConv: A (h W) + b, relu
                h = torch.relu(aggregate(torch.cat([lin(h), halo])))
            else:                       # ResGCN+ (DeepGCNLayer res+ around GCNConv): h + A (relu(norm(h)) W) + b
                h = h + aggregate(torch.cat([lin(torch.relu(norm(h))), halo]))
        return h

    x = torch.randn(rows, hidden, requires_grad=True)
    x0 = torch.randn(rows, hidden)
    dy = torch.randn(rows, hidden)
    t = {"F": [], "B": [], "BW": []}
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        out = forward(x, x0)
        t1 = time.perf_counter()
        torch.autograd.grad(out, [x], dy)
        t2 = time.perf_counter()
        out = forward(x, x0)
        t3 = time.perf_counter()
        torch.autograd.backward(out, dy, inputs=[x] + params)
        t4 = time.perf_counter()
        t["F"].append(((t1 - t0) + (t3 - t2)) / 2)
        t["B"].append(t2 - t1)
        t["BW"].append(t4 - t3)
    med = {k: statistics.median(v[2:]) for k, v in t.items()}
    F, B, BW = med["F"], med["B"], med["BW"]
    W = max(BW - B, 0.0)
    return {"model": model_name, "layers": layers, "rows": rows, "num_local": num_local, "edges": adj._nnz(),
            "F_ms": 1e3 * F, "B_ms": 1e3 * B, "W_ms": 1e3 * W, "W_share": W / (F + B + W),
            "zb_h1_bubble_vs_gpipe": (F + B - W) / (F + B + W), "w_deferred_bubble_vs_gpipe": (F + B) / (F + B + W)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=20000)
    p.add_argument("--degree", type=float, default=20.0)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--layers", type=int, default=8, help="layers of one stage")
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 256])
    p.add_argument("--models", nargs="+", default=["gcnii", "gcn", "resgcn"])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    adj, rows, num_local = chunk_graph(args.nodes, args.chunks, args.degree)
    results = []
    print(f"one chunk: {rows} rows, {num_local - rows} halo rows, {adj._nnz()} edges; {args.layers} layers; "
          f"{args.threads} thread(s)")
    print(f"{'model':8s} {'hidden':>6s} {'F ms':>8s} {'B ms':>8s} {'W ms':>8s} {'W share':>8s} {'ZB-H1 bubble / GPipe':>21s} {'fill/drain, W deferred':>23s}")
    for hidden in args.hidden:
        for m in args.models:
            r = measure(m, args.layers, hidden, adj, rows, num_local, args.repeats)
            r["hidden"] = hidden
            results.append(r)
            print(f"{m:8s} {hidden:>6d} {r['F_ms']:8.2f} {r['B_ms']:8.2f} {r['W_ms']:8.2f} {r['W_share']:8.2f} "
                  f"{r['zb_h1_bubble_vs_gpipe']:21.2f} {r['w_deferred_bubble_vs_gpipe']:23.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"setting": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
