"""Ready-made deep PyG models for the examples and benchmarks: plain ``torch_geometric.nn.Sequential``
models, nothing pyg_pipe-specific (any PyG model of a supported form trains the same way)."""
from __future__ import annotations

import torch
from torch import nn
from torch_geometric.nn import GCN2Conv, DeepGCNLayer, GCNConv, MessagePassing, Sequential
from torch_geometric.utils import add_self_loops, degree


def _with_x0(x):
    return x, x


def gcnii(in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 32, alpha: float = 0.1,
          theta: float = 0.5, dropout: float = 0.5, cached: bool = False) -> Sequential:
    """GCNII (Chen et al., 2020) as a ``Sequential``: ``x0 = relu(lin(x))`` is carried to every layer.

    ``x_{l+1} = relu(GCN2Conv_l(x_l, x0))`` for ``l = 1..num_layers``, then a linear classifier.
    Shapes: ``x`` [N, in_channels], ``edge_index`` [2, E] (or a sparse ``adj_t``) -> [N, out_channels].
    """
    layers = [(nn.Dropout(dropout), "x -> x"), (nn.Linear(in_channels, hidden_channels), "x -> x"), nn.ReLU(),
              (_with_x0, "x -> x, x0")]
    for i in range(num_layers):
        layers += [(nn.Dropout(dropout), "x -> x"),
                   (GCN2Conv(hidden_channels, alpha=alpha, theta=theta, layer=i + 1, cached=cached),
                    "x, x0, edge_index -> x"),
                   nn.ReLU()]
    layers += [(nn.Dropout(dropout), "x -> x"), (nn.Linear(hidden_channels, out_channels), "x -> x")]
    return Sequential("x, edge_index", layers)


class ResGCNPlus(nn.Module):
    """ResGCN+ (DeepGCNs, Li et al., 2020): ``x + conv(relu(norm(x)))`` per layer with PyG's
    ``DeepGCNLayer(block="res+")`` around a ``GCNConv``, a linear encoder before and a normalised linear
    classifier after. Shapes: ``x`` [N, in_channels], ``edge_index`` [2, E] (or a sparse ``adj_t``) ->
    [N, out_channels]."""

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 32,
                 dropout: float = 0.1, cached: bool = False):
        super().__init__()
        self.enc = nn.Linear(in_channels, hidden_channels)
        self.layers = nn.ModuleList(
            DeepGCNLayer(GCNConv(hidden_channels, hidden_channels, cached=cached), nn.LayerNorm(hidden_channels),
                         nn.ReLU(), block="res+", dropout=dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden_channels)
        self.out = nn.Linear(hidden_channels, out_channels)

    def forward(self, x, edge_index):
        x = self.enc(x)
        for layer in self.layers:
            x = layer(x, edge_index)
        return self.out(torch.relu(self.norm(x)))


class TutorialGCNConv(MessagePassing):
    """PyG's tutorial GCN layer ("Creating message passing networks"), as written there: the symmetric
    normalisation by hand in ``forward``, its degrees counted with ``degree`` (pyg_pipe completes them)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(aggr="add")
        self.lin = nn.Linear(in_channels, out_channels, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_channels))

    def forward(self, x, edge_index):
        edge_index, _ = add_self_loops(edge_index, num_nodes=x.size(0))
        x = self.lin(x)
        row, col = edge_index
        deg = degree(col, x.size(0), dtype=x.dtype)
        deg_inv_sqrt = deg.pow(-0.5)
        deg_inv_sqrt[deg_inv_sqrt == float("inf")] = 0
        norm = deg_inv_sqrt[row] * deg_inv_sqrt[col]
        return self.propagate(edge_index, x=x, norm=norm) + self.bias

    def message(self, x_j, norm):
        return norm.view(-1, 1) * x_j
