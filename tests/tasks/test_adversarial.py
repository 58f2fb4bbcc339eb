"""PyG's adversarially regularised auto-encoder (examples/argva_node_clustering.py: ``ARGVA``, a variational GCN
encoder and an MLP discriminator, each with its own optimizer, the discriminator stepped five times a step on the
detached embedding before the encoder's loss): Lightning's manual optimisation under ``graph_parallel`` and
``gnnpipe`` (one chunk per device: exact) trains both to the parameters one process reaches."""
import copy

import lightning.pytorch as pl
import pytest
import torch
from torch_geometric.nn import ARGVA, GCNConv

from tests.tasks.common import EPOCHS, assert_same_parameters, fit_exact, graph_with_negatives


class Encoder(torch.nn.Module):
    def __init__(self, in_channels, hidden, out_channels):
        super().__init__()
        self.conv1 = GCNConv(in_channels, hidden)
        self.conv_mu = GCNConv(hidden, out_channels)
        self.conv_logstd = GCNConv(hidden, out_channels)

    def forward(self, x, edge_index):
        x = self.conv1(x, edge_index).relu()
        return self.conv_mu(x, edge_index), self.conv_logstd(x, edge_index)


class Discriminator(torch.nn.Module):
    def __init__(self, in_channels, hidden, out_channels):
        super().__init__()
        self.lin1 = torch.nn.Linear(in_channels, hidden)
        self.lin2 = torch.nn.Linear(hidden, out_channels)

    def forward(self, x):
        return self.lin2(self.lin1(x).relu())


def optimizers(model):
    return (torch.optim.Adam(model.encoder.parameters(), lr=0.005),
            torch.optim.Adam(model.discriminator.parameters(), lr=0.001))


def adversarial_step(model, data, epoch, encoder_opt, discriminator_opt, backward=lambda loss: loss.backward()):
    """One step of the example's ``train()`` (the random draws seeded per step: the same on every rank)."""
    torch.manual_seed(epoch)
    encoder_opt.zero_grad()
    z = model.encode(data.x, data.edge_index)
    for _ in range(5):
        discriminator_opt.zero_grad()
        backward(model.discriminator_loss(z))
        discriminator_opt.step()
    loss = model.recon_loss(z, data.edge_index, data.neg_edge_index) + model.reg_loss(z) \
        + model.kl_loss() / data.num_nodes
    backward(loss)
    encoder_opt.step()
    return loss


class Adversarial(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.automatic_optimization = False

    def training_step(self, data, batch_idx):
        enc, dis = self.optimizers()
        loss = adversarial_step(self.model, data, self.current_epoch, enc, dis, self.manual_backward)
        # the encoder went through the engine (a run undistributed on every rank would not plan)
        assert self.trainer.strategy.engine.runtime.module is self.model.encoder
        return loss

    def configure_optimizers(self):
        return optimizers(self.model)


@pytest.mark.parametrize("strategy", ["graph_parallel", "gnnpipe"])
def test_pyg_argva_trains_as_on_one_device(strategy, tmp_path):
    data = graph_with_negatives()
    torch.manual_seed(0)
    model = ARGVA(Encoder(data.num_features, 16, 8), Discriminator(8, 16, 1))
    ref = copy.deepcopy(model)
    enc, dis = optimizers(ref)
    for epoch in range(EPOCHS):
        adversarial_step(ref, data, epoch, enc, dis)
    lit = Adversarial(model)
    fit_exact(lit, strategy, data, tmp_path)
    assert_same_parameters(lit.model, ref)
