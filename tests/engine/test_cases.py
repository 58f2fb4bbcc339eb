"""Cases where an engine that decided from values, from one chunk, or from names went silently wrong.

* a layer whose weights start at zero, trained, then checked at lr = 0 with several chunks whose
  first chunk has no halo;
* edge weights under another name (``ew``), new weight values on the same ``edge_index``, new values
  of a sparse ``adj_t`` (degrees and normalisation must follow the values each call receives);
* a model in ``eval()`` mode trains (gradients flow, eval-mode layers), as on one device.

Every case runs in graph_parallel (2 ways), a pipeline with one chunk, a pipeline with chunks and a hybrid
grid (2 ways with 2 chunks each: history and exchange among ways together).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GCN2Conv, GCNConv

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, sync_module_state
from pyg_pipe.engine.runtime.halo import HaloPass
from tests.dist import run_distributed
from tests.harness import ranges
from tests.shapes import ZeroInit
from tests.zoo import zoo_graph

ATOL = 1e-5
MODES = {"graph_parallel": dict(num_stages=1, ways=2, chunks=2), "pipeline": dict(num_stages=2, ways=1, chunks=1),
         "chunks": dict(num_stages=2, ways=1, chunks=4), "hybrid": dict(num_stages=1, ways=2, chunks=4)}


def _engine(model, mode, **cfg):
    m = MODES[mode]
    cfg.setdefault("partition", ranges)
    cfg.setdefault("shuffle_chunks", False)
    return GNNPipeEngine(model, PipelineConfig(num_chunks=m["chunks"], balance="layers", **cfg),
                         Comm(torch.device("cpu"), timeout=60), num_stages=m["num_stages"], ways=m["ways"])


def _step(model, opt, y, mask, **inputs):
    out = model(**inputs)
    loss = F.cross_entropy(out[mask], y[mask])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return out.detach()


def _zero_init(rank, world, mode):
    """Train a zero-initialised model, then check at lr = 0: every training forward equals one process
    with the trained weights once the history has caught up. Each layer's history becomes exact one
    step after its input is, so with chunks that takes at most one step per layer (3 here); without
    chunks there is no history and it is exact at once."""
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph()
    inputs = dict(x=x, edge_index=g["edge_index"], ew=g["edge_weight"])
    torch.manual_seed(0)
    model = ZeroInit()
    engine = _engine(model, mode, snapshot_period=None)  # T2 would restore the anchor taken before training
    engine.install()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(3):
        _step(model, opt, y, mask, **inputs)
    sync_module_state(model, engine.owners, engine.owner_ranks)
    assert any(conv.lin.weight.abs().sum() > 0 for conv in model.convs), "training should move the zero weights"
    plain = copy.deepcopy(model)
    engine.uninstall()
    with torch.no_grad():
        want = plain(**inputs)
    engine.install()
    for group in opt.param_groups:
        group["lr"] = 0.0
    settle = 3 if MODES[mode]["chunks"] > MODES[mode]["ways"] else 0
    for step in range(settle + 2):
        out = _step(model, opt, y, mask, **inputs)
        if step >= settle:
            torch.testing.assert_close(out, want, atol=ATOL, rtol=0, msg=f"{mode}: lr=0 step {step}")
    engine.uninstall()


class Weighted(nn.Module):
    """GCN layers and a GCNII layer taking weights under a name of the user's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 12)
        self.conv1 = GCNConv(12, 12)
        self.conv2 = GCN2Conv(12, alpha=0.2)
        self.conv3 = GCNConv(12, 3)

    def forward(self, x, graph, ew=None):
        x = x0 = self.lin(x).relu()
        x = self.conv1(x, graph, ew).relu()
        x = self.conv2(x, x0, graph, ew).relu()
        return self.conv3(x, graph, ew)


