"""Small models and graphs shared by the tests (plain PyG, nothing pyg_pipe-specific)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GAT, GCN, GCN2Conv, GraphSAGE, MessagePassing, Sequential
from torch_geometric.utils import to_undirected


def small_graph(num_nodes: int = 60, num_edges: int = 240, num_features: int = 8, num_classes: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, num_nodes, (num_edges,), generator=gen)
    dst = torch.randint(0, num_nodes, (num_edges,), generator=gen)
    keep = src != dst
    edge_index = to_undirected(torch.stack([src[keep], dst[keep]]), num_nodes=num_nodes)
    y = torch.randint(0, num_classes, (num_nodes,), generator=gen)
    x = torch.randn(num_nodes, num_features, generator=gen) + F.one_hot(y, num_features).float()
    mask = torch.rand(num_nodes, generator=gen) < 0.7
    return x, edge_index, y, mask


class MeanEdgeConv(MessagePassing):
    """A user-written layer: an MLP on (x_i, x_j - x_i) per edge, mean-aggregated, plus a root term."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__(aggr="mean")
        self.msg = nn.Linear(2 * c_in, c_out)
        self.root = nn.Linear(c_in, c_out)

    def forward(self, x, edge_index):
        return self.propagate(edge_index, x=x) + self.root(x)

    def message(self, x_i, x_j):
        return self.msg(torch.cat([x_i, x_j - x_i], dim=-1))


class CustomNet(nn.Module):
    """A plain module whose forward chains user-written MessagePassing layers."""

    def __init__(self, c_in: int, hidden: int, c_out: int, num_layers: int = 4):
        super().__init__()
        dims = [c_in] + [hidden] * (num_layers - 1) + [c_out]
        self.convs = nn.ModuleList(MeanEdgeConv(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.relu(x)
        return x


def _keep_x0(x):
    return x, x


def gcnii(c_in: int, hidden: int, c_out: int, num_layers: int = 4, dropout: float = 0.0):
    """GCNII as a torch_geometric.nn.Sequential: x0 is carried to every layer."""
    layers = [(nn.Dropout(dropout), "x -> x"), (nn.Linear(c_in, hidden), "x -> x"), nn.ReLU(),
              (_keep_x0, "x -> x, x0")]
    for i in range(num_layers):
        layers += [(nn.Dropout(dropout), "x -> x"),
                   (GCN2Conv(hidden, alpha=0.1, theta=0.5, layer=i + 1), "x, x0, edge_index -> x"), nn.ReLU()]
    layers += [(nn.Dropout(dropout), "x -> x"), (nn.Linear(hidden, c_out), "x -> x")]
    return Sequential("x, edge_index", layers)


class GCNIIStack(nn.Module):
    """GCNII written as PyG's example does it, with dropout on every layer (the random numbers matter)."""

    def __init__(self, layers: int = 4, c_in: int = 8, hidden: int = 12, c_out: int = 3):
        super().__init__()
        self.lin = nn.Linear(c_in, hidden)
        self.convs = nn.ModuleList(GCN2Conv(hidden, alpha=0.1, theta=0.5, layer=i + 1) for i in range(layers))
        self.out = nn.Linear(hidden, c_out)

    def forward(self, x, edge_index):
        x = x0 = F.dropout(self.lin(x), 0.2, self.training).relu()
        for conv in self.convs:
            x = F.dropout(conv(x, x0, edge_index), 0.2, self.training).relu()
        return self.out(x)


def make_model(name: str, c_in: int = 8, hidden: int = 16, c_out: int = 3, num_layers: int = 4):
    if name == "gcn":
        return GCN(c_in, hidden, num_layers, c_out)
    if name == "sage":
        return GraphSAGE(c_in, hidden, num_layers, c_out)
    if name == "gat":
        return GAT(c_in, hidden, num_layers, c_out, heads=2)
    if name == "gcnii":
        return gcnii(c_in, hidden, c_out, num_layers)
    if name == "gcn_cached":
        return GCN(c_in, hidden, num_layers, c_out, cached=True)
    if name == "custom":
        return CustomNet(c_in, hidden, c_out, num_layers)
    raise ValueError(name)


MODELS = ["gcn", "sage", "gat", "gcnii", "custom"]


def as_data(x, edge_index, y, mask):
    from torch_geometric.data import Data
    gen = torch.Generator().manual_seed(1)
    val = (~mask) & (torch.rand(x.size(0), generator=gen) < 0.5)
    return Data(x=x, edge_index=edge_index, y=y, train_mask=mask, val_mask=val, test_mask=~(mask | val))


def forward_backward(model, opt, x, edge_index, y, mask):
    """One training step's forward, loss and backward (the caller steps the optimizer)."""
    out = model(x, edge_index)
    loss = F.cross_entropy(out[mask], y[mask])
    opt.zero_grad()
    loss.backward()
    return out, loss
