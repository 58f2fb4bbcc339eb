"""Bad input is refused at plan time, identically on every rank, with the problem and the fix named."""
import pytest
import torch
from torch import nn
from torch_geometric.data import Batch, Data
from torch_geometric.nn import GCN, GCNConv

from pyg_pipe import GNNPipeStrategy, UnsupportedModelError
from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from pyg_pipe.strategies.gnnpipe import _check_batch
from tests.models import small_graph


def run(model, stages=2, chunks=1, train=True, **cfg):
    x, edge_index, y, mask = small_graph()
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, **cfg), Comm(torch.device("cpu")), stages, 0)
    engine.install()
    try:
        model.train(train)
        return model(x, edge_index)
    finally:
        engine.uninstall()


def test_more_stages_than_layers():
    with pytest.raises(UnsupportedModelError, match=r"2 message-passing layers but the pipeline has 4 stages.*at most 2"):
        run(GCN(8, 16, 2, 3), stages=4)


@pytest.mark.parametrize("chunks", [0, -1])
def test_chunks_below_one(chunks):
    with pytest.raises(ValueError, match="num_chunks"):
        PipelineConfig(num_chunks=chunks).validate()
    with pytest.raises(ValueError, match="num_chunks"):
        GNNPipeStrategy(num_chunks=chunks)


def test_unknown_options_fail_at_construction():
    with pytest.raises(ValueError, match="partition='kmeans' must be one of"):
        GNNPipeStrategy(partition="kmeans")
    with pytest.raises(ValueError, match="balance='fast'"):
        GNNPipeStrategy(balance="fast")
    with pytest.raises(ValueError, match="snapshot_period=0"):
        GNNPipeStrategy(snapshot_period=0)


def test_more_chunks_than_nodes():
    with pytest.raises(ValueError, match=r"num_chunks=61 is larger than the number of vertices \(60\)"):
        run(GCN(8, 16, 2, 3), stages=1, chunks=61)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x, edge_index):
        return self.lin(x)


def test_model_without_message_passing():
    with pytest.raises(UnsupportedModelError, match="calls no MessagePassing layer"):
        run(MLP(), stages=1)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = GCNConv(8, 8), GCNConv(8, 3)

    def forward(self, x, edge_index):
        x = self.a(x, edge_index)
        if x.sum() > 0:  # control flow on tensor values: cannot be cut into stages
            x = x.relu()
        return self.b(x, edge_index)


def test_model_that_cannot_be_traced():
    with pytest.raises(UnsupportedModelError, match="could not trace"):
        run(DataDependent())


def test_jumping_knowledge():
    with pytest.raises(UnsupportedModelError, match="JumpingKnowledge.*jk=None"):
        run(GCN(8, 16, 4, 3, jk="cat"))


def test_batch_norm_inside_a_stage():
    with pytest.raises(UnsupportedModelError, match="BatchNorm.*LayerNorm"):
        run(GCN(8, 16, 4, 3, norm="batch_norm"))


def test_graph_wide_layer_norm_and_the_fix():
    with pytest.raises(UnsupportedModelError, match="mode='node'"):
        run(GCN(8, 16, 4, 3, norm="layer_norm"))
    out = run(GCN(8, 16, 4, 3, norm="layer_norm", norm_kwargs={"mode": "node"}), stages=1, chunks=4)
    assert out.shape == (60, 3)


def test_graph_transform_inside_forward():
    class SelfLoops(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = GCNConv(8, 3)

        def forward(self, x, edge_index):
            edge_index = torch.cat([edge_index, edge_index.flip(0)], 1)
            return self.conv(x, edge_index)

    with pytest.raises(UnsupportedModelError, match="data pipeline"):
        run(SelfLoops(), stages=1)


def test_batches_that_are_not_one_graph():
    x, edge_index, y, mask = small_graph()
    data = Data(x=x, edge_index=edge_index, y=y)
    _check_batch(data)
    _check_batch(Batch.from_data_list([data]))
    with pytest.raises(ValueError, match="Batch of 2 graphs.*FullGraphDataModule"):
        _check_batch(Batch.from_data_list([data, data]))
    with pytest.raises(TypeError, match="yielded a list, not a Data"):
        _check_batch([x, edge_index])
