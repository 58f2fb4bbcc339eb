"""Per-vertex parameters: PyG's ``LightGCN`` (examples/lightgcn.py), whose node features are an embedding table with
one learned row per vertex and whose forward scores (user, item) pairs from ``self.get_embedding(edge_index)``.

A chunk sees its rows of the table as the table's ``weight`` (and the true rows of its halo), so the gradient of
every row reaches the table; ``get_embedding`` is the distributed method and the pair scores and the loss run on
the whole embedding. Exact in the modes that are exact (one process with 4 chunks at inference and on the first
step; 2 processes with ``graph_parallel`` and with ``gnnpipe`` at one chunk per device, 3 steps through a Trainer);
the checkpoint is the plain model's ``state_dict``."""
import copy

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch_geometric.nn import GCNConv, LightGCN

from pyg_pipe.model.find import vertex_tables
from tests.models import as_data, small_graph
from tests.tasks.common import assert_same_parameters, chunked_engine, fit_exact, trained_on_one_process
from tests.zoo import zoo_graph


def bpr_loss(model, data, epoch):
    """The training step of PyG's LightGCN example: positive pairs against random negatives (seeded: the same on
    every rank and in the reference), BPR loss with the example's L2 term on the rows involved."""
    gen = torch.Generator().manual_seed(epoch)
    pos = data.edge_index[:, :40]
    neg = torch.stack([pos[0], torch.randint(0, data.num_nodes, (pos.size(1),), generator=gen)])
    edge_label_index = torch.cat([pos, neg], dim=1)
    pos_rank, neg_rank = model(data.edge_index, edge_label_index).chunk(2)
    return model.recommendation_loss(pos_rank, neg_rank, node_id=edge_label_index.unique())


class Recommender(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, data, batch_idx):
        loss = bpr_loss(self.model, data, self.current_epoch)
        assert self.trainer.strategy.engine.runtime is not None  # get_embedding went through the engine
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def test_tables_with_a_row_per_vertex_are_found_by_type_and_size():
    model = LightGCN(50, 8, 2)
    assert vertex_tables(model, 50) == [(model.embedding, "weight")]
    assert vertex_tables(model, 51) == []  # another size: an ordinary embedding (types, words)


def test_lightgcn_on_chunks_is_exact_at_inference_and_on_the_first_step():
    x, g, _, _ = zoo_graph()
    ei, N = g["edge_index"], x.size(0)
    torch.manual_seed(0)
    model = LightGCN(N, 8, num_layers=3)
    plain = copy.deepcopy(model)
    engine = chunked_engine(model)
    engine.install()
    pairs = ei[:, :30]
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(ei, pairs), plain(ei, pairs), atol=1e-5, rtol=0)
        assert engine.plan.num_chunks == 4
        model(ei, pairs).sum().backward()  # the first step reads history filled by an exact pass: exact
        assert isinstance(model.embedding.weight, nn.Parameter)  # the table is the user's again after the step
    finally:
        engine.uninstall()
    plain(ei, pairs).sum().backward()
    torch.testing.assert_close(model.embedding.weight.grad, plain.embedding.weight.grad, atol=1e-5, rtol=0)
    assert set(model.state_dict()) == set(plain.state_dict())


def test_features_looked_up_by_vertex_id_still_read_the_whole_table():
    """``self.emb(n_id)`` (the ids a chunk is handed) looks up the whole table, while ``self.emb.weight`` reads
    the chunk's rows: both give the same as one device."""
    class ById(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.emb = nn.Embedding(n, 8)
            self.conv = GCNConv(8, 4)

        def forward(self, n_id, edge_index):
            return self.conv(self.emb(n_id) + self.emb.weight, edge_index)

    x, g, _, _ = zoo_graph()
    ei, N = g["edge_index"], x.size(0)
    torch.manual_seed(0)
    model = ById(N)
    plain = copy.deepcopy(model)
    engine = chunked_engine(model)
    engine.install()
    n_id = torch.arange(N)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(n_id, ei), plain(n_id, ei), atol=1e-5, rtol=0)
    finally:
        engine.uninstall()


@pytest.mark.parametrize("strategy", ["graph_parallel", "gnnpipe"])
def test_pyg_lightgcn_trains_as_on_one_device(strategy, tmp_path):
    data = as_data(*small_graph())
    torch.manual_seed(0)
    model = LightGCN(data.num_nodes, 8, num_layers=2)
    ref = trained_on_one_process(model, bpr_loss, data, lr=0.5)
    lit = Recommender(model)
    fit_exact(lit, strategy, data, tmp_path)
    assert_same_parameters(lit.model, ref)
    assert set(lit.model.state_dict()) == set(ref.state_dict())


def test_lightgcn_streamed_on_one_device_trains_as_plain_pyg():
    """Streaming (NGra) on one device is exact at any number of chunks: 3 SGD steps, output and table equal."""
    x, g, _, _ = zoo_graph()
    ei, N = g["edge_index"], x.size(0)
    torch.manual_seed(0)
    model = LightGCN(N, 8, num_layers=3)
    plain = copy.deepcopy(model)
    engine = chunked_engine(model, streaming=True)
    engine.install()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, plain)]
    pairs = ei[:, :30]
    try:
        for _ in range(3):
            outs = [m(ei, pairs) for m in (model, plain)]
            for out, opt in zip(outs, opts):
                out.pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
            torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    finally:
        engine.uninstall()
    torch.testing.assert_close(model.embedding.weight, plain.embedding.weight, atol=1e-5, rtol=0)
