"""``strategy="graph_parallel"`` and ``"gnnpipe_hybrid"`` through a real Lightning Trainer.

Exact where the algorithm is (graph parallelism; hybrid with one chunk per way): the parameters in
the user's model after ``fit`` and the validation metric equal single-process PyG, and the logged
bytes equal the formulas of :mod:`pyg_pipe.engine.plan.formulas` for the partition actually used, halo
rows counted exactly; also with ``halo_exchange="ring"`` (its own halo formula).
"""
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

import pyg_pipe
from pyg_pipe import GraphParallelStrategy, HybridStrategy
from pyg_pipe.engine import graph_parallel_bytes, halo_rows, ring_halo_rows
from pyg_pipe.graph import make_way_chunks
from tests.lit import NodeClassifier, graph_loader
from tests.models import as_data, make_model, small_graph
from tests.strategies.test_gnnpipe import reference_fit


def trainer(strategy, devices, root, max_epochs=3, clip=None):
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=max_epochs,
                      default_root_dir=str(root), gradient_clip_val=clip)


@pytest.fixture(scope="module")
def data():
    return as_data(*small_graph())


def test_strategies_are_registered():
    assert isinstance(pl.Trainer(strategy="graph_parallel", accelerator="cpu", devices=2, logger=False).strategy,
                      GraphParallelStrategy)
    assert isinstance(pl.Trainer(strategy="gnnpipe_hybrid", accelerator="cpu", devices=4, logger=False).strategy,
                      HybridStrategy)
    assert isinstance(pyg_pipe.GraphParallelStrategy(), HybridStrategy)


def _fit_and_check(data, strategy, devices, stages, ways, root, clip=None, ring=False):
    torch.manual_seed(0)
    model = make_model("gcn")
    ref = reference_fit(model, data, epochs=3, clip=clip)
    lit = NodeClassifier(model)
    t = trainer(strategy, devices, root, clip=clip)
    t.fit(lit, train_dataloaders=graph_loader(data), val_dataloaders=graph_loader(data))
    for (name, p), q in zip(lit.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)
    with torch.no_grad():
        out = ref.eval()(data.x, data.edge_index)
    acc = (out.argmax(-1)[data.val_mask] == data.y[data.val_mask]).float().mean()
    assert float(t.callback_metrics["val_acc"]) == pytest.approx(float(acc), abs=1e-6)
    # bytes: GCN with 4 layers, hidden 16, 3 classes. Layers 2-4 exchange the rows they propagate,
    # lin(x): 16, 16 and 3 wide (layer 1 reads the input features; degrees come from the inputs)
    perm, ptr = make_way_chunks(data.edge_index, data.num_nodes, ways, 1, seed=0)
    halo = (ring_halo_rows if ring else halo_rows)(data.edge_index, perm, ptr)
    assert halo > 0
    want = graph_parallel_bytes(data.num_nodes, halo, [16, 16, 3], sum(p.numel() for p in model.parameters()),
                                ways, out_width=3, num_stages=stages, width=16)
    for key, value in want.items():
        if value == 0 and key in ("stage_activations", "stage_gradients", "carried") and stages == 1:
            assert f"comm/{key}" not in t.callback_metrics, key  # categories this grid cannot send: not logged
            continue
        name = "comm/bytes" if key == "total" else f"comm/{key}"
        assert float(t.callback_metrics[name]) == value, key


@pytest.mark.parametrize("devices,clip", [(2, None), (4, 0.05)])
def test_graph_parallel_fit_matches_single_process_and_logs_bytes(data, devices, clip, tmp_path):
    _fit_and_check(data, GraphParallelStrategy(start_method="spawn", comm_timeout=60), devices, 1, devices, tmp_path,
                   clip)


def test_hybrid_one_chunk_per_way_matches_single_process_and_logs_bytes(data, tmp_path):
    strategy = HybridStrategy(stages=2, ways=2, num_chunks=2, start_method="spawn", comm_timeout=60)
    _fit_and_check(data, strategy, 4, 2, 2, tmp_path)