def _weighted_at_lr0(mode):
    """A ``Weighted`` model installed in ``mode`` with an lr = 0 optimizer, and an untouched copy."""
    torch.manual_seed(0)
    model = Weighted()
    plain = copy.deepcopy(model)
    engine = _engine(model, mode)
    engine.install()
    return model, plain, engine, torch.optim.SGD(model.parameters(), lr=0.0)


def _changing_weights(rank, world, mode, sparse):
    """Calls with new edge-weight values on the same graph (or a sparse adjacency with new values):
    every training forward at lr = 0 and every inference equals one process on those values. The
    weights (or the adjacency's values) are inputs, so the halo's degrees come from them: no call
    site exchanges or keeps history of degrees."""
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph()
    ei, N = g["edge_index"], x.size(0)
    model, plain, engine, opt = _weighted_at_lr0(mode)
    gen = torch.Generator().manual_seed(1)
    for call in range(3):
        w = torch.rand(ei.size(1), generator=gen) + 0.1
        if sparse:
            adj = torch.sparse_coo_tensor(torch.stack([ei[1], ei[0]]), w, (N, N)).coalesce().to_sparse_csr()
            inputs = dict(x=x, graph=adj)
        else:
            inputs = dict(x=x, graph=ei, ew=w)
        engine.uninstall()
        with torch.no_grad():
            want = plain(**inputs)
        engine.install()
        if call == 1:  # planned by now: record the call sites that get halo rows
            joined, join = [], HaloPass.join
            HaloPass.join = lambda self, key, *a: joined.append(key) or join(self, key, *a)
        try:
            out = _step(model, opt, y, mask, **inputs)
        finally:
            if call == 1:
                HaloPass.join = join
        torch.testing.assert_close(out, want, atol=ATOL, rtol=0, msg=f"{mode}, call {call}: training forward")
        with torch.no_grad():
            torch.testing.assert_close(model(**inputs), want, atol=ATOL, rtol=0, msg=f"{mode}, call {call}: inference")
    engine.uninstall()
    if MODES[mode]["chunks"] > 1:
        assert joined and not [k for k in joined if ":deg" in k], joined


