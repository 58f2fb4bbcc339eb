"""Convergence under staleness: accuracy per epoch of gnnpipe with and without the GNNPipe tricks, with a
staleness bound, against the same model trained by plain PyG in one process.

Each case trains a model from the same initial weights (one seed per repeat) on a generated graph and
records, every epoch, the training loss, validation and test accuracy (inference is exact in pyg_pipe,
so the curves show what the historical embeddings did to training), the staleness meter's
``max_drift`` and the refreshes a bound asked for; the summary is the test accuracy at the epoch of
best validation accuracy, mean ± spread (min .. max) over the seeds, and its difference from one
process. graph_parallel is not run: it is exact (equal to one process within 1e-5, tested), so its
curves are the one-process ones.

Modes (``PipelineConfig`` knobs; T1 = chunk shuffling, T2 = snapshots every 11 steps (23
before 2026-11-26: the tables of docs/convergence.md measured before then say so), T3 = unbiased
gradient scaling)::

    t1-t3     the defaults
    none      shuffle_chunks=False, snapshot_period=None, unbiased_gradients=False
    t1 / t2 / t3   one trick alone
    noT3      the defaults without T3 (unbiased_gradients=False: T1 and T2 on)
    noT2      the defaults without T2 (snapshot_period=None: stale reads one update old, T1 and T3 on)
    independent    the defaults with each step's chunk order drawn alone (shuffle_chunks="independent", GNNPipe's
              T1 and the default until 2026-11-29) instead of in pairs (an order, then its reverse)
    bound     the defaults and max_staleness=0.1 (refresh when a step's drift passes 10 %; with dropout,
              since 2026-11-26, when the probes' drift per update times the age of the next step's reads
              does: runtime/staleness.py); bound0.03 / bound0.3 the same with 0.03 / 0.3
    age0      the defaults and max_age=0 (history refreshed before every step: exact forwards)
    age1 / age2 / age5 / age11   the defaults and max_age=k (an exact refresh at least every k+1 steps)
    age2-noT2 / age1-noT3 / age1-noT1   max_age with one trick off (probes of the max_age result in docs)
    age0-noT3      max_age=0 without T3 (a probe of the max_age=0 result in docs)
    late      the defaults and late_gradients=True (stale reads' gradients reach their owners next step;
              no T3 scaling then); late-noT1 the same without shuffling; age0-late with max_age=0
    period5 / period11   the defaults with snapshot_period=5 / 11 (measured against the old default 23)
    hist-bf16 the defaults and history_dtype=torch.bfloat16 (historical rows kept in bf16)
    smooth    the defaults and smoothing=0.5 (stale rows read as a moving average over steps, PipeGCN)
    smooth-none    smoothing=0.5 without T1-T3 (PipeGCN's setting)
    bn-chunk  the defaults and per_chunk_statistics=True (each chunk's own statistics)
    bn-history     the defaults and per_chunk_statistics="history" (the whole graph's, other chunks'
              sums from their latest run); the bn-* modes are for the models gcn-bn, gcn-gn, gcn-ln, gcn-pn,
              gcn-in (PyG's GCN with norm="batch_norm" / "graph_norm" / graph-mode "layer_norm" / "pairnorm" /
              "instance_norm"), which the other modes refuse

Models: gcnii, resgcn, gat (the study's), gcn-* (a graph-wide norm after every layer, above), gcn (PyG's GCN)
and tutorial-gcn (the same network with the same initial weights, built from PyG's tutorial GCN layer, its
degrees counted by hand).

All gnnpipe cases of one invocation run in the same 2 (``--procs``) processes, one after the other;
the one-process references run first, in this process with 2 threads.

    python benchmarks/convergence/convergence.py --out docs/results/convergence.json            # the default sweep
    python benchmarks/convergence/convergence.py --models gcnii --graphs community --chunks 8 --seeds 0 --epochs 20
    python benchmarks/plots.py convergence docs/results/convergence.json docs/img/convergence.png
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

DROPOUT = float(os.environ.get("PYG_PIPE_BENCH_DROPOUT", 0.1))  # of every model (the study: 0.1)

MODES = {
    "t1-t3": {},
    "none": dict(shuffle_chunks=False, snapshot_period=None, unbiased_gradients=False),
    "t1": dict(snapshot_period=None, unbiased_gradients=False),
    "t2": dict(shuffle_chunks=False, unbiased_gradients=False),
    "t3": dict(shuffle_chunks=False, snapshot_period=None),
    "noT3": dict(unbiased_gradients=False),
    "noT2": dict(snapshot_period=None),
    "independent": dict(shuffle_chunks="independent"),
    "bound": dict(max_staleness=0.1),
    "bound0.03": dict(max_staleness=0.03),
    "bound0.3": dict(max_staleness=0.3),
    "age0": dict(max_age=0),
    "age0-noT3": dict(max_age=0, unbiased_gradients=False),
    "age1": dict(max_age=1),
    "age2": dict(max_age=2),
    "age2-noT2": dict(max_age=2, snapshot_period=None),
    "age1-noT3": dict(max_age=1, unbiased_gradients=False),
    "age1-noT1": dict(max_age=1, shuffle_chunks=False),
    "age5": dict(max_age=5),
    "age11": dict(max_age=11),
    "late": dict(late_gradients=True),
    "late-noT1": dict(late_gradients=True, shuffle_chunks=False),
    "age0-late": dict(max_age=0, late_gradients=True),
    "smooth": dict(smoothing=0.5),
    "smooth-none": dict(shuffle_chunks=False, snapshot_period=None, unbiased_gradients=False, smoothing=0.5),
    "period5": dict(snapshot_period=5),
    "period11": dict(snapshot_period=11),
    "hist-bf16": dict(history_dtype=torch.bfloat16),
    "bn-chunk": dict(per_chunk_statistics=True),
    "bn-history": dict(per_chunk_statistics="history"),
}


def graph(name: str, nodes: int):
    from pyg_pipe.graph import sbm_graph
    if name == "community":  # many small communities, as real graphs have (chunks keep most edges inside)
        data = sbm_graph(nodes, num_classes=max(nodes // 100, 8), avg_degree=10, homophily=0.8, num_features=32,
                         feature_noise=1.5, seed=0)
        data.y = data.y % 8
    else:  # heterophilous: most edges join different classes
        data = sbm_graph(nodes, num_classes=8, avg_degree=10, homophily=0.2, num_features=32, feature_noise=1.0,
                         seed=0)
    return data


#: PyG's GCN with a graph-wide norm after every layer: the norm and its arguments (PyG's normalization resolver)
NORMS = {"gcn-bn": ("batch_norm", None), "gcn-gn": ("graph_norm", None), "gcn-ln": ("layer_norm", {"mode": "graph"}),
         "gcn-pn": ("pairnorm", None), "gcn-in": ("instance_norm", None)}


class TutorialGCN(torch.nn.Module):
    """A stack of PyG's tutorial GCN layer (:class:`pyg_pipe.models.TutorialGCNConv`), ReLU and dropout between
    layers (as PyG's GCN)."""

    def __init__(self, layers: int):
        from pyg_pipe.models import TutorialGCNConv
        super().__init__()
        widths = [32] + [64] * (layers - 1) + [8]
        self.convs = torch.nn.ModuleList([TutorialGCNConv(i, o) for i, o in zip(widths, widths[1:])])

    def forward(self, x, edge_index):
        for conv in self.convs[:-1]:
            x = F.dropout(conv(x, edge_index).relu(), DROPOUT, self.training)
        return self.convs[-1](x, edge_index)


class _LinearsAround(torch.nn.Module):
    """PyG's examples' shape of a propagation between two linear maps (``agnn.py``, ``citation/appnp.py``): dropout,
    ``lin1``, ReLU, the ``props`` (each a layer on ``(x, edge_index)``), dropout, ``lin2``."""

    def __init__(self, hidden: int, props, dropout: float):
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(32, hidden), torch.nn.Linear(hidden, 8)
        self.props, self.dropout = torch.nn.ModuleList(props), dropout

    def forward(self, x, edge_index):
        x = F.relu(self.lin1(F.dropout(x, self.dropout, self.training)))
        for prop in self.props:
            x = prop(x, edge_index)
        return self.lin2(F.dropout(x, self.dropout, self.training))


class _TwoConvs(torch.nn.Module):
    """PyG's examples' two-layer shape (``arma.py``, ``tagcn.py``): dropout, conv, ReLU, dropout, conv."""

    def __init__(self, first, second, dropout: float = 0.5):
        super().__init__()
        self.conv1, self.conv2, self.dropout = first, second, dropout

    def forward(self, x, edge_index):
        x = F.relu(self.conv1(F.dropout(x, self.dropout, self.training), edge_index))
        return self.conv2(F.dropout(x, self.dropout, self.training), edge_index)


class _RevBlock(torch.nn.Module):
    """``rev_gnn.py``'s block: LayerNorm, ReLU, the mask shared by every block (dropout drawn once a step), SAGE."""

    def __init__(self, channels: int):
        super().__init__()
        from torch_geometric.nn import SAGEConv
        self.norm, self.conv = torch.nn.LayerNorm(channels), SAGEConv(channels, channels)

    def forward(self, x, edge_index, mask=None):
        x = self.norm(x).relu()
        return self.conv(x if mask is None else x * mask, edge_index)


class _RevGNN(torch.nn.Module):
    """``rev_gnn.py``'s RevGNN: ``lin1``, reversible blocks (PyG's ``GroupAddRev``, 2 groups, inputs rebuilt in the
    backward) sharing one dropout mask, LayerNorm, ReLU, dropout, ``lin2`` (the example: hidden 160, 7 layers,
    dropout 0.5)."""

    def __init__(self, hidden: int = 160, layers: int = 7, dropout: float = 0.5, groups: int = 2):
        super().__init__()
        from torch_geometric.nn import GroupAddRev
        self.lin1, self.lin2 = torch.nn.Linear(32, hidden), torch.nn.Linear(hidden, 8)
        self.norm, self.dropout = torch.nn.LayerNorm(hidden), dropout
        self.convs = torch.nn.ModuleList(GroupAddRev(_RevBlock(hidden // groups), num_groups=groups)
                                         for _ in range(layers))

    def forward(self, x, edge_index):
        x = self.lin1(x)
        mask = None
        if self.training and self.dropout > 0:
            mask = torch.zeros_like(x).bernoulli_(1 - self.dropout) / (1 - self.dropout)
        for conv in self.convs:
            x = conv(x, edge_index, mask)
        x = F.dropout(self.norm(x).relu(), self.dropout, self.training)
        return self.lin2(x)


class _GeniePathLayer(torch.nn.Module):
    """``geniepath.py``'s layer: breadth (a one-head GAT, tanh), then depth (an LSTM step over the vertices as its
    batch, its state ``(1, N, d)`` carried from layer to layer)."""

    def __init__(self, dim: int):
        super().__init__()
        from torch_geometric.nn import GATConv
        self.breadth, self.depth = GATConv(dim, dim, heads=1), torch.nn.LSTM(dim, dim, 1, bias=False)

    def forward(self, x, edge_index, h, c):
        x = torch.tanh(self.breadth(x, edge_index))
        x, (h, c) = self.depth(x[None, :], (h, c))
        return x[0], h, c


class _GeniePath(torch.nn.Module):
    """``geniepath.py``'s GeniePath: ``lin1``, 4 breadth-depth layers of width 256, ``lin2`` (no dropout)."""

    def __init__(self, dim: int = 256, layers: int = 4):
        super().__init__()
        self.lin1, self.lin2, self.dim = torch.nn.Linear(32, dim), torch.nn.Linear(dim, 8), dim
        self.layers = torch.nn.ModuleList(_GeniePathLayer(dim) for _ in range(layers))

    def forward(self, x, edge_index):
        x = self.lin1(x)
        h = torch.zeros(1, x.size(0), self.dim, device=x.device)
        c = torch.zeros(1, x.size(0), self.dim, device=x.device)
        for layer in self.layers:
            x, h, c = layer(x, edge_index, h, c)
        return self.lin2(x)


class _MixHop(torch.nn.Module):
    """``mixhop.py``'s MixHop: dropout 0.7 on the features, three ``MixHopConv`` layers (powers 0, 1, 2; 60 each)
    with a BatchNorm after each and dropout 0.9, then a linear map (a graph-wide norm: with chunks, its statistics
    from history by default)."""

    def __init__(self):
        super().__init__()
        from torch_geometric.nn import BatchNorm, MixHopConv
        self.convs = torch.nn.ModuleList([MixHopConv(32, 60, powers=[0, 1, 2]), MixHopConv(180, 60, powers=[0, 1, 2]),
                                          MixHopConv(180, 60, powers=[0, 1, 2])])
        self.norms = torch.nn.ModuleList(BatchNorm(180) for _ in range(3))
        self.lin = torch.nn.Linear(180, 8)

    def forward(self, x, edge_index):
        x = F.dropout(x, 0.7, self.training)
        for conv, norm in zip(self.convs, self.norms):
            x = F.dropout(norm(conv(x, edge_index)), 0.9, self.training)
        return self.lin(x)


def pyg_example(name: str):
    """The models of PyG's node-classification examples as the examples build them (their widths, depths and
    dropouts; 32 features in, 8 classes out for the generated graph)."""
    from torch_geometric import nn as gnn
    if name == "pyg-gcn":      # gcn.py
        return gnn.GCN(32, 16, 2, 8, dropout=0.5)
    if name == "pyg-gat":      # gat.py: 8 heads of 8, then one head
        return gnn.GAT(32, 64, 2, 8, heads=8, dropout=0.6)
    if name == "pyg-sage":     # graph_sage_unsup-like full-graph SAGE
        return gnn.GraphSAGE(32, 64, 2, 8, dropout=0.5)
    if name == "pyg-appnp":    # citation/appnp.py: K = 10, alpha = 0.1
        return _LinearsAround(64, [gnn.APPNP(10, 0.1)], 0.5)
    if name == "pyg-agnn":     # agnn.py: a fixed and a learned attention temperature
        return _LinearsAround(16, [gnn.AGNNConv(requires_grad=False), gnn.AGNNConv(requires_grad=True)], 0.5)
    if name == "pyg-arma":     # arma.py
        return _TwoConvs(gnn.ARMAConv(32, 16, num_stacks=3, num_layers=2, shared_weights=True, dropout=0.25),
                         gnn.ARMAConv(16, 8, num_stacks=3, num_layers=2, shared_weights=True, dropout=0.25,
                                      act=lambda x: x))
    if name == "pyg-tag":      # tagcn.py
        return _TwoConvs(gnn.TAGConv(32, 16), gnn.TAGConv(16, 8))
    if name == "pyg-sgc":      # sgc.py: the layer itself as the model
        return gnn.SGConv(32, 8, K=2)
    if name == "pyg-revgnn":   # rev_gnn.py: reversible SAGE blocks, 7 layers of 160
        return _RevGNN()
    if name == "pyg-geniepath":  # geniepath.py: GAT breadth, LSTM depth, 4 layers of 256
        return _GeniePath()
    if name == "pyg-mixhop":   # mixhop.py: three MixHop layers with BatchNorm
        return _MixHop()
    if name == "pyg-gcnii":    # gcn2_cora.py: 64 layers, alpha 0.1, theta 0.5, dropout 0.6
        from pyg_pipe.models import gcnii
        return gcnii(32, 64, 8, num_layers=64, alpha=0.1, theta=0.5, dropout=0.6)
    raise ValueError(name)


PYG_EXAMPLES = ["pyg-gcn", "pyg-gat", "pyg-sage", "pyg-appnp", "pyg-agnn", "pyg-arma", "pyg-tag", "pyg-sgc",
                "pyg-gcnii", "pyg-revgnn", "pyg-geniepath", "pyg-mixhop"]


class _LearnedInputs(torch.nn.Module):
    """Featureless node classification: a learned input per vertex (``nn.Parameter(num_nodes, 32)``, no embedding
    module) in place of the features, into PyG's GCN: each chunk sees its rows of it (docs/models.md)."""

    def __init__(self, num_nodes: int, layers: int):
        super().__init__()
        from torch_geometric.nn import GCN
        self.node_emb = torch.nn.Parameter(0.1 * torch.randn(num_nodes, 32))
        self.gcn = GCN(32, 64, layers, 8, dropout=DROPOUT)

    def forward(self, x, edge_index):  # (x unused: the graph's features are left out)
        return self.gcn(self.node_emb, edge_index)


def model(name: str, layers: int, seed: int, num_nodes: int = 0):
    from torch_geometric.nn import GAT, GCN

    from pyg_pipe.models import ResGCNPlus, gcnii
    torch.manual_seed(seed)
    if name in PYG_EXAMPLES:
        return pyg_example(name)
    if name == "gcn-learned-inputs":
        return _LearnedInputs(num_nodes, layers)
    if name == "gcnii":
        return gcnii(32, 64, 8, num_layers=layers, dropout=DROPOUT)
    if name == "resgcn":
        return ResGCNPlus(32, 64, 8, num_layers=layers, dropout=DROPOUT)
    if name in ("gcn", "tutorial-gcn"):  # the same network and weights, with PyG's GCNConv or the tutorial's layer
        net = GCN(32, 64, layers, 8, dropout=DROPOUT)
        if name == "gcn":
            return net
        tutorial = TutorialGCN(layers)
        tutorial.load_state_dict(net.state_dict())
        return tutorial
    if name in NORMS:  # a graph-wide norm after every layer (modes bn-chunk, bn-history)
        norm, kwargs = NORMS[name]
        if norm == "pairnorm":  # (by name, PyG's resolver would pass the width as PairNorm's scale)
            from torch_geometric.nn import PairNorm
            norm = PairNorm()
        return GCN(32, 64, layers, 8, norm=norm, norm_kwargs=kwargs, dropout=DROPOUT)
    return GAT(32, 16, min(layers, 8), 8, heads=4, dropout=DROPOUT)  # attention over (stale) neighbours


def accuracies(out, data):
    pred = out.argmax(-1)
    return [float((pred[m] == data.y[m]).float().mean()) for m in (data.val_mask, data.test_mask)]


def train(net, data, epochs: int, engine=None):
    opt = torch.optim.Adam(net.parameters(), lr=0.005)
    curve = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        net.train()
        out = net(data.x, data.edge_index)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        seconds = time.perf_counter() - t0
        net.eval()
        with torch.no_grad():
            val, test = accuracies(net(data.x, data.edge_index), data)
        row = {"loss": float(loss), "val": val, "test": test, "seconds": seconds}
        if engine is not None:
            taken = engine.meter.take()
            row["drift"] = max((s for e in taken for s in _drifts(e)), default=0.0)
            row["refreshes"] = engine.meter.refreshes
        curve.append(row)
    return curve


def _drifts(entry):
    return [(d / f) ** 0.5 if f > 0 else 0.0 for d, f in entry["sites"].values()]


def _worker(rank, world, args, cases):
    import torch.distributed as dist

    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
    results = []
    for m, g, chunks, mode, seed in cases:
        data = graph(g, args.nodes)
        net = model(m, args.layers, seed, data.num_nodes)
        cfg = PipelineConfig(num_chunks=chunks, balance="layers", seed=seed, grid=args.grid, **MODES[mode])
        # (grid "auto": the grid chosen; PyG's examples: the strategy's own grid, which adds ways for a model with
        # fewer layers than processes)
        engine = GNNPipeEngine(net, cfg, Comm(torch.device("cpu"), timeout=600),
                               num_stages=None if args.grid == "auto" or m in PYG_EXAMPLES else world)
        engine.install()
        torch.manual_seed(seed + 1)
        curve = train(net, data, args.epochs, engine)
        engine.uninstall()
        # the drift is per rank (each holds its stage's sites): the largest over the ranks
        drifts = torch.tensor([r["drift"] for r in curve], dtype=torch.float64)
        dist.all_reduce(drifts, op=dist.ReduceOp.MAX)
        for r, d in zip(curve, drifts.tolist()):
            r["drift"] = d
        results.append({"model": m, "graph": g, "chunks": chunks, "mode": mode, "seed": seed, "curve": curve,
                        "chose": engine.plan.num_chunks, "grid": [engine.plan.stages, engine.plan.ways]})
        if rank == 0:
            print(f"{m} {g} {chunks} chunks (ran {engine.plan.num_chunks} on {engine.plan.stages} x {engine.plan.ways}) "
                  f"{mode} seed {seed}: {summary(curve)[0]:.3f}", flush=True)
    if rank == 0:
        with open(args.tmp, "w") as f:
            json.dump(results, f)


def summary(curve):
    """(test accuracy at the best validation epoch, that epoch)."""
    best = max(range(len(curve)), key=lambda i: (curve[i]["val"], -i))
    return curve[best]["test"], best


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gcnii", "gat"],
                   choices=["gcnii", "resgcn", "gat", "gcn-bn", "gcn-gn", "gcn-ln", "gcn-pn", "gcn-in", "gcn",
                            "tutorial-gcn", "gcn-learned-inputs", *PYG_EXAMPLES])
    p.add_argument("--graphs", nargs="+", default=["community", "heterophilous"])
    p.add_argument("--chunks", nargs="+", type=lambda v: v if v == "auto" else int(v), default=[32],
                   help="chunk counts, or auto (num_chunks='auto': the plan's choice, recorded as 'chose')")
    p.add_argument("--modes", nargs="+", default=["t1-t3", "none", "bound"], choices=list(MODES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--nodes", type=int, default=3000)
    p.add_argument("--layers", type=int, default=16, help="GCNII / ResGCN+ layers (GAT: at most 8)")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--grid", choices=["pipeline", "auto"], default="pipeline",
                   help="the rank grid: one stage a process, or chosen by the cost model (GNNPipeStrategy's default)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(2)
    results = []
    for m in args.models:
        for g in args.graphs:
            for seed in args.seeds:
                data = graph(g, args.nodes)
                net = model(m, args.layers, seed, data.num_nodes)
                torch.manual_seed(seed + 1)
                curve = train(net, data, args.epochs)
                results.append({"model": m, "graph": g, "chunks": 1, "mode": "one process", "seed": seed,
                                "curve": curve})
                print(f"{m} {g} one process seed {seed}: {summary(curve)[0]:.3f}", flush=True)
    cases = [(m, g, c, mode, s) for m in args.models for g in args.graphs for c in args.chunks
             for mode in args.modes for s in args.seeds]
    import tempfile

    from tests.dist import run_distributed
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        args.tmp = tmp.name
        run_distributed(_worker, args.procs, args, cases, timeout=24 * 3600)
        results += json.load(open(tmp.name))
    print(f"\n{'model':<7} {'graph':<14} {'chunks':>6} {'mode':<12} {'test acc (mean, min..max)':>26} {'vs 1 proc':>9} "
          f"{'max drift':>9} {'refreshes':>9} {'epoch s':>8}")
    table = []
    for m in args.models:
        for g in args.graphs:
            ref = [summary(r["curve"])[0] for r in results if (r["model"], r["graph"], r["mode"]) == (m, g, "one process")]
            for c, mode in [(1, "one process")] + [(c, mode) for c in args.chunks for mode in args.modes]:
                runs = [r for r in results if (r["model"], r["graph"], r["chunks"], r["mode"]) == (m, g, c, mode)]
                accs = [summary(r["curve"])[0] for r in runs]
                drift = max((row.get("drift", 0.0) for r in runs for row in r["curve"]), default=0.0)
                refreshes = statistics.mean(r["curve"][-1].get("refreshes", 0) for r in runs)
                secs = statistics.median(row["seconds"] for r in runs for row in r["curve"][len(r["curve"]) // 2:])
                delta = statistics.mean(accs) - statistics.mean(ref)
                table.append(dict(model=m, graph=g, chunks=c, mode=mode, acc=statistics.mean(accs), min=min(accs),
                                  max=max(accs), delta=delta, drift=drift, refreshes=refreshes, seconds=secs))
                print(f"{m:<7} {g:<14} {c:>6} {mode:<12} {statistics.mean(accs):>10.3f} ({min(accs):.3f}..{max(accs):.3f})"
                      f"   {delta * 100:>+8.1f}pt {drift:>9.3f} {refreshes:>9.1f} {secs:>8.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"setting": {k: v for k, v in vars(args).items() if k != "tmp"}, "table": table,
                       "runs": results}, f)


if __name__ == "__main__":
    main()
