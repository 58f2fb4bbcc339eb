"""Graph-wide statistics on a cut graph (:mod:`pyg_pipe.engine.runtime.statistics`): with 2 graph-parallel ways, each
holding half of the vertices, BatchNorm between PyG layers, BatchNorm inside a layer's message MLP
(statistics over the edges into each way's vertices) and GraphNorm (rows gathered from every way) compute
what one process computes: training outputs, gradients, and BatchNorm's running statistics after 2 steps;
and with several chunks per way such models are refused before training unless ``per_chunk_statistics=True``.

One launch of 2 real gloo processes drives the real engine, as tests/harness.py does, in float64.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import MLP, EdgeConv, GCNConv, GraphNorm, SAGEConv

from pyg_pipe import UnsupportedModelError
from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, sync_module_state
from tests.dist import run_distributed
from tests.zoo import zoo_graph

ATOL = 1e-6


class BatchNormBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = GCNConv(8, 12)
        self.bn = nn.BatchNorm1d(12)
        self.conv2 = SAGEConv(12, 3)

    def forward(self, x, edge_index):
        return self.conv2(self.bn(self.conv1(x, edge_index)).relu(), edge_index)


class BatchNormInMessage(nn.Module):
    """EdgeConv's MLP normalises the messages, one row per edge."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.conv = EdgeConv(MLP([12, 6, 6]))
        self.out = nn.Linear(6, 3)

    def forward(self, x, edge_index):
        return self.out(self.conv(self.lin(x), edge_index).relu())


class GraphNormBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = GCNConv(8, 12)
        self.norm = GraphNorm(12)
        self.conv2 = GCNConv(12, 3)

    def forward(self, x, edge_index):
        return self.conv2(self.norm(self.conv1(x, edge_index)).relu(), edge_index)


def _batch_norms(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def _engine(model, chunks, **cfg):
    return GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, **cfg), Comm(torch.device("cpu"), timeout=60),
                         num_stages=1, ways=2)


def _build(make):
    torch.manual_seed(0)
    model = make()
    sync_module_state(model, {}, [0])    # every rank holds rank 0's initial state
    return model


def _as_one_process(make, x, edge_index, y, mask, steps=2):
    """``steps`` SGD+momentum steps through the engine on 2 ways, one chunk each, against plain PyG."""
    name = make.__name__
    model = _build(make)
    ref = copy.deepcopy(model)
    engine = _engine(model, 2)
    engine.install()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    try:
        for step in range(steps):
            out = model(x, edge_index)
            opt.zero_grad()
            F.cross_entropy(out[mask], y[mask]).backward()
            ref_out = ref(x, edge_index)
            ref_opt.zero_grad()
            F.cross_entropy(ref_out[mask], y[mask]).backward()
            torch.testing.assert_close(out, ref_out, rtol=0, atol=ATOL, msg=f"{name}: training output, step {step}")
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=ATOL, msg=f"{name}: gradient of {n}, "
                                                                                  f"step {step}")
            opt.step()
            ref_opt.step()
        assert (engine.num_stages, engine.ways, engine.plan.num_chunks) == (1, 2, 2)
        for (n, m), r in zip(_batch_norms(model).items(), _batch_norms(ref).values()):
            for buf in ("running_mean", "running_var", "num_batches_tracked"):
                torch.testing.assert_close(getattr(m, buf), getattr(r, buf), rtol=0, atol=ATOL,
                                           msg=f"{name}: {n}.{buf} after {steps} steps")
            assert int(m.num_batches_tracked) == steps
            assert not torch.allclose(m.running_mean, torch.zeros_like(m.running_mean))
        model.eval()
        ref.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(x, edge_index), ref(x, edge_index), rtol=0, atol=ATOL,
                                       msg=f"{name}: inference")
    finally:
        engine.uninstall()
    return model


def _several_chunks_per_way(x, edge_index, y, mask):
    # per_chunk_statistics=False refuses before training; by default ("auto") the two between layers take historical
    # statistics, and the one in a message function (over edges, inside a layer) is refused when the layer first runs,
    # on both ranks (after the first pass: the rank of the other stage does not wait for one that stopped)
    before = r"with 2 chunks per way.*per_chunk_statistics=True"
    edges = r"message function of layer 'conv' normalises over edges.*per_chunk_statistics=True"
    for make, setting, words in ((BatchNormBetween, False, before), (BatchNormInMessage, False, before),
                                 (GraphNormBetween, False, before), (BatchNormInMessage, "auto", edges)):
        model = _build(make)
        engine = _engine(model, 4, per_chunk_statistics=setting)
        engine.install()
        try:
            with pytest.raises(UnsupportedModelError, match=words):
                model(x, edge_index)
            assert engine.step == 0
        finally:
            engine.uninstall()
    # opted in: trains (per chunk statistics: approximate, so only the shape and finiteness are known)
    model = _build(BatchNormBetween)
    engine = _engine(model, 4, per_chunk_statistics=True)
    engine.install()
    try:
        out = model(x, edge_index)
        F.cross_entropy(out[mask], y[mask]).backward()
        assert out.shape == (x.size(0), 3) and torch.isfinite(out).all()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        assert engine.plan.chunks_per_way == 2
    finally:
        engine.uninstall()


def _worker(rank, world):
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph(sizes=(24, 40))
    edge_index = g["edge_index"]
    for make in (BatchNormBetween, BatchNormInMessage, GraphNormBetween):
        _as_one_process(make, x, edge_index, y, mask)
    _several_chunks_per_way(x, edge_index, y, mask)


def test_statistics_over_all_ways_equal_one_process_and_several_chunks_per_way_are_refused():
    run_distributed(_worker, 2, timeout=180)
