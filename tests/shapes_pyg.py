"""More model shapes from PyG's own model classes and building blocks, for the same sweep as :mod:`tests.shapes`
(``MORE`` maps a name to ``(make, inputs)`` the same way): PyG's ``EdgeCNN``, ``GAT(v2=True)``, ``PNA`` on vertices,
``RECT_L``, ``LINKX`` (a ``SparseLinear`` whose weight has a row per vertex), ``MaskLabel`` ahead of a GCN,
``DirGNNConv``, a layer as the whole model (``model = SGConv(...)``), and forwards that compute from the graph's
edges outside the layers (a degree feature, GCN's normalisation by ``gcn_norm``, per-edge features from the endpoints'
inputs), which cannot run on part of the graph and are refused when it is cut.
"""
from __future__ import annotations

import torch
from torch import nn
from torch_geometric import nn as gnn
from torch_geometric.nn import GAT, GCN
from torch_geometric.nn.conv.gcn_conv import gcn_norm
from torch_geometric.utils import degree

from tests.shapes import H, _plain, graph


class MaskLabelNet(nn.Module):
    """PyG's ``MaskLabel`` (the labels of some vertices added to their features) ahead of a GCN."""

    def __init__(self):
        super().__init__()
        self.label = gnn.MaskLabel(3, 8)
        self.gcn = GCN(8, H, 3, 3)

    def forward(self, x, y, label_mask, edge_index):
        return self.gcn(self.label(x, y, label_mask), edge_index)


class DegreeFeature(nn.Module):
    """Each vertex's in-degree, computed in forward from the edges, appended to its features."""

    def __init__(self):
        super().__init__()
        self.gcn = GCN(9, H, 3, 3)

    def forward(self, x, edge_index):
        d = degree(edge_index[1], x.size(0)).view(-1, 1)
        return self.gcn(torch.cat([x, d.to(x.dtype)], 1), edge_index)


class NormalisedInForward(nn.Module):
    """GCN's normalisation computed once in forward (``gcn_norm``) and handed to layers that do not normalise."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([gnn.GCNConv(8, H, normalize=False), gnn.GCNConv(H, 3, normalize=False)])

    def forward(self, x, edge_index):
        edge_index, weight = gcn_norm(edge_index, None, x.size(0), add_self_loops=False)
        return self.convs[1](self.convs[0](x, edge_index, weight).relu(), edge_index, weight)


class EdgeFeatures(nn.Module):
    """Per-edge features from the endpoints' inputs, computed in forward, given to GINE layers."""

    def __init__(self):
        super().__init__()
        self.c1 = gnn.GINEConv(nn.Linear(8, H), edge_dim=8)
        self.c2 = gnn.GINEConv(nn.Linear(H, 3), edge_dim=8)

    def forward(self, x, edge_index):
        e = x[edge_index[0]] - x[edge_index[1]]
        return self.c2(self.c1(x, edge_index, e).relu(), edge_index, e)


class Directed(nn.Module):
    """``DirGNNConv``: each layer aggregates over the in-edges and, separately, the out-edges."""

    def __init__(self):
        super().__init__()
        self.c1 = gnn.DirGNNConv(gnn.GCNConv(8, H), root_weight=True)
        self.c2 = gnn.DirGNNConv(gnn.SAGEConv(H, 3))

    def forward(self, x, edge_index):
        return self.c2(self.c1(x, edge_index).relu(), edge_index)


def _pna():
    x, e, _, _ = graph()
    deg = torch.bincount(degree(e["edge_index"][1], x.size(0), dtype=torch.long))
    return gnn.PNA(8, H, 3, 3, aggregators=["mean", "min", "max", "std"],
                   scalers=["identity", "amplification", "attenuation"], deg=deg)


def _linkx():
    return gnn.LINKX(graph()[0].size(0), 8, H, 3, num_layers=2, num_edge_layers=1, num_node_layers=1, dropout=0.0)


def _labels(g):
    x, e, y, _ = g
    known = torch.zeros(x.size(0), dtype=torch.bool)
    known[::3] = True
    return dict(x=x, y=y, label_mask=known, edge_index=e["edge_index"])


MORE = {
    "EdgeCNN": (lambda: gnn.EdgeCNN(8, H, 3, 3), _plain),
    "GATv2": (lambda: GAT(8, H, 3, 3, v2=True, heads=2), _plain),
    "PNA-vertices": (_pna, _plain),
    "RECT_L": (lambda: gnn.models.RECT_L(8, H, dropout=0.0), _plain),
    "LINKX": (_linkx, _plain),
    "MaskLabel": (MaskLabelNet, _labels),
    "DirGNNConv": (Directed, _plain),
    "degree-in-forward": (DegreeFeature, _plain),
    "gcn_norm-in-forward": (NormalisedInForward, _plain),
    "edge-features-in-forward": (EdgeFeatures, _plain),
    # the layer itself as the model (PyG's sgc.py: ``model = SGConv(...)``), with no module around it
    "SGConv-as-the-model": (lambda: gnn.SGConv(8, 3, K=2), _plain),
    "GATConv-as-the-model": (lambda: gnn.GATConv(8, 3, heads=2, concat=False), _plain),
}
