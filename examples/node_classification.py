"""Node classification with ``strategy="gnnpipe"``: PyG's GCN on Cora (or a generated graph), on CPU processes.

    python examples/node_classification.py                  # Cora when online, else a generated graph
    python examples/node_classification.py --offline --devices 4 --epochs 100
    python examples/node_classification.py --offline --precision bf16-mixed

The LightningModule is an ordinary single-device one; ``import pyg_pipe`` and ``strategy="gnnpipe"`` are
the only changes. On GPUs: ``--accelerator gpu`` (one process per GPU).
"""
import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch_geometric.nn import GCN

import pyg_pipe
from pyg_pipe.graph import sbm_graph


class NodeClassifier(pl.LightningModule):
    def __init__(self, in_channels: int, num_classes: int):
        super().__init__()
        self.model = GCN(in_channels, 64, num_layers=4, out_channels=num_classes)

    def forward(self, x, edge_index):
        return self.model(x, edge_index)

    def training_step(self, data, batch_idx):
        loss = F.cross_entropy(self(data.x, data.edge_index)[data.train_mask], data.y[data.train_mask])
        self.log("train_loss", loss, batch_size=1)
        return loss

    def test_step(self, data, batch_idx):
        pred = self(data.x, data.edge_index).argmax(-1)
        self.log("test_acc", (pred[data.test_mask] == data.y[data.test_mask]).float().mean(), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01, weight_decay=5e-4)


def load(offline: bool):
    if not offline:
        try:
            from torch_geometric.datasets import Planetoid
            return Planetoid("data/Planetoid", "Cora")[0]
        except Exception as exc:  # noqa: BLE001 - offline: a generated graph instead
            print(f"Cora could not be loaded ({type(exc).__name__}); training on a generated graph")
    return sbm_graph(2708, num_classes=7, avg_degree=4, num_features=64, seed=0)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--accelerator", default="cpu", help="gpu: one process per GPU")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1, help="machines (under torchrun or SLURM)")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--offline", action="store_true", help="skip the download, use a generated graph")
    p.add_argument("--precision", default="32-true", help="bf16-mixed: Lightning's autocast, through the pipeline")
    args = p.parse_args()
    data = load(args.offline)
    trainer = pl.Trainer(strategy="gnnpipe", accelerator=args.accelerator, devices=args.devices,
                         num_nodes=args.num_nodes, max_epochs=args.epochs, precision=args.precision, logger=False,
                         enable_checkpointing=False)
    model = NodeClassifier(data.num_features, int(data.y.max()) + 1)
    trainer.fit(model, datamodule=pyg_pipe.FullGraphDataModule(data))
    result = trainer.test(model, datamodule=pyg_pipe.FullGraphDataModule(data))
    if trainer.is_global_zero:
        print(f"test accuracy {result[0]['test_acc']:.3f}")
