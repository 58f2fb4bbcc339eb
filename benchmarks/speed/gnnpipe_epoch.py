"""GNNPipe against single-process PyG and against graph_parallel: epoch time, peak memory and communication,
side by side.

Default setting: a 32-layer GCNII, hidden 64, on a generated 50,000-vertex graph with about
1,000,000 edges (``--graph community``: 400 communities with 90% of edges inside, or ``--graph random``:
8 random blocks); gnnpipe on 2 processes with one thread each (``strategy="gnnpipe"`` through a real
Lightning Trainer) against one process with two threads running plain PyG on its fastest path (a
torch.sparse CSR adjacency, ``cached=True`` normalisation) and against ``strategy="graph_parallel"`` on
the same 2 processes. Every configuration runs in fresh processes, one after the other, in one
invocation, and the ratios are printed at the end.

    python benchmarks/speed/gnnpipe_epoch.py                       # the full setting (about 10 minutes)
    python benchmarks/speed/gnnpipe_epoch.py --model resgcn --graph random --procs 4 --chunks 16   # ResGCN+ (or gcn)
    python benchmarks/speed/gnnpipe_epoch.py --nodes 5000 --degree 20 --layers 8 --epochs 3   # a quick look
    python benchmarks/speed/gnnpipe_epoch.py --input edge_index --fused-kernels 0   # edge_index, PyG's aggregation

Epoch time = one optimizer step on the whole graph (forward, loss, backward, step), median over the
second half of the epochs (the first plans the pipeline, partitions the graph and fills the history,
and the next few still warm up allocator and caches); for gnnpipe, measured on rank 0, which finishes last.
Memory = peak resident set size of each process; "net" subtracts the resident size measured after
imports and graph generation, which both setups pay alike.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


CUDA = False  # --device cuda: times after a device synchronize, memory = the CUDA allocator's (set in main)




def _chunks_arg(value: str):
    return value if value == "auto" else int(value)

def _default_snapshot_period() -> int:
    import inspect
    from pyg_pipe.strategies.gnnpipe import GNNPipeStrategy
    return inspect.signature(GNNPipeStrategy).parameters["snapshot_period"].default

def rss_mb() -> float:
    """Memory held now: resident set size (CPU) or what the CUDA allocator holds."""
    if CUDA:
        import torch
        return torch.cuda.memory_allocated() / 2**20
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    """Peak so far: of the resident set size (CPU) or of the CUDA allocator."""
    if CUDA:
        import torch
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def now() -> float:
    if CUDA:
        import torch
        torch.cuda.synchronize()
    return time.perf_counter()


def build(args):
    import torch
    from torch_geometric.utils import to_torch_csr_tensor

    from pyg_pipe.graph import sbm_graph
    from torch_geometric.nn import GCN

    from pyg_pipe.models import ResGCNPlus, gcnii

    if args.graph == "community":
        # many small communities (locality, as in real graphs): 90% of edges inside a community of ~125
        data = sbm_graph(args.nodes, num_classes=max(args.nodes // 125, args.classes), avg_degree=args.degree,
                         homophily=0.9, num_features=args.features, seed=0)
        data.y = data.y % args.classes
    else:
        # 8 large random blocks: no locality beyond the classes (worst case for chunking)
        data = sbm_graph(args.nodes, num_classes=args.classes, avg_degree=args.degree,
                         num_features=args.features, seed=0)
    data.adj_t = to_torch_csr_tensor(data.edge_index.flip(0), size=(data.num_nodes, data.num_nodes))
    torch.manual_seed(0)
    if args.model == "gcnii":
        model = gcnii(args.features, args.hidden, args.classes, num_layers=args.layers, dropout=0.0, cached=True)
    elif args.model == "gcn":
        model = GCN(args.features, args.hidden, args.layers, args.classes, cached=True)
    else:
        model = ResGCNPlus(args.features, args.hidden, args.classes, num_layers=args.layers, dropout=0.0,
                           cached=True)
    return data, model


def run_single(args) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads_single)
    data, model = build(args)
    if CUDA:
        data, model = data.to("cuda"), model.to("cuda")
    base = rss_mb()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    times, losses = [], []
    if args.kernels:  # plain PyG with pyg_pipe's fused CSR kernels routed in (as the strategies do)
        from pyg_pipe.ops import fuse_messages, install as install_kernels
        install_kernels()
        fuse_messages(model)
    graph = data.adj_t if args.input == "adj_t" else data.edge_index
    for _ in range(args.epochs):
        t0 = now()
        out = model(data.x, graph)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(now() - t0)
        losses.append(loss.item())
    return {"times": times, "peak_mb": peak_mb(), "base_mb": base, "losses": losses}


def node_classifier(model, graph: str = "adj_t"):
    """The benchmarks' LightningModule: cross-entropy on the training vertices, Adam at 0.01; the model is
    given ``batch.adj_t`` or ``batch.edge_index`` (``graph``)."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    class NodeClassifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            out = self.model(batch.x, batch.adj_t if graph == "adj_t" else batch.edge_index)
            return F.cross_entropy(out[batch.train_mask], batch.y[batch.train_mask])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    return NodeClassifier()


