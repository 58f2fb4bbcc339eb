"""BatchNorm, GraphNorm and the other norms computed from per-feature sums (InstanceNorm, graph-mode LayerNorm,
PairNorm, MeanSubtractionNorm, GraphSizeNorm) with several chunks per way and ``per_chunk_statistics="history"``:
the whole graph's statistics, other chunks' sums from their latest run (:mod:`pyg_pipe.engine.runtime.statistics`).

At lr = 0 every sum is of exact values: the exact pass that fills history fills the sums too, so from the
first step every chunk normalises with the whole graph's mean and variance, as one process does. The
training forward, the running statistics and inference then equal plain PyG's (float64, 1e-9), checked
with PyG's own models on a graph of several components, in one process (with and without recompute, whose
replays must read what their fill read), in a pipeline of 2 stages and with 2 ways of 2 chunks (sums
all-reduced among the ways). With per-chunk statistics (``True``) the same run differs: the check can fail.
The gradient through the statistics equals PyG's at lr = 0 from the second step where nothing after the
norm reads another chunk; the meter reports the sums' drift; what is still refused names the fix.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import (BatchNorm, DiffGroupNorm, EdgeConv, GCNConv, GraphNorm, GraphSizeNorm, InstanceNorm,
                                LayerNorm, MeanSubtractionNorm, PairNorm)
from torch_geometric.nn.models import GCN, GIN

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from pyg_pipe.model.errors import UnsupportedModelError
from tests.dist import run_distributed
from tests.harness import ranges
from tests.zoo import zoo_graph


class BNNet(nn.Module):
    """PyG's BatchNorm between layers, a torch BatchNorm1d at the end (two kinds of call site)."""

    def __init__(self):
        super().__init__()
        self.gcn = GCN(8, 16, 2, 16, norm="batch_norm")
        self.norm = BatchNorm(16)
        self.out = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x, edge_index):
        return self.out(self.norm(self.gcn(x, edge_index)).relu())


class SumNorms(nn.Module):
    """PyG's other norms computed from per-feature sums, one between each pair of GCN layers (an InstanceNorm
    with running statistics: they must move as one process's; DiffGroupNorm: per row around a BatchNorm)."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([GCNConv(8, 16)] + [GCNConv(16, 16) for _ in range(7)] + [GCNConv(16, 3)])
        self.norms = nn.ModuleList([LayerNorm(16, mode="graph"), PairNorm(), PairNorm(scale_individually=True),
                                    MeanSubtractionNorm(), GraphSizeNorm(), InstanceNorm(16),
                                    InstanceNorm(16, affine=True, track_running_stats=True), DiffGroupNorm(16, 2)])

    def forward(self, x, edge_index):
        for conv, norm in zip(self.convs, self.norms):
            x = norm(conv(x, edge_index)).relu()
        return self.convs[-1](x, edge_index)


MODELS = {"GCN-batch_norm": lambda: GCN(8, 16, 3, 3, norm="batch_norm"),
          "GCN-graph_norm": lambda: GCN(8, 16, 3, 3, norm="graph_norm"),  # PyG's GraphNorm, one graph
          "GCN-layer_norm-graph": lambda: GCN(8, 16, 3, 3, norm="layer_norm", norm_kwargs={"mode": "graph"}),
          "GIN": lambda: GIN(8, 16, 3, 3),  # its MLPs hold BatchNorm1d
          "BNNet": BNNet, "SumNorms": SumNorms}


def _check(rank, world, name, stages, ways, chunks, recompute, setting=("history",), steps=3):
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph()
    ei = g["edge_index"]
    torch.manual_seed(0)
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, partition=ranges, streaming=False,
                                                 per_chunk_statistics=setting[0], recompute=recompute,
                                                 balance="layers"),
                           Comm(torch.device("cpu"), timeout=60), num_stages=stages, ways=ways)
    engine.install()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.0), torch.optim.SGD(ref.parameters(), lr=0.0)
    for step in range(steps):
        out, want = model(x, ei), ref(x, ei)
        torch.testing.assert_close(out, want, atol=1e-9, rtol=0, msg=f"{name}: training forward at step {step}")
        for o, m, r in ((opt, out, y), (ref_opt, want, y)):
            o.zero_grad()
            F.cross_entropy(m[mask], r[mask]).backward()
            o.step()
    mine = {n for n, owner in engine.owners.items() if owner == engine.stage_index}
    ref_buffers = dict(ref.named_buffers())
    for n, b in model.named_buffers():
        if n in mine and "running" in n:
            torch.testing.assert_close(b, ref_buffers[n], atol=1e-9, rtol=0, msg=f"{name}: {n}")
    model.eval(), ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x, ei), ref(x, ei), atol=1e-9, rtol=0, msg=f"{name}: inference")
    engine.uninstall()


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_one_process_equals_pyg_at_lr0(recompute):
    try:
        for name in MODELS:
            _check(0, 1, name, 1, 1, 4, recompute)
    finally:
        torch.set_default_dtype(torch.float32)


def test_per_chunk_statistics_differ():
    """The same check fails with each chunk's own statistics (so the tests above can fail)."""
    try:
        for name in ("GCN-batch_norm", "GCN-layer_norm-graph", "SumNorms"):
            with pytest.raises(AssertionError, match="training forward"):
                _check(0, 1, name, 1, 1, 4, False, setting=(True,))
    finally:
        torch.set_default_dtype(torch.float32)


def _many(rank, world, stages, ways, chunks):
    for name in MODELS:
        _check(rank, world, name, stages, ways, chunks, "auto")


