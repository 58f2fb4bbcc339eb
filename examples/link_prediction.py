"""Link prediction with ``strategy="gnnpipe"``: the model of PyG's ``examples/link_pred.py`` (a GCN encoder,
a dot-product decoder, no forward), on Cora when online, else on a generated graph, on CPU processes.

    python examples/link_prediction.py                        # Cora when online, else a generated graph
    python examples/link_prediction.py --offline --devices 2 --epochs 100
    python examples/link_prediction.py --strategy graph_parallel
    python examples/link_prediction.py --chunks 8              # gnnpipe with 8 chunks

The training step calls ``model.encode(x, edge_index)`` and ``model.decode(z, edge_label_index)`` as PyG's
example does: pyg_pipe distributes ``encode`` (the method that calls the layers and is handed the graph), and
the decoder and the loss run unchanged on the whole embedding every process receives. The negatives are drawn
seeded per step, so every process draws the same ones (the loss must be the same on every
process). Messages pass over the training edges only; validation and test score held-out edges with AUC.
"""
import argparse
import random

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch_geometric.data import Data
from torch_geometric.nn import GCNConv
from torch_geometric.transforms import RandomLinkSplit
from torch_geometric.utils import negative_sampling
from torchmetrics.functional.classification import binary_auroc

import pyg_pipe
from pyg_pipe.graph import sbm_graph


class Net(torch.nn.Module):
    """PyG's link prediction model (examples/link_pred.py)."""

    def __init__(self, in_channels, hidden_channels, out_channels):
        super().__init__()
        self.conv1 = GCNConv(in_channels, hidden_channels)
        self.conv2 = GCNConv(hidden_channels, out_channels)

    def encode(self, x, edge_index):
        x = self.conv1(x, edge_index).relu()
        return self.conv2(x, edge_index)

    def decode(self, z, edge_label_index):
        return (z[edge_label_index[0]] * z[edge_label_index[1]]).sum(dim=-1)


class LinkPredictor(pl.LightningModule):
    def __init__(self, in_channels: int, seed: int = 0):
        super().__init__()
        self.model = Net(in_channels, 128, 64)
        self.seed = seed

    def training_step(self, data, batch_idx):
        z = self.model.encode(data.x, data.edge_index)
        # the same negatives on every process (negative_sampling draws from torch's and Python's generators)
        seed_everywhere(self.seed + self.global_step)
        neg = negative_sampling(data.edge_index, num_nodes=data.num_nodes, num_neg_samples=data.edge_index.size(1))
        edge_label_index = torch.cat([data.edge_index, neg], dim=-1)
        edge_label = torch.cat([torch.ones(data.edge_index.size(1)), torch.zeros(neg.size(1))])
        loss = F.binary_cross_entropy_with_logits(self.model.decode(z, edge_label_index), edge_label)
        self.log("train_loss", loss, batch_size=1)
        return loss

    def _auc(self, data, split):
        z = self.model.encode(data.x, data.edge_index)
        scores = self.model.decode(z, data[f"{split}_edge_label_index"]).sigmoid()
        return binary_auroc(scores, data[f"{split}_edge_label"].long())

    def validation_step(self, data, batch_idx):
        self.log("val_auc", self._auc(data, "val"), batch_size=1)

    def test_step(self, data, batch_idx):
        self.log("test_auc", self._auc(data, "test"), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def seed_everywhere(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


def load(offline: bool) -> Data:
    """One graph with the training edges as ``edge_index`` and the held-out positive and negative edges of
    validation and test as ``{val,test}_edge_label_index`` / ``_edge_label`` (PyG's RandomLinkSplit)."""
    data = None
    if not offline:
        try:
            from torch_geometric.datasets import Planetoid
            data = Planetoid("data/Planetoid", "Cora")[0]
        except Exception as exc:  # noqa: BLE001 - offline: a generated graph instead
            print(f"Cora could not be loaded ({type(exc).__name__}); training on a generated graph")
    if data is None:
        data = sbm_graph(2708, num_classes=7, avg_degree=4, num_features=64, seed=0)
    seed_everywhere(0)  # the same split on every process
    train, val, test = RandomLinkSplit(num_val=0.05, num_test=0.1, is_undirected=True,
                                       add_negative_train_samples=False)(Data(x=data.x, edge_index=data.edge_index))
    return Data(x=train.x, edge_index=train.edge_index,
                val_edge_label_index=val.edge_label_index, val_edge_label=val.edge_label,
                test_edge_label_index=test.edge_label_index, test_edge_label=test.edge_label)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--accelerator", default="cpu", help="gpu: one process per GPU")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--strategy", default="gnnpipe", help="gnnpipe, graph_parallel or gnnpipe_hybrid")
    p.add_argument("--chunks", type=int, default=None, help="gnnpipe's num_chunks (default: 'auto', from a measured cost model)")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--offline", action="store_true", help="skip the download, use a generated graph")
    args = p.parse_args()
    data = load(args.offline)
    strategy = pyg_pipe.GNNPipeStrategy(num_chunks=args.chunks) if args.chunks else args.strategy
    trainer = pl.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices,
                         max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                         check_val_every_n_epoch=10)
    model = LinkPredictor(data.num_features)
    trainer.fit(model, datamodule=pyg_pipe.FullGraphDataModule(data))
    result = trainer.test(model, datamodule=pyg_pipe.FullGraphDataModule(data))
    if trainer.is_global_zero:
        print(f"test AUC {result[0]['test_auc']:.3f}")
