"""Pipeline stages x graph-parallel ways: a 2 x 2 grid of processes for a model of 8 GCN layers.

    python examples/hybrid.py                          # 4 CPU processes: 2 stages, each over 2 ways
    python examples/hybrid.py --stages 2 --ways 4      # 8 processes

Each stage holds half of the layers; within a stage the ways split the graph and exchange the rows of
boundary vertices at every layer, and weight gradients are summed over the ways (docs/graph_parallel.md).
Useful when a model has fewer layers than devices, or when one stage's share of the graph does not fit.
"""
import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch_geometric.nn import GCN

import pyg_pipe
from pyg_pipe.graph import sbm_graph


class NodeClassifier(pl.LightningModule):
    def __init__(self, in_channels: int, num_classes: int, layers: int):
        super().__init__()
        self.model = GCN(in_channels, 64, num_layers=layers, out_channels=num_classes)

    def training_step(self, data, batch_idx):
        out = self.model(data.x, data.edge_index)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        self.log("train_loss", loss, batch_size=1, prog_bar=True)
        return loss

    def test_step(self, data, batch_idx):
        pred = self.model(data.x, data.edge_index).argmax(-1)
        self.log("test_acc", (pred[data.test_mask] == data.y[data.test_mask]).float().mean(), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--ways", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--epochs", type=int, default=30)
    args = p.parse_args()
    data = sbm_graph(args.nodes, num_classes=8, avg_degree=10, num_features=32, seed=0)
    trainer = pl.Trainer(strategy=pyg_pipe.HybridStrategy(stages=args.stages, ways=args.ways), accelerator="cpu",
                         devices=args.stages * args.ways, max_epochs=args.epochs, logger=False,
                         enable_checkpointing=False)
    lit = NodeClassifier(data.num_features, 8, args.layers)
    trainer.fit(lit, datamodule=pyg_pipe.FullGraphDataModule(data))
    result = trainer.test(lit, datamodule=pyg_pipe.FullGraphDataModule(data))
    if trainer.is_global_zero:
        print(f"test accuracy {result[0]['test_acc']:.3f}")
