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
from torch_geometric.utils import degree, to_torch_coo_tensor, to_torch_csr_tensor

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


class PerVertexBuffer(nn.Module):
    """A per-vertex value computed once and kept on the model (``register_buffer``, a row per vertex): the inverse
    in-degree scaling the features, and a 1-D one."""

    def __init__(self):
        super().__init__()
        x, e, _, _ = graph()
        deg = degree(e["edge_index"][1], x.size(0)).clamp(min=1)
        self.register_buffer("inv_deg", (1.0 / deg).view(-1, 1))
        self.register_buffer("scale", deg.sqrt())
        self.c1, self.c2 = gnn.GCNConv(8, H), gnn.GCNConv(H, 3)

    def forward(self, x, edge_index):
        return self.c2(self.c1(x * self.inv_deg, edge_index).relu() * self.scale[:, None], edge_index)


class PerVertexParameter(nn.Module):
    """A learned input per vertex (``nn.Parameter(torch.randn(N, d))``) added to the features, and a fixed
    positional encoding per vertex (a buffer) that a layer propagates: its halo rows are read through propagate."""

    def __init__(self):
        super().__init__()
        N = graph()[0].size(0)
        self.node_bias = nn.Parameter(0.1 * torch.randn(N, 8))
        self.register_buffer("pe", torch.sin(torch.arange(N * 4, dtype=torch.get_default_dtype()).view(N, 4)))
        self.c1, self.c2 = gnn.GCNConv(8, H), gnn.GCNConv(H, 3)
        self.pe_conv = gnn.GCNConv(4, H)

    def forward(self, x, edge_index):
        h = self.c1(x + self.node_bias, edge_index) + self.pe_conv(self.pe, edge_index)
        return self.c2(h.relu(), edge_index)


class WritesPerVertexState(nn.Module):
    """A per-vertex buffer the forward writes in place (the last hidden rows, read back the next step)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("memory", torch.zeros(graph()[0].size(0), H))
        self.c1, self.c2 = gnn.GCNConv(8, H), gnn.GCNConv(H, 3)

    def forward(self, x, edge_index):
        h = self.c1(x, edge_index).relu()
        out = self.c2(h + self.memory, edge_index)
        self.memory.copy_(h.detach())
        return out


class _EncodedConv(gnn.MessagePassing):
    """A layer of the user's holding a per-vertex positional encoding it adds to its input."""

    def __init__(self, n: int):
        super().__init__(aggr="add")
        self.register_buffer("pe", torch.sin(torch.arange(n * 8, dtype=torch.get_default_dtype()).view(n, 8)))
        self.lin = nn.Linear(8, H)

    def forward(self, x, edge_index):
        return self.propagate(edge_index, x=self.lin(x + self.pe))


class PerVertexInALayer(nn.Module):
    """The encoding held by the layer, not the model: cut only where the layer's calls are given their rows, which
    pyg_pipe does not do for a layer's own tensors (refused, naming the fix: hold it in the model)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = _EncodedConv(graph()[0].size(0)), gnn.GCNConv(H, 3)

    def forward(self, x, edge_index):
        return self.c2(self.c1(x, edge_index).relu(), edge_index)


class GraphWideWeight(nn.Module):
    """A weight matrix whose first dimension happens to equal the graph's vertex count (a hidden width as large as
    the graph), used as a weight, ``h @ W``: not per vertex. It must run exactly or be refused, never be cut."""

    def __init__(self):
        super().__init__()
        N = graph()[0].size(0)
        self.c1, self.c2 = gnn.GCNConv(8, N), gnn.GCNConv(H, 3)
        self.W = nn.Parameter(torch.randn(N, H) / N ** 0.5)

    def forward(self, x, edge_index):
        return self.c2((self.c1(x, edge_index).relu() @ self.W).relu(), edge_index)


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


class SparseInForward(nn.Module):
    """A sparse adjacency built by hand in forward from the edges, sized by the vertex count, and multiplied with
    the features (a mean of neighbours without a layer); on a cut graph its indices reach past that count, and the
    product ran outside the tensor's memory until 2026-11-29 (the process aborted)."""

    def __init__(self):
        super().__init__()
        self.lin, self.c1, self.c2 = nn.Linear(8, H), gnn.SAGEConv(H, H), gnn.SAGEConv(H, 3)

    def forward(self, x, edge_index):
        n = x.size(0)
        adj = torch.sparse_coo_tensor(edge_index.flip(0), torch.ones(edge_index.size(1), dtype=x.dtype), (n, n))
        return self.c2(self.c1(self.lin(adj @ x).relu(), edge_index).relu(), edge_index)


class TwoHopInForward(nn.Module):
    """PyG's ``to_torch_coo_tensor`` in forward and its square: a two-hop graph for the first layer (crashed the
    process the same way until 2026-11-29)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = gnn.SAGEConv(8, H), gnn.SAGEConv(H, 3)

    def forward(self, x, edge_index):
        a = to_torch_coo_tensor(edge_index, size=x.size(0))
        return self.c2(self.c1(x, (a @ a).coalesce().indices()).relu(), edge_index)


class CSRInForward(nn.Module):
    """PyG's ``to_torch_csr_tensor`` of the transpose in forward, sized by the vertex count, times the features (aborted
    the process the same way until 2026-11-29)."""

    def __init__(self):
        super().__init__()
        self.lin, self.c1, self.c2 = nn.Linear(8, H), gnn.SAGEConv(H, H), gnn.SAGEConv(H, 3)

    def forward(self, x, edge_index):
        adj = to_torch_csr_tensor(edge_index.flip(0), size=x.size(0))
        return self.c2(self.c1(self.lin(adj @ x).relu(), edge_index).relu(), edge_index)


class RootInUpdate(gnn.MessagePassing):
    """A hand-written layer adding its root term in ``update(aggr_out, x)`` (PyG's tutorials' pattern): refused with a
    ``TypeError`` until 2026-11-29, its ``x`` the engine's pair ``(rows | halo, rows)`` where one device gives a
    tensor."""

    def __init__(self, i, o):
        super().__init__(aggr="mean")
        self.neighbours, self.root = nn.Linear(i, o), nn.Linear(i, o)

    def forward(self, x, edge_index):
        return self.propagate(edge_index, x=x)

    def message(self, x_j):
        return self.neighbours(x_j)

    def update(self, aggr_out, x):
        return aggr_out + self.root(x)


class RootInUpdateNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.c3 = RootInUpdate(8, H), RootInUpdate(H, H), RootInUpdate(H, 3)

    def forward(self, x, edge_index):
        return self.c3(self.c2(self.c1(x, edge_index).relu(), edge_index).relu(), edge_index)


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
    "per-vertex-buffer": (PerVertexBuffer, _plain),
    "per-vertex-parameter": (PerVertexParameter, _plain),
    "graph-wide-weight": (GraphWideWeight, _plain),
    "per-vertex-state-written": (WritesPerVertexState, _plain),
    "per-vertex-in-a-layer": (PerVertexInALayer, _plain),
    "sparse-adjacency-in-forward": (SparseInForward, _plain),
    "two-hop-in-forward": (TwoHopInForward, _plain),
    "csr-in-forward": (CSRInForward, _plain),
    "root-in-update": (RootInUpdateNet, _plain),
}