def run_pipe(args) -> None:
    import lightning.pytorch as pl
    import torch

    import pyg_pipe

    torch.set_num_threads(1)
    data, model = build(args)
    base = rss_mb()

    class Timer(pl.Callback):
        times, losses, hwm = [], [], []  # hwm: the process's peak so far after setup and after each step
        sizes = None                      # layer groups per stage (the plan's split)
        chunks, notes = None, []          # the plan's chunk count, and what num_chunks='auto' said

        def on_train_start(self, trainer, *a):
            self.hwm.append(peak_mb())

        def on_train_batch_start(self, trainer, *a):
            self.t0 = now()

        def on_train_batch_end(self, trainer, pl_module, outputs, *a):
            self.times.append(now() - self.t0)
            self.losses.append(float(outputs["loss"]))
            self.hwm.append(peak_mb())
            engine = getattr(trainer.strategy, "engine", None)
            if self.sizes is None and engine is not None and engine.plan is not None and engine.plan.sizes:
                self.sizes = list(engine.plan.sizes)
            if engine is not None and engine.plan is not None:
                self.chunks = engine.plan.num_chunks
                said = ("num_chunks='auto'", "recompute='auto'", "grid='auto'")
                self.notes = [n for n in engine.notes if any(k in n for k in said)]

    memory = dict(recompute={"on": True, "off": False}.get(args.recompute, "auto"),
                  history_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.history_dtype),
                  offload=None if args.offload == "none" else args.offload,
                  offload_budget=None if args.offload_budget < 0 else args.offload_budget,
                  memory_budget=None if args.memory_budget < 0 else args.memory_budget)
    fused = dict(fused_kernels=bool(args.fused_kernels))
    if args.strategy == "graph_parallel":
        strategy = pyg_pipe.GraphParallelStrategy(**fused)
    elif args.strategy == "hybrid":
        strategy = pyg_pipe.HybridStrategy(stages=2, ways=args.procs // 2, num_chunks=args.chunks,
                                           snapshot_period=args.snapshot_period or None, **memory, **fused)
    else:
        strategy = pyg_pipe.GNNPipeStrategy(num_chunks=args.chunks, grid=args.grid,
                                            snapshot_period=args.snapshot_period or None, timeline_trace=args.trace or None, **memory, **fused)
    timer = Timer()
    trainer = pl.Trainer(strategy=strategy, accelerator="gpu" if CUDA else "cpu", devices=args.procs, max_epochs=args.epochs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[timer])
    trainer.fit(node_classifier(model, args.input), datamodule=pyg_pipe.FullGraphDataModule(data))
    rank = trainer.global_rank
    out = {"rank": rank, "times": timer.times, "sizes": timer.sizes, "chunks": timer.chunks, "notes": timer.notes, "losses": timer.losses, "hwm_mb": timer.hwm, "peak_mb": peak_mb(),
           "base_mb": base, "plan_check": getattr(strategy, "plan_check", None),
           "memory_check": getattr(strategy, "memory_check", None),
           "comm": strategy.comm_history[-1] if strategy.comm_history else {},
           "timeline": {k[5:]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("time/")}}
    with open(f"{args.json}.rank{rank}", "w") as f:
        json.dump(out, f)