class Dropping(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = GCNConv(8, 12)
        self.conv2 = GCNConv(12, 3)

    def forward(self, x, edge_index):
        x = F.dropout(self.conv1(x, edge_index).relu(), p=0.5, training=self.training)
        return self.conv2(x, edge_index)


def _eval_mode(rank, world, mode):
    """``model.eval()`` before training: the steps train (gradients flow) with dropout off, exactly as
    one process does (a pipeline with chunks: the forward at lr = 0)."""
    x, g, y, mask = zoo_graph()
    ei = g["edge_index"]
    torch.manual_seed(0)
    model = Dropping().eval()
    ref = copy.deepcopy(model)
    engine = _engine(model, mode)
    engine.install()
    lr = 0.0 if MODES[mode]["chunks"] > MODES[mode]["ways"] else 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(3):
        out = _step(model, opt, y, mask, x=x, edge_index=ei)
        want = _step(ref, ref_opt, y, mask, x=x, edge_index=ei)
        torch.testing.assert_close(out, want, atol=ATOL, rtol=0, msg=f"{mode}, step {step}")
        grads = [p.grad for n, p in model.named_parameters() if engine.owners[n] == engine.stage_index]
        assert grads and all(gr is not None for gr in grads), "eval mode must not stop gradients"
    engine.uninstall()


@pytest.mark.parametrize("mode", list(MODES))
def test_zero_initialised_layers_trained_then_exact_at_lr0(mode):
    run_distributed(_zero_init, 2, mode, timeout=240)


@pytest.mark.parametrize("sparse", [False, True], ids=["edge_weight", "adj_t"])
@pytest.mark.parametrize("mode", list(MODES))
def test_new_edge_values_on_the_same_graph(mode, sparse):
    run_distributed(_changing_weights, 2, mode, sparse, timeout=240)


@pytest.mark.parametrize("mode", list(MODES))
def test_model_in_eval_mode_trains(mode):
    run_distributed(_eval_mode, 2, mode, timeout=240)


def _repeated_loops(rank, world, mode):
    """A vertex with several self loops: PyG keeps one of them when it adds self loops, which the
    degrees taken from the inputs would not know; they are exchanged instead, and stay exact."""
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph()
    ei = torch.cat([g["edge_index"], torch.tensor([[3, 3, 40], [3, 3, 40]])], 1)
    w = torch.rand(ei.size(1), generator=torch.Generator().manual_seed(2)) + 0.1
    model, plain, engine, opt = _weighted_at_lr0(mode)
    for weights in (None, w):
        with torch.no_grad():
            engine.uninstall()
            want = plain(x, ei, weights)
            engine.install()
        out = _step(model, opt, y, mask, x=x, graph=ei, ew=weights)
        torch.testing.assert_close(out, want, atol=ATOL, rtol=0, msg=f"{mode}, weights={weights is not None}")
    engine.uninstall()


@pytest.mark.parametrize("mode", ["graph_parallel", "chunks"])
def test_repeated_self_loops(mode):
    run_distributed(_repeated_loops, 2, mode, timeout=240)


def _train_then_eval(rank, world, mode):
    """A forward with ``F.dropout(..., training=self.training)``: training uses dropout, validation
    afterwards does not (a traced pipeline must not keep the training mode it was traced in), and
    equals the plain model with the trained weights."""
    x, g, y, mask = zoo_graph()
    ei = g["edge_index"]
    torch.manual_seed(0)
    model = Dropping()
    engine = _engine(model, mode)
    engine.install()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(2):
        _step(model, opt, y, mask, x=x, edge_index=ei)
    sync_module_state(model, engine.owners, engine.owner_ranks)
    model.eval()
    with torch.no_grad():
        got = model(x, ei)
    engine.uninstall()
    with torch.no_grad():
        want = model(x, ei)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", ["pipeline", "chunks"])
def test_validation_after_training_uses_eval_mode(mode):
    run_distributed(_train_then_eval, 2, mode, timeout=240)


def _per_chunk_statistics(rank, world):
    """BatchNorm with several chunks per way, opted into per-chunk statistics: it trains (loss falls,
    running statistics move) although it is approximate by design; with per_chunk_statistics=False it is
    refused; by default it takes historical statistics, told in a note."""
    from torch_geometric.nn import GCN

    from pyg_pipe import UnsupportedModelError
    x, g, y, mask = zoo_graph()
    ei = g["edge_index"]
    torch.manual_seed(0)
    refused = GCN(8, 12, 3, 3, norm="batch_norm")
    engine = _engine(refused, "chunks", per_chunk_statistics=False)
    engine.install()
    with pytest.raises(UnsupportedModelError, match="per_chunk_statistics=True"):
        refused(x, ei)
    engine.uninstall()
    default = GCN(8, 12, 3, 3, norm="batch_norm")
    engine = _engine(default, "chunks")
    engine.install()
    F.cross_entropy(default(x, ei)[mask], y[mask]).backward()
    engine.uninstall()
    assert engine.plan.statistics == "history"
    assert any("graph-wide norms ('norms.0.module', 'norms.1.module')" in n and "per_chunk_statistics='history'" in n
               for n in engine.notes), engine.notes
    torch.manual_seed(0)
    model = GCN(8, 12, 3, 3, norm="batch_norm")
    engine = _engine(model, "chunks", per_chunk_statistics=True, shuffle_chunks=True)
    engine.install()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    norm = model.norms[0].module
    before = norm.running_mean.clone()
    losses = []
    for _ in range(15):
        out = model(x, ei)
        loss = F.cross_entropy(out[mask], y[mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    engine.uninstall()
    owner = engine.owners["norms.0.module.running_mean"]
    if owner == engine.stage_index:
        assert not torch.equal(before, norm.running_mean)
    assert losses[-1] < losses[0], losses


def test_per_chunk_statistics_default_history_or_refused_or_per_chunk():
    run_distributed(_per_chunk_statistics, 2, timeout=240)