@pytest.mark.parametrize("stages,ways,chunks", [(2, 1, 4), (1, 2, 4)], ids=["2 stages", "2 ways x 2 chunks"])
def test_pipeline_and_ways_equal_pyg_at_lr0(stages, ways, chunks):
    run_distributed(_many, stages * ways, stages, ways, chunks, timeout=300)


class ConvThenMLP(nn.Module):
    """A graph layer on the input features, then a BatchNorm in a per-vertex MLP: no cross-chunk read lies
    after the norm, so the gradient reaching it is exact, and with it (from the second step, when every
    chunk's backward sums exist) every parameter's gradient."""

    def __init__(self, norm):
        super().__init__()
        self.conv = GCN(8, 16, 1, 16)
        self.mlp = nn.Sequential(nn.ReLU(), nn.Linear(16, 16), norm(16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x, edge_index):
        return self.mlp(self.conv(x, edge_index))


def _gradients(rank, world, ways, norm, exact_from=1):
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph()
    ei = g["edge_index"]
    torch.manual_seed(0)
    model = ConvThenMLP(norm)
    ref = copy.deepcopy(model)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=4, partition=ranges, streaming=False,
                                                 per_chunk_statistics="history"),
                           Comm(torch.device("cpu"), timeout=60), num_stages=1, ways=ways)
    engine.install()
    for step in range(exact_from + 2):
        for m in (model, ref):
            m.zero_grad()
            F.cross_entropy(m(x, ei)[mask], y[mask]).backward()
        if step < exact_from:
            continue  # the first backward has no sums yet for the chunks drained after it (a chain of k norms:
            #           each needs the next one's exact sums first, so the gradient is exact from step k)
        want = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name].grad, atol=1e-9, rtol=1e-7,
                                       msg=f"step {step}: gradient of {name}")
    engine.uninstall()


def _sum_norms(d):
    return nn.Sequential(LayerNorm(d, mode="graph"), PairNorm(), MeanSubtractionNorm(), GraphSizeNorm())


@pytest.mark.parametrize("ways,norm,exact_from", [(1, nn.BatchNorm1d, 1), (2, nn.BatchNorm1d, 1), (1, GraphNorm, 1),
                                                  (2, _sum_norms, 3)],
                         ids=["BatchNorm1d", "BatchNorm1d-2-ways", "GraphNorm", "LayerNorm-PairNorm-2-ways"])
def test_gradient_through_the_statistics_equals_pyg_at_lr0(ways, norm, exact_from):
    run_distributed(_gradients, ways, ways, norm, exact_from, timeout=240)


def _engine(model, **cfg):
    return GNNPipeEngine(model, PipelineConfig(num_chunks=4, partition=ranges, **cfg), Comm(torch.device("cpu")),
                         num_stages=1)


def test_refusals_name_the_module_and_the_fix():
    x, g, y, mask = zoo_graph()
    ei = g["edge_index"]

    class WithBatchVector(nn.Module):
        def __init__(self):
            super().__init__()
            self.gcn, self.norm = GCN(8, 16, 2, 3), GraphNorm(3)

        def forward(self, x, edge_index):
            return self.norm(self.gcn(x, edge_index), torch.zeros(x.size(0), dtype=torch.long))

    for model, cfg, match in [
        (WithBatchVector(), dict(streaming=False), r"GraphNorm was given a batch vector.*per_chunk_statistics=True"),
        (GCN(8, 16, 2, 3, norm="batch_norm"), dict(streaming=True), "streaming=False"),
    ]:
        engine = _engine(model, per_chunk_statistics="history", **cfg)
        engine.install()
        try:
            with pytest.raises(UnsupportedModelError, match=match):
                model(x, ei)
        finally:
            engine.uninstall()

    class EdgeBN(nn.Module):  # a BatchNorm over the edges, inside EdgeConv's message MLP
        def __init__(self):
            super().__init__()
            self.conv = EdgeConv(nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU()))
            self.lin = nn.Linear(8, 3)

        def forward(self, x, edge_index):
            return self.lin(self.conv(x, edge_index))

    model = EdgeBN()
    engine = _engine(model, per_chunk_statistics="history", streaming=False)
    engine.install()
    try:
        with pytest.raises(UnsupportedModelError, match="message function of layer 'conv'.*per_chunk_statistics=True"):
            model(x, ei)
    finally:
        engine.uninstall()
    with pytest.raises(ValueError, match="per_chunk_statistics='yes' must be"):
        PipelineConfig(per_chunk_statistics="yes").validate()


def test_meter_reports_the_statistics_drift():
    """The staleness meter gets a site per BatchNorm: none at lr = 0 (every sum read is this step's value),
    some once the weights move."""
    from pyg_pipe.engine.runtime.staleness import summarize
    torch.set_default_dtype(torch.float64)
    try:
        x, g, y, mask = zoo_graph()
        ei = g["edge_index"]
        for lr in (0.0, 0.05):
            torch.manual_seed(0)
            model = GCN(8, 16, 3, 3, norm="batch_norm")
            engine = _engine(model, per_chunk_statistics="history", streaming=False)
            engine.install()
            opt = torch.optim.Adam(model.parameters(), lr=lr)
            for _ in range(3):
                opt.zero_grad()
                F.cross_entropy(model(x, ei)[mask], y[mask]).backward()
                opt.step()
            got = summarize(engine.meter.take()[1:])
            engine.uninstall()
            sites = sorted(k for k in got if k.startswith("drift/statistics:"))
            assert sites == ["drift/statistics:norms.0.module#0", "drift/statistics:norms.1.module#0"], sites
            if lr == 0:
                assert all(got[k] < 1e-12 for k in sites), got
            else:
                assert all(got[k] > 1e-6 for k in sites), got
    finally:
        torch.set_default_dtype(torch.float32)