def test_the_ring_halo_exchange_through_lightning(data, tmp_path):
    """``halo_exchange="ring"`` is accepted by every strategy, refused misspelt, and a graph-parallel fit over 3
    ways with it matches single-process PyG and logs the ring's bytes."""
    assert HybridStrategy(stages=2, ways=3, num_chunks=12, halo_exchange="ring").config.halo_exchange == "ring"
    assert pyg_pipe.GNNPipeStrategy(halo_exchange="ring").config.halo_exchange == "ring"
    with pytest.raises(ValueError, match="halo_exchange='tree' must be 'all_to_all'"):
        HybridStrategy(halo_exchange="tree")
    strategy = GraphParallelStrategy(start_method="spawn", comm_timeout=60, halo_exchange="ring")
    _fit_and_check(data, strategy, 3, 1, 3, tmp_path, ring=True)


def test_who_chooses_the_grid():
    """GNNPipeStrategy runs one stage a device by default (grid="pipeline") and chooses stages x ways when asked
    (grid="auto"); the strategies that fix a grid keep it and refuse to have it chosen."""
    assert pyg_pipe.GNNPipeStrategy().config.grid == "pipeline"
    assert pyg_pipe.GNNPipeStrategy(grid="auto").config.grid == "auto"
    assert HybridStrategy(stages=2, ways=2).config.grid == "pipeline"
    assert GraphParallelStrategy().config.grid == "pipeline"
    with pytest.raises(ValueError, match="grid='auto': HybridStrategy fixes the grid"):
        HybridStrategy(stages=2, ways=2, grid="auto")


def test_hybrid_serves_a_shallow_model(data, tmp_path):
    """2 layers on 4 devices: the default grid is 2 stages x 2 ways; with several chunks per way the
    loss still falls, and validation (exact inference) equals the model's own plain forward."""
    torch.manual_seed(0)
    lit = NodeClassifier(make_model("sage", num_layers=2), optimizer="adam", lr=0.02)
    t = trainer(HybridStrategy(num_chunks=8, start_method="spawn", comm_timeout=60), 4, tmp_path, max_epochs=8)
    t.fit(lit, train_dataloaders=graph_loader(data), val_dataloaders=graph_loader(data))
    with torch.no_grad():
        out = lit.model.eval()(data.x, data.edge_index)
    acc = (out.argmax(-1)[data.val_mask] == data.y[data.val_mask]).float().mean()
    assert float(t.callback_metrics["val_acc"]) == pytest.approx(float(acc), abs=1e-6)
    torch.manual_seed(0)   # the same initial weights as the trained model
    with torch.no_grad():
        loss0 = F.cross_entropy(make_model("sage", num_layers=2)(data.x, data.edge_index)[data.train_mask],
                                data.y[data.train_mask])
    assert float(F.cross_entropy(out[data.train_mask], data.y[data.train_mask])) < float(loss0)
    assert float(t.callback_metrics["comm/halo_forward"]) > 0
    assert float(t.callback_metrics["comm/stage_activations"]) == 1 * data.num_nodes * 16 * 4


def test_gnnpipe_on_a_shallow_model_adds_graph_parallel_ways(data, tmp_path):
    """One message-passing layer on 2 devices: strategy="gnnpipe" runs 1 stage x 2 ways, says so, and is exact."""
    from torch_geometric.nn import APPNP, Sequential
    from torch import nn
    torch.manual_seed(0)
    model = Sequential("x, edge_index", [(nn.Linear(8, 3), "x -> x"), (APPNP(K=3, alpha=0.1), "x, edge_index -> x")])
    ref = reference_fit(model, data, epochs=3)
    lit = NodeClassifier(model)
    strategy = pyg_pipe.GNNPipeStrategy(start_method="spawn", comm_timeout=60)
    t = trainer(strategy, 2, tmp_path)
    t.fit(lit, train_dataloaders=graph_loader(data))
    assert any("1 message-passing layers for 2 devices" in note and "2 graph-parallel ways" in note
               for note in strategy.notes), strategy.notes
    for (name, p), q in zip(lit.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)


class _DataDependent(torch.nn.Module):
    """Python control flow on a tensor value between the layers (a parameter's: a value over the vertices would be
    refused where the graph is cut): torch.fx cannot cut it into stages."""

    def __init__(self):
        from torch_geometric.nn import SAGEConv
        super().__init__()
        self.a, self.b = SAGEConv(8, 8), SAGEConv(8, 3)
        self.gate = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x, edge_index):
        x = self.a(x, edge_index)
        if self.gate > 0:
            x = x.relu() * self.gate
        return self.b(x, edge_index)


