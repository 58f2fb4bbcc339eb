"""PyG's link-prediction shape (examples/link_pred.py): the model has ``encode`` and ``decode`` and no forward; the
training step calls ``model.encode(x, edge_index)`` and scores pairs with ``model.decode(z, edge_label_index)``.
``encode`` is distributed as a forward would be (it calls the layers and is handed the graph); ``decode`` runs
unchanged on the whole ``z``. Also: a forward that scores pairs from ``self.encode`` runs as written around the
distributed encode; one method is distributed per model; values stored on the model per chunk, and layers called
past the routed methods, are refused."""
import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GCNConv

from pyg_pipe import GraphParallelStrategy
from pyg_pipe.model.errors import UnsupportedModelError
from pyg_pipe.model.find import layer_methods
from tests.lit import graph_loader
from tests.models import as_data, small_graph
from tests.tasks.common import assert_same_parameters, chunked_engine, fit_exact, trained_on_one_process
from tests.zoo import zoo_graph


class LinkNet(nn.Module):
    """The model of PyG's link prediction example."""

    def __init__(self, in_channels=8, hidden=16, out=8):
        super().__init__()
        self.conv1 = GCNConv(in_channels, hidden)
        self.conv2 = GCNConv(hidden, out)

    def encode(self, x, edge_index):
        x = self.conv1(x, edge_index).relu()
        return self.conv2(x, edge_index)

    def decode(self, z, edge_label_index):
        return (z[edge_label_index[0]] * z[edge_label_index[1]]).sum(dim=-1)


class Scored(LinkNet):
    """A forward that scores pairs: the layers run through ``encode``, called inside it."""

    def forward(self, x, edge_index, edge_label_index):
        return self.decode(self.encode(x, edge_index), edge_label_index)


def link_loss(model, data, epoch):
    gen = torch.Generator().manual_seed(epoch)  # the negatives: the same on every rank and in the reference
    neg = torch.randint(0, data.num_nodes, data.edge_index.shape, generator=gen)
    z = model.encode(data.x, data.edge_index)
    label_index = torch.cat([data.edge_index, neg], dim=-1)
    label = torch.cat([torch.ones(data.edge_index.size(1)), torch.zeros(neg.size(1))])
    return F.binary_cross_entropy_with_logits(model.decode(z, label_index), label)


class LinkPredictor(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, data, batch_idx):
        loss = link_loss(self.model, data, self.current_epoch)
        # encode went through the engine: it planned the graph (a run on every rank undistributed would not)
        assert self.trainer.strategy.engine.runtime is not None
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_methods_that_call_the_layers_are_found_from_the_code():
    assert set(layer_methods(LinkNet())) == {"encode"}  # decode calls no layer
    assert set(layer_methods(Scored())) == {"encode"}   # forward is routed anyway


@pytest.mark.parametrize("strategy", ["graph_parallel", "gnnpipe"])
def test_link_predictor_trains_through_encode_as_on_one_device(strategy, tmp_path):
    data = as_data(*small_graph())
    torch.manual_seed(0)
    model = LinkNet()
    ref = trained_on_one_process(model, link_loss, data, lr=0.05)
    lit = LinkPredictor(model)
    fit_exact(lit, strategy, data, tmp_path)
    assert_same_parameters(lit.model, ref)


def test_encode_runs_on_chunks_and_decode_on_the_whole_output():
    """With 4 chunks on one process: inference exact, and the training call goes through the chunks (its
    halo rows come from history: a plan with 4 chunks exists and every chunk ran)."""
    x, g, _, _ = zoo_graph()
    torch.manual_seed(0)
    model = LinkNet(x.size(1))
    plain = copy.deepcopy(model)
    engine = chunked_engine(model)
    engine.install()
    try:
        with torch.no_grad():
            torch.testing.assert_close(model.encode(x, g["edge_index"]), plain.encode(x, g["edge_index"]),
                                       atol=1e-5, rtol=0)
        assert engine.plan is not None and engine.plan.num_chunks == 4
        z = model.encode(x, g["edge_index"])
        pairs = g["edge_index"][:, :50]
        model.decode(z, pairs).sum().backward()  # decode ran on the whole z, outside the engine
        assert all(p.grad is not None for p in model.parameters())
        assert "encode" in model.__dict__
    finally:
        engine.uninstall()
    assert "encode" not in model.__dict__ and model.encode.__func__ is LinkNet.encode


