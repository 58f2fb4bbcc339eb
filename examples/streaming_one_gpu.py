"""One device, a graph whose activations do not fit it: the layers stream over the chunks (NGra).

    python examples/streaming_one_gpu.py                       # a GPU if there is one, else the CPU
    python examples/streaming_one_gpu.py --nodes 2000000 --chunks 64 --layers 32

With ``devices=1`` and several chunks, ``strategy="gnnpipe"`` runs the model layer by layer over all
chunks: exact like plain PyG, with one chunk of one layer on the device and the values between layers in
host memory (``offload="host"``, pinned on a GPU). A deep GCNII of PyG's ``GCN2Conv`` layers.
"""
import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch_geometric.nn import GCN2Conv

import pyg_pipe
from pyg_pipe.graph import sbm_graph


class GCNII(torch.nn.Module):
    def __init__(self, in_channels: int, hidden: int, out_channels: int, layers: int):
        super().__init__()
        self.lin_in, self.lin_out = torch.nn.Linear(in_channels, hidden), torch.nn.Linear(hidden, out_channels)
        self.convs = torch.nn.ModuleList(GCN2Conv(hidden, alpha=0.1, theta=0.5, layer=i + 1) for i in range(layers))

    def forward(self, x, edge_index):
        x = x0 = self.lin_in(x).relu()
        for conv in self.convs:
            x = conv(x, x0, edge_index).relu()
        return self.lin_out(x)


class NodeClassifier(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

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
    p.add_argument("--nodes", type=int, default=50_000)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--epochs", type=int, default=20)
    args = p.parse_args()
    data = sbm_graph(args.nodes, num_classes=8, avg_degree=10, num_features=64, seed=0)
    strategy = pyg_pipe.GNNPipeStrategy(num_chunks=args.chunks, offload="host")
    trainer = pl.Trainer(strategy=strategy, accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=1,
                         max_epochs=args.epochs, logger=False, enable_checkpointing=False)
    lit = NodeClassifier(GCNII(data.num_features, 64, 8, args.layers))
    trainer.fit(lit, datamodule=pyg_pipe.FullGraphDataModule(data))
    result = trainer.test(lit, datamodule=pyg_pipe.FullGraphDataModule(data))
    if trainer.is_global_zero:
        print(f"test accuracy {result[0]['test_acc']:.3f}")
