"""A heterogeneous graph with ``strategy="gnnpipe"``: papers and authors, papers labelled, trained as a typed
homogeneous graph (``HeteroData.to_homogeneous()``) with PyG's R-GCN layers, on CPU processes.

    python examples/heterogeneous.py                       # a generated academic graph (offline)
    python examples/heterogeneous.py --devices 2 --epochs 100 --chunks 8

pyg_pipe does not take ``HeteroData`` (nor ``to_hetero`` models) yet. ``to_homogeneous()`` keeps each vertex's
type (``node_type``) and each edge's relation (``edge_type``), and ``RGCNConv`` keeps one weight per relation,
so the model still tells the relations apart. Features of both types share one width here; with different
widths, project each type to a common width before converting (or pad).
"""
import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch_geometric.data import HeteroData
from torch_geometric.nn import RGCNConv

import pyg_pipe


class RGCN(torch.nn.Module):
    def __init__(self, in_channels, hidden, out_channels, relations):
        super().__init__()
        self.conv1 = RGCNConv(in_channels, hidden, relations)
        self.conv2 = RGCNConv(hidden, out_channels, relations)

    def forward(self, x, edge_index, edge_type):
        x = F.dropout(self.conv1(x, edge_index, edge_type).relu(), p=0.2, training=self.training)
        return self.conv2(x, edge_index, edge_type)


class PaperClassifier(pl.LightningModule):
    def __init__(self, in_channels, num_classes, relations):
        super().__init__()
        self.model = RGCN(in_channels, 64, num_classes, relations)

    def forward(self, data):
        return self.model(data.x, data.edge_index, data.edge_type)

    def training_step(self, data, batch_idx):
        loss = F.cross_entropy(self(data)[data.train_mask], data.y[data.train_mask])
        self.log("train_loss", loss, batch_size=1)
        return loss

    def test_step(self, data, batch_idx):
        pred = self(data).argmax(-1)
        self.log("test_acc", (pred[data.test_mask] == data.y[data.test_mask]).float().mean(), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01, weight_decay=5e-4)


def academic_graph(papers=3000, authors=2000, topics=5, width=32, seed=0) -> HeteroData:
    """Papers in ``topics`` topics cite papers of their own topic mostly; authors write papers of one topic
    mostly; a paper's features are a noisy hint of its topic, an author's are noise."""
    gen = torch.Generator().manual_seed(seed)
    topic = torch.randint(0, topics, (papers,), generator=gen)
    field = torch.randint(0, topics, (authors,), generator=gen)
    data = HeteroData()
    data["paper"].x = torch.randn(papers, width, generator=gen) + 0.6 * F.one_hot(topic, width).float()
    data["paper"].y = topic
    data["author"].x = torch.randn(authors, width, generator=gen)

    def pick(pool_topic, want, n):  # for each of n edges a paper of topic want[i] (80 %) or any paper (20 %)
        order = torch.argsort(pool_topic)
        counts = torch.bincount(pool_topic, minlength=topics)
        starts = torch.cumsum(counts, 0) - counts
        same = order[starts[want] + (torch.rand(n, generator=gen) * counts[want]).long()]
        anyone = torch.randint(0, pool_topic.numel(), (n,), generator=gen)
        return torch.where(torch.rand(n, generator=gen) < 0.8, same, anyone)

    src = torch.randint(0, papers, (4 * papers,), generator=gen)
    cites = torch.stack([src, pick(topic, topic[src], src.numel())])
    writer = torch.randint(0, authors, (3 * papers,), generator=gen)
    writes = torch.stack([writer, pick(topic, field[writer], writer.numel())])
    data["paper", "cites", "paper"].edge_index = cites
    data["author", "writes", "paper"].edge_index = writes
    data["paper", "written_by", "author"].edge_index = writes.flip(0)
    split = torch.rand(papers, generator=gen)
    data["paper"].train_mask, data["paper"].test_mask = split < 0.3, split >= 0.5
    return data


def homogeneous(hetero: HeteroData):
    """The typed homogeneous graph: masks and labels of papers, authors never in a mask."""
    data = hetero.to_homogeneous()
    n = data.num_nodes
    for key in ("train_mask", "test_mask"):
        data[key] = data[key].bool() if key in data else torch.zeros(n, dtype=torch.bool)
    data.y = data.y if "y" in data else torch.zeros(n, dtype=torch.long)
    return data


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--chunks", type=int, default=None, help="gnnpipe's num_chunks (default: 'auto', from a measured cost model)")
    p.add_argument("--epochs", type=int, default=100)
    args = p.parse_args()
    data = homogeneous(academic_graph())
    strategy = pyg_pipe.GNNPipeStrategy(num_chunks=args.chunks) if args.chunks else "gnnpipe"
    trainer = pl.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices,
                         max_epochs=args.epochs, logger=False, enable_checkpointing=False)
    model = PaperClassifier(data.num_features, int(data.y.max()) + 1, int(data.edge_type.max()) + 1)
    trainer.fit(model, datamodule=pyg_pipe.FullGraphDataModule(data))
    result = trainer.test(model, datamodule=pyg_pipe.FullGraphDataModule(data))
    if trainer.is_global_zero:
        print(f"test accuracy {result[0]['test_acc']:.3f}")