def test_a_forward_that_reaches_the_layers_through_encode_runs_as_written():
    """``forward`` scores pairs from ``self.encode(...)``: encode is distributed inside it (4 chunks), the
    decoder runs on the whole output, and inference equals the plain model's."""
    x, g, _, _ = zoo_graph()
    torch.manual_seed(0)
    model = Scored(x.size(1))
    plain = copy.deepcopy(model)
    engine = chunked_engine(model)
    engine.install()
    pairs = g["edge_index"][:, :40]
    try:
        assert "forward" not in model.__dict__ and "encode" in model.__dict__
        with torch.no_grad():
            torch.testing.assert_close(model(x, g["edge_index"], pairs), plain(x, g["edge_index"], pairs),
                                       atol=1e-5, rtol=0)
        assert engine.plan.num_chunks == 4
    finally:
        engine.uninstall()


def test_a_method_that_stores_chunk_values_on_the_model_is_refused():
    """VGAE's pattern in a user's own class: ``self.h = ...`` in encode would keep one chunk's rows."""
    class Stores(LinkNet):
        def encode(self, x, edge_index):
            self.h = self.conv1(x, edge_index).relu()
            return self.conv2(self.h, edge_index)

    x, g, _, _ = zoo_graph()
    model = Stores(x.size(1))
    engine = chunked_engine(model)
    engine.install()
    try:
        with torch.no_grad(), pytest.raises(UnsupportedModelError, match=r"Stores\.encode stores tensors on the "
                                                                         r"model \(self\.h\)"):
            model.encode(x, g["edge_index"])
    finally:
        engine.uninstall()


def test_a_second_method_is_refused_by_name():
    class TwoWays(LinkNet):
        def forward(self, x, edge_index):
            return self.conv2(self.conv1(x, edge_index), edge_index)

    x, g, _, _ = zoo_graph()
    model = TwoWays(x.size(1))
    engine = chunked_engine(model, chunks=1)
    engine.install()
    try:
        with torch.no_grad():
            model.encode(x, g["edge_index"])
            with pytest.raises(UnsupportedModelError, match=r"TwoWays\.forward runs the message-passing layers, "
                                                            r"but pyg_pipe already distributes TwoWays\.encode"):
                model(x, g["edge_index"])
            model.encode(x, g["edge_index"])  # the first still runs
    finally:
        engine.uninstall()


def test_a_method_not_handed_the_graph_runs_as_written():
    """``reset_parameters`` names the layers too, but takes no graph: it is not distributed."""
    class Resettable(LinkNet):
        def reset_parameters(self):
            self.conv1.reset_parameters()
            self.conv2.reset_parameters()

    model = Resettable()
    engine = chunked_engine(model)
    engine.install()
    try:
        model.reset_parameters()
        assert engine.plan is None
    finally:
        engine.uninstall()


class DirectLayers(pl.LightningModule):
    """Calls a layer of the model from the training step itself: past every routed method."""

    def __init__(self):
        super().__init__()
        self.model = LinkNet()

    def training_step(self, data, batch_idx):
        z = self.model.conv2(self.model.encode(data.x, data.edge_index), data.edge_index)
        return z.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_layers_called_past_the_routed_methods_are_refused(tmp_path):
    data = as_data(*small_graph())
    t = pl.Trainer(strategy=GraphParallelStrategy(start_method="spawn", comm_timeout=60), accelerator="cpu", devices=2,
                   max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=str(tmp_path))
    with pytest.raises(Exception, match=r"Layer 'conv2' \(GCNConv\) ran in a training step outside the methods of "
                                        r"LinkNet that pyg_pipe distributes \(it was called through "
                                        r"DirectLayers\.training_step\)"):
        t.fit(DirectLayers(), train_dataloaders=graph_loader(data))



class RankNegatives(LinkPredictor):
    """Negatives drawn differently on each process (an unseeded negative_sampling after the model)."""

    def training_step(self, data, batch_idx):
        gen = torch.Generator().manual_seed(self.global_rank)
        neg = torch.randint(0, data.num_nodes, data.edge_index.shape, generator=gen)
        z = self.model.encode(data.x, data.edge_index)
        scores = self.model.decode(z, torch.cat([data.edge_index, neg], dim=-1))
        label = torch.cat([torch.ones(data.edge_index.size(1)), torch.zeros(neg.size(1))])
        return F.binary_cross_entropy_with_logits(scores, label)


def test_a_loss_that_differs_between_processes_is_refused(tmp_path):
    """Each way takes its rows' gradient from its own loss: different losses would train the rows on
    different objectives, silently. Refused on every rank, naming the seed as the fix."""
    data = as_data(*small_graph())
    t = pl.Trainer(strategy=GraphParallelStrategy(start_method="spawn", comm_timeout=60), accelerator="cpu", devices=2,
                   max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=str(tmp_path))
    with pytest.raises(Exception, match=r"gradient of the loss with respect to the model's output differs between "
                                        r"processes.*torch\.manual_seed"):
        t.fit(RankNegatives(LinkNet()), train_dataloaders=graph_loader(data))
