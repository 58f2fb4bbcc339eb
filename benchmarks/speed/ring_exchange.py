"""The ring halo exchange against the all-to-all: graph parallelism, measured bytes, formula bytes and epoch time.

For every process count one group of gloo processes (CPU, one thread each) is started; inside it, for every
generated graph and link setting, the same GCN trains for ``--epochs`` steps through the engine in graph
parallel mode (1 stage x P ways, one METIS partition per process) with ``halo_exchange="all_to_all"`` and
then ``"ring"``, one after the other. Reported per run:

* halo bytes of one step (``halo_forward + halo_backward``, summed over ranks, from the transport's counters)
  and the prediction beside them: ``Σ_sites d_site · Σ_p |halo(p)| · 4`` per direction for all-to-all
  (:func:`pyg_pipe.engine.halo_rows`), ``Σ_sites d_site · Σ_v maxdist(v) · 4`` for the ring
  (:func:`pyg_pipe.engine.ring_halo_rows`), for the partition the engine used;
* epoch time (one optimizer step: forward, loss, backward, step): median of the steps after the first
  (which plans: partitioning, tracing, routes), the slowest rank's;
* beside the bytes, what the all-to-all would put on the links of a physical ring of the same order (each
  message routed ``(r - o) mod W`` hops: ``Σ_v Σ_{r reads v} (r - o) mod W`` rows per unit of width), which the
  ring exchange never exceeds: it sends a row once over each link up to its farthest reader;
* with ``--bandwidths``: the same under the simulated link of :meth:`pyg_pipe.engine.Comm.simulate_link`
  (``PYG_PIPE_SIMULATED_BANDWIDTH`` bytes/s, per rank's receives; ``0``: the real gloo transport only).

Graphs: ``community`` (stochastic blocks of ~125 vertices, 90% of edges inside: METIS cuts few edges) and
``powerlaw`` (Chung-Lu degrees, exponent 2.5, 8 classes with 70% of edges inside a class: hubs read by
many parts). With more processes than cores (8 on this 2-core machine) times include oversubscription.

    python benchmarks/speed/ring_exchange.py                                   # 4 and 8 processes, both graphs
    python benchmarks/speed/ring_exchange.py --procs 4 --graphs community --epochs 3 --bandwidths 0   # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

MODES = ("all_to_all", "ring")


def build_graph(name: str, args):
    import torch
    from torch_geometric.utils import to_torch_csr_tensor

    from pyg_pipe.graph import powerlaw_graph, sbm_graph

    if name == "community":
        data = sbm_graph(args.nodes, num_classes=args.nodes // 125, avg_degree=args.degree, homophily=0.9,
                         num_features=args.features, seed=0)
    else:
        data = powerlaw_graph(args.nodes, avg_degree=args.degree, exponent=2.5, num_classes=8, homophily=0.7,
                              num_features=args.features, seed=0)
    data.y = data.y % args.classes
    data.adj_t = to_torch_csr_tensor(data.edge_index.flip(0), size=(data.num_nodes, data.num_nodes))
    torch.manual_seed(0)
    return data


def ring_link_rows(edge_index, perm, ptr) -> int:
    """``Σ_o Σ_{v in part o} Σ_{r reads v} (r - o) mod W``: the all-to-all's rows times the hops they would take on
    a unidirectional ring of links (the ring exchange sends ``Σ_v maxdist(v)`` over the same links)."""
    import torch
    n, W = perm.numel(), ptr.numel() - 1
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n)
    src, dst = inv[edge_index[0]], inv[edge_index[1]]
    part = torch.bucketize(torch.arange(n), ptr[1:], right=True)
    pairs = torch.unique(src * W + part[dst])            # (row, reader part), once each
    v, r = pairs // W, pairs % W
    return int(((r - part[v]) % W).sum())


def widths(args):
    """Width of the rows each propagate call exchanges in one step: GCN propagates ``lin(x)``, so layers 2 .. L
    send ``hidden`` wide rows and the last ``classes`` wide ones (the first reads the input features)."""
    return [args.hidden] * (args.layers - 2) + [args.classes]


def worker(rank: int, P: int, port: int, args, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch_geometric.nn import GCN

    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, halo_rows, ring_halo_bytes, ring_halo_rows

    warnings.filterwarnings("ignore", message="Sparse")   # torch's beta notes on CSR tensors
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=P)
    for graph in args.graphs:
        data = build_graph(graph, args)
        for bw in args.bandwidths:
            for mode in MODES:
                os.environ["PYG_PIPE_SIMULATED_BANDWIDTH"] = str(bw)   # read when the Comm is made
                torch.manual_seed(0)
                model = GCN(args.features, args.hidden, args.layers, args.classes)
                engine = GNNPipeEngine(model, PipelineConfig(num_chunks=P, halo_exchange=mode),
                                       Comm(torch.device("cpu"), timeout=1800), num_stages=1, ways=P)
                engine.install()
                opt = torch.optim.Adam(model.parameters(), lr=0.01)
                times, sent = [], []
                for _ in range(args.epochs):
                    engine.comm.reset_counters()
                    dist.barrier()
                    t0 = time.perf_counter()
                    out = model(data.x, data.adj_t)
                    loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    times.append(time.perf_counter() - t0)
                    sent.append(engine.comm.totals())
                perm, ptr = engine.plan.perm, engine.plan.ptr
                engine.uninstall()
                slowest = torch.tensor(times, dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if rank == 0:
                    rows = (ring_halo_rows if mode == "ring" else halo_rows)(data.edge_index, perm, ptr)
                    row = {"graph": graph, "procs": P, "mode": mode, "bandwidth": bw, "nodes": data.num_nodes,
                           "edges": data.num_edges, "layers": args.layers, "hidden": args.hidden,
                           "halo_rows": rows, "formula": 2 * ring_halo_bytes(rows, widths(args)),
                           "a2a_link_bytes": 2 * ring_halo_bytes(ring_link_rows(data.edge_index, perm, ptr),
                                                                 widths(args)),
                           "measured": sent[-1]["halo_forward"] + sent[-1]["halo_backward"],
                           "halo_forward": sent[-1]["halo_forward"], "halo_backward": sent[-1]["halo_backward"],
                           "total_bytes": sent[-1]["total"], "times": slowest.tolist(),
                           "epoch_s": statistics.median(slowest.tolist()[1:])}
                    with open(path, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"  {graph:9s} P={P} bw={bw:g} {mode:10s} halo {row['measured']:>13,} B (formula "
                          f"{row['formula']:>13,})  epoch {row['epoch_s']:.3f} s", flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(rows, cores: int) -> str:
    lines = ["| graph | P | link | a2a halo B/step | ring halo B/step | ring ÷ a2a bytes | measured = formula "
             "| a2a routed over a ring, link B/step | a2a epoch s | ring epoch s | ring ÷ a2a time |",
             "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    by = {(r["graph"], r["procs"], r["bandwidth"], r["mode"]): r for r in rows}
    for (graph, P, bw, mode), ring in by.items():
        if mode != "ring" or (graph, P, bw, "all_to_all") not in by:
            continue
        a2a = by[(graph, P, bw, "all_to_all")]
        exact = "yes" if ring["measured"] == ring["formula"] and a2a["measured"] == a2a["formula"] else "NO"
        link = f"{bw:.0e} B/s" if bw else "gloo"
        note = f" ({P} procs on {cores} cores)" if P > cores else ""
        lines.append(f"| {graph} | {P}{note} | {link} | {a2a['measured']:,} | {ring['measured']:,} | "
                     f"{ring['measured'] / a2a['measured']:.2f} | {exact} | {a2a['a2a_link_bytes']:,} | "
                     f"{a2a['epoch_s']:.3f} | "
                     f"{ring['epoch_s']:.3f} | {ring['epoch_s'] / a2a['epoch_s']:.2f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", nargs="+", default=["community", "powerlaw"], choices=["community", "powerlaw"])
    p.add_argument("--procs", nargs="+", type=int, default=[4, 8])
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--degree", type=float, default=10.0)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--epochs", type=int, default=4, help="steps per run; the first (planning) is not timed")
    p.add_argument("--bandwidths", nargs="+", type=float, default=[0.0, 1e8],
                   help="simulated link bytes/s per run (0: the real transport only)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()

    import torch.multiprocessing as mp

    cores = os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for P in args.procs:
            if P > cores:
                print(f"P={P}: {P} processes on {cores} cores, oversubscribed: epoch times include waiting for a core",
                      flush=True)
            path = os.path.join(tmp, f"{P}.jsonl")
            mp.start_processes(worker, args=(P, _free_port(), args, path), nprocs=P, join=True, start_method="spawn")
            with open(path) as f:
                rows += [json.loads(line) for line in f]
    print()
    print(table(rows, cores))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"setting": vars(args), "cores": cores, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