def launch(args, mode: str, **extra) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode]
    for k in ("graph", "model", "nodes", "degree", "features", "classes", "layers", "hidden", "epochs", "procs",
              "threads_single", "snapshot_period", "trace", "device", "input", "fused_kernels", "history_dtype",
              "grid"):
        if hasattr(args, k):  # a caller without the option (benchmarks/memory/memory.py) gets the worker's default
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ, OMP_NUM_THREADS="1" if mode == "pipe" else str(args.threads_single))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{out.stderr[-4000:]}")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph", choices=["community", "random"], default="community",
                   help="community: 400 communities, 90%% of edges inside (locality like real graphs); "
                        "random: 8 random blocks, 80%% inside (no locality within a block)")
    p.add_argument("--nodes", type=int, default=50_000)
    p.add_argument("--degree", type=float, default=20.0)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--model", choices=["gcnii", "gcn", "resgcn"], default="gcnii",
                   help="gcnii: GCN2Conv layers; gcn: PyG's GCN; resgcn: ResGCN+ (DeepGCNLayer res+ around GCNConv)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--threads-single", dest="threads_single", type=int, default=2)
    p.add_argument("--chunks", type=_chunks_arg, nargs="+", default=[1, 4, 8],
                   help="chunk counts to run, or 'auto' (num_chunks='auto': the plan's cost model chooses)")
    p.add_argument("--snapshot-period", dest="snapshot_period", type=int, default=_default_snapshot_period(),
                   help="GNNPipeStrategy(snapshot_period=...), default: the strategy's; 0 turns snapshots off")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--worker", choices=["single", "pipe"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--grid", choices=["pipeline", "auto"], default="pipeline",
                   help="GNNPipeStrategy(grid=...): one stage a process, or chosen by the cost model")
    p.add_argument("--strategy", choices=["gnnpipe", "graph_parallel", "hybrid"], default="gnnpipe",
                   help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--history-dtype", dest="history_dtype", choices=["none", "bf16", "fp16"], default="none",
                   help="GNNPipeStrategy(history_dtype=...)")
    p.add_argument("--recompute", choices=["auto", "on", "off"], default="auto",
                   help="GNNPipeStrategy(recompute=...)")
    p.add_argument("--memory-budget", dest="memory_budget", type=int, default=-1,
                   help="GNNPipeStrategy(memory_budget=...) in bytes (-1: None)")
    p.add_argument("--offload", choices=["none", "host", "disk"], default="none",
                   help="GNNPipeStrategy(offload=...)")
    p.add_argument("--offload-budget", "--offload_budget", dest="offload_budget", type=int, default=-1,
                   help="GNNPipeStrategy(offload_budget=...) in bytes (-1: None)")
    p.add_argument("--kernels", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--input", choices=["adj_t", "edge_index"], default="adj_t",
                   help="the graph the models are given: a torch.sparse CSR adj_t (PyG's fastest path, the default) "
                        "or an edge_index (what most PyG examples pass)")
    p.add_argument("--fused-kernels", dest="fused_kernels", type=int, default=1,
                   help="the strategies' fused_kernels knob (0: PyG's own aggregation in gnnpipe / graph_parallel)")
    p.add_argument("--trace", default="", help="gnnpipe runs write their Chrome trace here (timeline_trace=...)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: every process on its own GPU (NCCL; --procs at most the GPU count; 1 process "
                        "with chunks streams on one GPU), times after a synchronize, memory = CUDA allocator peaks")
    p.add_argument("--bandwidth", type=float, default=0,
                   help="simulated link in bytes/s for every pyg_pipe process (PYG_PIPE_SIMULATED_BANDWIDTH; "
                        "0: loopback as it is)")
    args = p.parse_args()
    global CUDA
    CUDA = args.device == "cuda"
    if args.bandwidth:
        os.environ["PYG_PIPE_SIMULATED_BANDWIDTH"] = str(args.bandwidth)

    if args.worker == "single":
        print(json.dumps(run_single(args)))
        return
    if args.worker == "pipe":
        args.chunks = args.chunks[0]
        run_pipe(args)
        return

    import statistics

    from pyg_pipe.engine import gnnpipe_bytes

    def med(ts):  # steady state: the second half of the epochs (allocator and caches warmed up)
        return statistics.median(ts[len(ts) // 2:])

    results = {"setting": {k: getattr(args, k) for k in ("graph", "model", "nodes", "degree", "features", "classes", "layers",
                                                         "hidden", "epochs", "procs", "threads_single", "snapshot_period",
                                                         "input", "fused_kernels", "grid")}}
    single = json.loads(launch(args, "single").stdout.strip().splitlines()[-1])
    results["single"] = single
    single_k = json.loads(launch(args, "single", kernels=1).stdout.strip().splitlines()[-1])
    results["single_kernels"] = single_k
    t_single_k = med(single_k["times"])
    t_single, m_single = med(single["times"]), single["peak_mb"]
    net_single = single["peak_mb"] - single["base_mb"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "graph_parallel")
        launch(args, "pipe", chunks=args.procs, json=path, strategy="graph_parallel")
        ranks = [json.load(open(f"{path}.rank{r}")) for r in range(args.procs)]
        results["graph_parallel"] = ranks
        t_gp = med(ranks[0]["times"])
        m_gp = max(r["peak_mb"] for r in ranks)
        net_gp = max(r["peak_mb"] - r["base_mb"] for r in ranks)
        for c in args.chunks:
            path = os.path.join(tmp, f"pipe{c}")
            launch(args, "pipe", chunks=c, json=path, recompute=args.recompute, offload=args.offload,
                   offload_budget=args.offload_budget, memory_budget=args.memory_budget)
            ranks = [json.load(open(f"{path}.rank{r}")) for r in range(args.procs)]
            results[f"gnnpipe_c{c}"] = ranks
            t = med(ranks[0]["times"])
            peak = max(r["peak_mb"] for r in ranks)
            net = max(r["peak_mb"] - r["base_mb"] for r in ranks)
            comm = ranks[0]["comm"]
            want = gnnpipe_bytes(args.nodes, args.procs, width=args.hidden, out_width=args.classes,
                                 carried_width=args.hidden if args.model == "gcnii" else 0)  # GCNII carries x0
            if c == "auto":
                c = f"auto:{ranks[0]['chunks']}"
                results["auto_notes"] = ranks[0]["notes"]
                results.setdefault("auto_checks", []).append(ranks[0]["plan_check"])
                print(*ranks[0]["notes"], sep="\n", flush=True)
            rows.append((c, t, t / t_single, peak, peak / m_single, net, net / max(net_single, 1e-9),
                         comm.get("total", 0), want["total"], t / t_single_k))
            tl = ranks[0].get("timeline", {})
            if tl:
                from pyg_pipe.engine.runtime.timeline import bubble_share
                results[f"timeline_c{c}"] = tl
                print(f"gnnpipe, {c} chunks, per step (the largest over the ranks): compute {tl['compute']:.3f} s, "
                      f"wait {tl['wait']:.3f} s, bubble {tl['bubble']:.3f} s; bubble share {tl['bubble_share']:.3f} "
                      f"(GPipe formula (S-1)/(C+S-1) = {bubble_share(args.procs, int(str(c).split(':')[-1])):.3f})",
                      flush=True)
    print(f"\nsetting: {results['setting']}")
    graph = "sparse CSR" if args.input == "adj_t" else "edge_index"
    print(f"single process ({args.threads_single} threads, {graph}, cached): epoch {t_single:.3f} s, "
          f"peak {m_single:.0f} MB (net {net_single:.0f} MB); with pyg_pipe's fused kernels: epoch {t_single_k:.3f} s")
    print(f"graph_parallel ({args.procs} processes x 1 thread): epoch {t_gp:.3f} s ({t_gp / t_single:.2f} x single), "
          f"worst peak {m_gp:.0f} MB (net {net_gp:.0f} MB, {net_gp / max(net_single, 1e-9):.2f} x single net); "
          f"{t_gp / t_single_k:.2f} x single with kernels")
    print(f"{'chunks':>6} {'epoch s':>8} {'time ratio':>10} {'vs gp':>6} {'vs 1+k':>6} {'peak MB':>8} {'mem ratio':>9} "
          f"{'net MB':>7} {'net ratio':>9} {'vs gp':>6} {'bytes/epoch':>12} {'formula':>12}")
    for c, t, tr, pk, mr, net, nr, b, w, tk in rows:
        print(f"{c:>6} {t:>8.3f} {tr:>10.2f} {t / t_gp:>6.2f} {tk:>6.2f} {pk:>8.0f} {mr:>9.2f} {net:>7.0f} {nr:>9.2f} "
              f"{net / max(net_gp, 1e-9):>6.2f} {b:>12,} {w:>12,}")
    results["graph_parallel_summary"] = {"epoch_s": t_gp, "peak_mb": m_gp, "net_mb": net_gp}
    results["rows"] = [dict(zip(("chunks", "epoch_s", "time_ratio", "peak_mb", "mem_ratio", "net_mb", "net_ratio",
                                 "bytes", "formula_bytes", "time_ratio_single_kernels"), r)) for r in rows]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