def test_gnnpipe_runs_a_forward_that_does_not_trace_on_graph_parallel_ways(data, tmp_path):
    """A forward torch.fx cannot trace cannot be cut into stages: strategy="gnnpipe" (no stage count given) runs it on
    1 stage x 2 ways, says so, and is exact (with stages=2 asked for, it is refused: tests/engine/test_errors.py)."""
    torch.manual_seed(0)
    model = _DataDependent()
    ref = reference_fit(model, data, epochs=3)
    lit = NodeClassifier(model)
    strategy = pyg_pipe.GNNPipeStrategy(start_method="spawn", comm_timeout=60)
    t = trainer(strategy, 2, tmp_path)
    t.fit(lit, train_dataloaders=graph_loader(data))
    assert any("_DataDependent.forward does not trace into pipeline stages (TraceError" in note
               and "1 pipeline stage x 2 graph-parallel ways" in note for note in strategy.notes), strategy.notes
    for (name, p), q in zip(lit.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)


class _StepCallsTheLayer(pl.LightningModule):
    """PyG's sgc.py in Lightning: the layer itself is the model (``self.model = SGConv(...)``), no forward; the
    steps call it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, data, batch_idx):
        out = self.model(data.x, data.edge_index)
        return F.cross_entropy(out[data.train_mask], data.y[data.train_mask])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class _StepCallsTwoLayers(_StepCallsTheLayer):
    """Two layers held by the LightningModule itself and called from its training step, no forward."""

    def __init__(self):
        from torch_geometric.nn import GCNConv
        super().__init__(None)
        self.conv1, self.conv2 = GCNConv(8, 16), GCNConv(16, 3)

    def training_step(self, data, batch_idx):
        out = self.conv2(self.conv1(data.x, data.edge_index).relu(), data.edge_index)
        return F.cross_entropy(out[data.train_mask], data.y[data.train_mask])


class _SharedStep(_StepCallsTwoLayers):
    """The same layers called from a shared step the training step calls: a method of the model that is handed the
    graph and calls the layers, so it is the one distributed; it returns the loss, not rows."""

    def _step(self, data):
        out = self.conv2(self.conv1(data.x, data.edge_index).relu(), data.edge_index)
        return F.cross_entropy(out[data.train_mask], data.y[data.train_mask])

    def training_step(self, data, batch_idx):
        return self._step(data)


def test_a_layer_as_the_whole_model_called_from_the_training_step(data, tmp_path):
    """The layer itself is distributed (1 stage x 2 ways), exact against one process; before 2026-11-29 Lightning
    crashed on the routed training_step (AttributeError: 'Rerouted' object has no attribute '__code__'), and the
    layer given as the model was refused in every mode. Layers held by the LightningModule itself and called from
    its training_step are refused by name (the step computes a loss; pyg_pipe distributes methods that return rows), and
    so is a shared step that calls them and returns the loss, with the fix."""
    from torch_geometric.nn import SGConv
    torch.manual_seed(0)
    model = SGConv(8, 3, K=2)
    ref = reference_fit(model, data, epochs=3)
    lit = _StepCallsTheLayer(model)
    t = trainer(pyg_pipe.GNNPipeStrategy(start_method="spawn", comm_timeout=60), 2, tmp_path)
    t.fit(lit, train_dataloaders=graph_loader(data))
    for (name, p), q in zip(lit.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)
    t = trainer(GraphParallelStrategy(start_method="spawn", comm_timeout=60), 2, tmp_path)
    with pytest.raises(Exception, match=r"Layer 'conv1' \(GCNConv\) ran in a training step outside the methods of "
                                        r"_StepCallsTwoLayers .*\(it was called through "
                                        r"_StepCallsTwoLayers\.training_step\)"):
        t.fit(_StepCallsTwoLayers(), train_dataloaders=graph_loader(data))
    with pytest.raises(Exception, match=r"_SharedStep\._step returned shape \(\) for a chunk of .*"
                                        r"If _SharedStep\._step computes the loss itself \(a shared step\), "
                                        r"call the layers in a method that returns their output, "
                                        r"forward\(x, edge_index\)"):
        t.fit(_SharedStep(), train_dataloaders=graph_loader(data))
