"""Unsupervised node embeddings: PyG's ``DeepGraphInfomax`` as its transductive example trains it
(examples/infomax_transductive.py: a GCN encoder with PReLU, the summary the sigmoid of the mean embedding, the
corruption a random permutation of the features). Its forward calls the encoder twice a step (the features and
their permutation) and reduces over every vertex outside it (the summary), so only the encoder is distributed; under
``graph_parallel`` and ``gnnpipe`` (one chunk per device: exact) it trains to the parameters one process reaches."""
import lightning.pytorch as pl
import pytest
import torch
from torch_geometric.nn import DeepGraphInfomax, GCNConv

from tests.models import as_data, small_graph
from tests.tasks.common import assert_same_parameters, fit_exact, trained_on_one_process


class Encoder(torch.nn.Module):
    """The example's encoder, two layers deep (a pipeline of 2 stages needs a layer a stage)."""

    def __init__(self, in_channels, hidden):
        super().__init__()
        self.conv1 = GCNConv(in_channels, hidden)
        self.conv2 = GCNConv(hidden, hidden)
        self.prelu = torch.nn.PReLU(hidden)

    def forward(self, x, edge_index):
        return self.prelu(self.conv2(self.conv1(x, edge_index).relu(), edge_index))


def summary(z, *args, **kwargs):
    return z.mean(dim=0).sigmoid()


def corruption(x, edge_index):
    return x[torch.randperm(x.size(0), device=x.device)], edge_index


def infomax_loss(model, data, epoch):
    torch.manual_seed(epoch)  # the corruption's permutation: the same on every rank and in the reference
    return model.loss(*model(data.x, data.edge_index))


class Infomax(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, data, batch_idx):
        loss = infomax_loss(self.model, data, self.current_epoch)
        # the encoder went through the engine (both of its calls; a run undistributed on every rank would not plan)
        assert self.trainer.strategy.engine.runtime.module is self.model.encoder
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("strategy", ["graph_parallel", "gnnpipe"])
def test_pyg_deep_graph_infomax_trains_as_on_one_device(strategy, tmp_path):
    data = as_data(*small_graph())
    torch.manual_seed(0)
    model = DeepGraphInfomax(16, encoder=Encoder(data.num_features, 16), summary=summary, corruption=corruption)
    ref = trained_on_one_process(model, infomax_loss, data, lr=0.05)
    lit = Infomax(model)
    fit_exact(lit, strategy, data, tmp_path)
    assert_same_parameters(lit.model, ref)
