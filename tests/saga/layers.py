"""SAGA layers for the tests, each beside the hand-written PyG ``MessagePassing`` it must equal."""
import torch
from torch import nn
from torch_geometric.nn import MessagePassing

from pyg_pipe.saga import SAGALayer


class EdgeMLP(SAGALayer):
    """Messages from both ends and the edge data through an MLP, max Gather: nothing per vertex but the
    data itself (the ``edges`` route)."""

    def __init__(self, a, b, e=3):
        super().__init__(gather="max")
        self.mlp = nn.Sequential(nn.Linear(2 * a + e, b), nn.ReLU(), nn.Linear(b, b))
        self.root = nn.Linear(a, b)

    def apply_edge(self, src, dst, edge_attr):
        return self.mlp(torch.cat([dst, src - dst, edge_attr], dim=-1))

    def apply_vertex(self, x, gathered):
        return gathered + self.root(x)


class EdgeMLPConv(MessagePassing):
    def __init__(self, a, b, e=3):
        super().__init__(aggr="max")
        self.mlp = nn.Sequential(nn.Linear(2 * a + e, b), nn.ReLU(), nn.Linear(b, b))
        self.root = nn.Linear(a, b)

    def forward(self, x, edge_index, edge_attr):
        return self.propagate(edge_index, x=x, edge_attr=edge_attr) + self.root(x)

    def message(self, x_i, x_j, edge_attr):
        return self.mlp(torch.cat([x_i, x_j - x_i, edge_attr], dim=-1))


class MeanSAGE(SAGALayer):
    """GraphSAGE with mean: the message is the source's data (the ``copy`` route)."""

    def __init__(self, a, b):
        super().__init__(gather="mean")
        self.lin_l = nn.Linear(a, b)
        self.lin_r = nn.Linear(a, b, bias=False)

    def apply_edge(self, src):
        return src

    def apply_vertex(self, x, gathered):
        return self.lin_l(gathered) + self.lin_r(x)


class WeightedMax(SAGALayer):
    """``max_j w_ij · W x_j``: a per-edge scalar times a per-vertex product (the ``weighted`` route, max)."""

    def __init__(self, a, b):
        super().__init__(gather="max")
        self.lin = nn.Linear(a, b)

    def apply_edge(self, src, edge_attr):
        return edge_attr.view(-1, 1) * torch.tanh(self.lin(src))


class WeightedMaxConv(MessagePassing):
    def __init__(self, a, b):
        super().__init__(aggr="max")
        self.lin = nn.Linear(a, b)

    def forward(self, x, edge_index, edge_weight):
        return self.propagate(edge_index, x=x, edge_weight=edge_weight)

    def message(self, x_j, edge_weight):
        return edge_weight.view(-1, 1) * torch.tanh(self.lin(x_j))
