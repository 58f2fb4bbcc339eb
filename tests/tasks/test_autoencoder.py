"""Other task shapes through a real Trainer: PyG's own ``VGAE`` (examples/autoencoder.py), whose encoder returns
``(mu, logstd)`` and whose training step calls ``model.encode(...)``, trains under ``graph_parallel`` and
``gnnpipe`` (one chunk per device: exact) to the parameters one process reaches."""
import lightning.pytorch as pl
import pytest
import torch
from torch_geometric.nn import GCNConv, VGAE

from tests.tasks.common import assert_same_parameters, fit_exact, graph_with_negatives, trained_on_one_process


class VariationalGCNEncoder(torch.nn.Module):
    """The encoder of PyG's autoencoder example."""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.conv1 = GCNConv(in_channels, 2 * out_channels)
        self.conv_mu = GCNConv(2 * out_channels, out_channels)
        self.conv_logstd = GCNConv(2 * out_channels, out_channels)

    def forward(self, x, edge_index):
        x = self.conv1(x, edge_index).relu()
        return self.conv_mu(x, edge_index), self.conv_logstd(x, edge_index)


def vgae_loss(model, data, epoch):
    torch.manual_seed(epoch)  # the reparametrisation's noise: the same on every rank and in the reference
    z = model.encode(data.x, data.edge_index)
    return model.recon_loss(z, data.edge_index, data.neg_edge_index) + model.kl_loss() / data.num_nodes


class AutoEncoder(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, data, batch_idx):
        return vgae_loss(self.model, data, self.current_epoch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("strategy", ["graph_parallel", "gnnpipe"])
def test_pyg_vgae_trains_as_on_one_device(strategy, tmp_path):
    data = graph_with_negatives()
    torch.manual_seed(0)
    model = VGAE(VariationalGCNEncoder(data.num_features, 8))
    ref = trained_on_one_process(model, vgae_loss, data, lr=0.05)
    lit = AutoEncoder(model)
    fit_exact(lit, strategy, data, tmp_path)
    assert_same_parameters(lit.model, ref)
