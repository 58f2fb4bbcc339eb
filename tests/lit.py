"""An ordinary single-device node classifier, as a user would write it (nothing pyg_pipe-specific)."""
from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader


class NodeClassifier(pl.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float = 0.05, optimizer: str = "sgd", fail_on_rank: int = -1):
        super().__init__()
        self.model = model
        self.lr = lr
        self.optimizer_name = optimizer
        self.fail_on_rank = fail_on_rank
        self.train_losses = []

    def forward(self, x, edge_index):
        return self.model(x, edge_index)

    def training_step(self, data, batch_idx):
        if self.fail_on_rank == self.global_rank:
            raise RuntimeError(f"boom on rank {self.global_rank}")
        out = self(data.x, data.edge_index)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        self.train_losses.append(loss.item())
        self.log("train_loss", loss, batch_size=1)
        return loss

    def validation_step(self, data, batch_idx):
        out = self(data.x, data.edge_index)
        pred = out.argmax(-1)
        acc = (pred[data.val_mask] == data.y[data.val_mask]).float().mean()
        self.log("val_loss", F.cross_entropy(out[data.val_mask], data.y[data.val_mask]), batch_size=1)
        self.log("val_acc", acc, batch_size=1)

    def test_step(self, data, batch_idx):
        out = self(data.x, data.edge_index)
        self.log("test_acc", (out.argmax(-1)[data.test_mask] == data.y[data.test_mask]).float().mean(), batch_size=1)

    def predict_step(self, data, batch_idx):
        return self(data.x, data.edge_index)

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def graph_loader(data):
    """The documented one-graph loader: yields the same Data every epoch."""
    return DataLoader([data], batch_size=None)
