"""The communication study: graph parallelism vs GNNPipe vs hybrid, in real training runs.

For every (graph, process count) one group of processes is started; inside it every (model, mode)
trains for ``--epochs`` epochs through a real Lightning ``Trainer`` with ``strategy=`` the mode's
strategy, one after the other, so the modes are measured side by side on the same machine state.
Reported per run:

* bytes of one training epoch, by category, from the strategy's own counters (``comm/<category>``),
  and beside them the prediction of the formulas (pyg_pipe/engine/formulas.py) for the partition actually used
  (:func:`pyg_pipe.engine.gnnpipe_bytes`, :func:`pyg_pipe.engine.graph_parallel_bytes` with the
  exact halo count :func:`pyg_pipe.engine.halo_rows`); hybrid's backward halo traffic depends on the
  chunk order, so its prediction is the expectation over random orders;
* epoch time: of the last epoch; with ``--epochs 1`` the first epoch minus the engine's planning
  time (tracing, profiling, partitioning, the exact history pass), so one step of steady work plus
  first-call checks;
* peak memory per process: the largest resident-set growth over the run on any rank, sampled every
  10 ms (the process keeps the graph and the libraries; this is what the run itself adds).

Modes: ``graph_parallel`` (S = 1, W = P), ``gnnpipe`` (S = P, C = 4P chunks), ``hybrid`` (S = P/2
stages x W = 2 ways, 4·S chunks per way).

    python benchmarks/speed/comm_study.py --out docs/results/comm_study.json            # the full study
    python benchmarks/speed/comm_study.py --graphs tiny --procs 4 --models gcn --epochs 2  # a quick look
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

GRAPHS = {
    # Flickr's size and degree (89,250 vertices, ~900k edges, 7 classes) with community structure, as
    # real graphs have: 714 communities of ~125 vertices, 90% of edges inside. 100 input features
    # instead of Flickr's 500 (inputs are never communicated; 500 would not fit 8 processes in 24 GB).
    "flickr": dict(nodes=89_250, degree=10.0, features=100, classes=7, community=125),
    # a denser graph: average degree 50 (Flickr's is 10), communities of ~250
    "dense": dict(nodes=15_000, degree=50.0, features=100, classes=8, community=250),
    "tiny": dict(nodes=3_000, degree=10.0, features=32, classes=4, community=100),
}
MODES = ("graph_parallel", "gnnpipe", "hybrid")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _PeakRSS:
    """Samples the resident set every 10 ms in a thread; ``peak - start`` is what a run added."""

    def __enter__(self):
        self.start = self.peak = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def _malloc_trim() -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except Exception:  # noqa: BLE001 - not glibc: nothing to trim
        pass


def build_graph(name: str):
    import torch
    from torch_geometric.utils import to_torch_csr_tensor

    from pyg_pipe.graph import sbm_graph

    g = GRAPHS[name]
    data = sbm_graph(g["nodes"], num_classes=g["nodes"] // g["community"], avg_degree=g["degree"], homophily=0.9,
                     num_features=g["features"], seed=0)
    data.y = data.y % g["classes"]
    data.adj_t = to_torch_csr_tensor(data.edge_index.flip(0), size=(data.num_nodes, data.num_nodes))
    torch.manual_seed(0)
    return data


def build_model(name: str, c_in: int, hidden: int, c_out: int, layers: int):
    import torch
    from torch_geometric.nn import GCN, GraphSAGE

    from pyg_pipe.models import ResGCNPlus, gcnii

    torch.manual_seed(0)
    if name == "gcn":
        return GCN(c_in, hidden, layers, c_out)
    if name == "sage":
        return GraphSAGE(c_in, hidden, layers, c_out)
    if name == "gcnii":
        return gcnii(c_in, hidden, c_out, num_layers=layers, dropout=0.1)
    if name == "resgcn":
        return ResGCNPlus(c_in, hidden, c_out, num_layers=layers, dropout=0.1)
    raise ValueError(name)


def exchanged_widths(model: str, hidden: int, layers: int, out: int):
    """Width of the rows every propagate call exchanges with halos in one step: what the layer
    propagates. GCN propagates ``lin(x)`` (its output width: the last layer's is the class count) and
    GraphSAGE its input, and both read the input features (every rank has them) in their first layer;
    GCNII and ResGCN+ read computed values in every layer. GCNII's ``x0`` is used row by row and never
    exchanged; degrees come from the inputs."""
    if model == "gcn":
        return [hidden] * (layers - 2) + [out]
    return [hidden] * (layers - 1 if model == "sage" else layers)


def predicted(mode: str, model: str, data, P: int, args, num_params: int) -> dict:
    import torch

    from pyg_pipe.engine import gnnpipe_bytes, graph_parallel_bytes, halo_rows
    from pyg_pipe.graph import make_way_chunks

    N, d, out = data.num_nodes, args.hidden, int(data.y.max()) + 1
    carried = d if model == "gcnii" else 0
    if mode == "gnnpipe":
        return gnnpipe_bytes(N, P, d, out, carried_width=carried)
    widths = exchanged_widths(model, d, args.layers, out)
    if mode == "graph_parallel":
        perm, ptr = make_way_chunks(data.edge_index, N, P, 1, seed=0)
        return graph_parallel_bytes(N, halo_rows(data.edge_index, perm, ptr), widths, num_params, P, out)
    S, W = P // 2, 2
    cpw = 4 * S
    perm, ptr = make_way_chunks(data.edge_index, N, W, cpw, seed=0)
    fwd_halo = halo_rows(data.edge_index, perm, torch.stack([ptr[0], ptr[cpw], ptr[-1]]))
    want = graph_parallel_bytes(N, fwd_halo, widths, num_params, W, out, num_stages=S, width=d,
                                carried_width=carried)
    # backward: a halo row's gradient travels when its owner chunk ran no later than the reader, which
    # for chunks at different positions of a random order happens half the time
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(N)
    src, dst = inv[data.edge_index[0]], inv[data.edge_index[1]]
    chunk_of = torch.bucketize(torch.arange(N), ptr[1:], right=True)
    cs, cd = chunk_of[src], chunk_of[dst]
    cross = (cs // cpw) != (cd // cpw)
    pairs = torch.unique(torch.stack([cd[cross], src[cross]]), dim=1)   # (reader chunk, halo vertex)
    same_pos = (pairs[0] % cpw) == (chunk_of[pairs[1]] % cpw)
    expected_rows = float(same_pos.sum()) + 0.5 * float((~same_pos).sum())
    want["halo_backward"] = int(round(sum(widths) * expected_rows * 4))
    want["total"] = sum(v for k, v in want.items() if k != "total")
    return want


def worker(rank: int, P: int, port: int, graph: str, args, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(P), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import pyg_pipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=P)
    data = build_graph(graph)
    results = []

    class Module(pl.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            out = self.model(batch.x, batch.adj_t)
            return F.cross_entropy(out[batch.train_mask], batch.y[batch.train_mask])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    class Timer(pl.Callback):
        def __init__(self):
            self.times = []

        def on_train_batch_start(self, trainer, *a):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, *a):
            self.times.append(time.perf_counter() - self.t0)

    for model_name in args.models:
        for mode in args.modes:
            model = build_model(model_name, data.num_features, args.hidden, int(data.y.max()) + 1, args.layers)
            num_params = sum(p.numel() for p in model.parameters())
            if mode == "graph_parallel":
                strategy = pyg_pipe.GraphParallelStrategy(comm_timeout=1800)
            elif mode == "gnnpipe":
                strategy = pyg_pipe.GNNPipeStrategy(comm_timeout=1800, grid="pipeline")
            else:
                strategy = pyg_pipe.HybridStrategy(stages=P // 2, ways=2, comm_timeout=1800)
            timer = Timer()
            trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=P, max_epochs=args.epochs, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 num_sanity_val_steps=0, callbacks=[timer])
            gc.collect()
            _malloc_trim()  # hand the previous run's freed memory back, so each run starts alike
            with _PeakRSS() as mem:
                trainer.fit(Module(model), datamodule=pyg_pipe.FullGraphDataModule(data))
            plan_s = strategy.plan_seconds
            step_s = timer.times[-1] - (plan_s if len(timer.times) == 1 else 0.0)
            row = {"graph": graph, "procs": P, "model": model_name, "mode": mode, "rank": rank,
                   "epoch_s": step_s, "times": timer.times, "plan_s": plan_s, "peak_add_mb": mem.peak - mem.start,
                   "comm": strategy.comm_history[-1] if strategy.comm_history else {}}
            if rank == 0:
                row["formula"] = predicted(mode, model_name, data, P, args, num_params)
            gathered = [None] * P
            dist.all_gather_object(gathered, row)
            if rank == 0:
                merged = dict(gathered[0])
                merged["epoch_s"] = max(r["epoch_s"] for r in gathered)
                merged["plan_s"] = max(r["plan_s"] for r in gathered)
                merged["peak_add_mb"] = max(r["peak_add_mb"] for r in gathered)
                merged["peak_add_mb_ranks"] = [round(r["peak_add_mb"], 1) for r in gathered]
                results.append(merged)
                with open(path, "a") as f:
                    f.write(json.dumps(merged) + "\n")
                print(f"  {graph} P={P} {model_name:7s} {mode:15s} epoch {merged['epoch_s']:7.2f} s  "
                      f"bytes {merged['comm'].get('total', 0):>14,}  formula {merged['formula']['total']:>14,}  "
                      f"peak +{merged['peak_add_mb']:.0f} MB", flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(rows) -> str:
    lines = ["| graph | P | model | mode | bytes/epoch (measured) | formula | measured/formula | vs graph_parallel "
             "| epoch s | peak +MB/process |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    gp = {(r["graph"], r["procs"], r["model"]): r["comm"]["total"] for r in rows if r["mode"] == "graph_parallel"}
    for r in rows:
        b, w = r["comm"]["total"], r["formula"]["total"]
        base = gp.get((r["graph"], r["procs"], r["model"]))
        ratio = f"{base / b:.2f}x fewer" if base and r["mode"] != "graph_parallel" else "1"
        lines.append(f"| {r['graph']} | {r['procs']} | {r['model']} | {r['mode']} | {b:,} | {w:,} | {b / w:.4f} | "
                     f"{ratio} | {r['epoch_s']:.2f} | {r['peak_add_mb']:.0f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", nargs="+", default=["flickr", "dense"], choices=sorted(GRAPHS))
    p.add_argument("--procs", nargs="+", type=int, default=[4, 8])
    p.add_argument("--models", nargs="+", default=["gcn", "sage", "gcnii", "resgcn"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=100)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--out", default=None, help="write all rows as JSON here (and a markdown table beside it)")
    args = p.parse_args()

    import tempfile

    import torch.multiprocessing as mp

    from pyg_pipe import ops

    print(f"aggregation kernels: {ops.backend('cpu')}", flush=True)  # builds them once, before the workers start
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for graph in args.graphs:
            for P in args.procs:
                path = os.path.join(tmp, f"{graph}_{P}.jsonl")
                try:
                    mp.start_processes(worker, args=(P, _free_port(), graph, args, path), nprocs=P, join=True,
                                       start_method="spawn")
                except Exception as exc:  # noqa: BLE001 - e.g. a process killed for memory: keep what ran
                    print(f"!! {graph} P={P} stopped: {type(exc).__name__}: {exc}", flush=True)
                if os.path.exists(path):
                    with open(path) as f:
                        rows += [json.loads(line) for line in f]
    print()
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"setting": vars(args), "rows": rows}, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(table(rows) + "\n")


if __name__ == "__main__":
    main()
