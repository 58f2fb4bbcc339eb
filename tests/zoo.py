"""PyG's conv classes, each in a three-layer model as a user would stack them (nothing pyg_pipe-specific),
then the layers of :mod:`pyg_pipe.saga` (one per Gather route), which must be exact the same way.

``ZOO`` maps a case name to ``(make, call, kwargs)``: ``make(c_in, c_out)`` builds one layer (``None``
channels for layers of fixed width, wrapped between linear maps), ``call(conv, x, x0, g)`` calls it
with the inputs of :func:`zoo_graph` (``g`` holds ``edge_index``, ``edge_weight``, ``edge_attr``,
``edge_type``, ``pos``). ``SKIPPED`` lists the classes left out, with the reason.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric import nn as gnn
from torch_geometric.utils import degree, to_undirected

from pyg_pipe import saga
from tests.saga import layers as saga_layers

HIDDEN = 12


def _mlp(a, b, norm=False):
    layers = [nn.Linear(a, b), nn.ReLU(), nn.Linear(b, b)]
    if norm:
        layers.insert(1, nn.BatchNorm1d(b))
    return nn.Sequential(*layers)


def _plain(conv, x, x0, g):
    return conv(x, g["edge_index"])


def _weighted(conv, x, x0, g):
    return conv(x, g["edge_index"], g["edge_weight"])


def _attr(conv, x, x0, g):
    return conv(x, g["edge_index"], g["edge_attr"])


def _typed(conv, x, x0, g):
    return conv(x, g["edge_index"], g["edge_type"])


def _pos(conv, x, x0, g):
    return conv(x, g["pos"], g["edge_index"])


def _ppf(conv, x, x0, g):
    return conv(x, g["pos"], g["pos"], g["edge_index"])


def _with_x0(conv, x, x0, g):
    return conv(x, x0, g["edge_index"], g["edge_weight"])


def _with_x0_unweighted(conv, x, x0, g):
    return conv(x, x0, g["edge_index"])


def _stack(conv, x, x0, g):  # DNAConv reads a stack of earlier representations [N, L, C]
    return conv(torch.stack([x0, x], dim=1), g["edge_index"])


def _pna(a, b):
    return gnn.PNAConv(a, b, aggregators=["mean", "min", "max", "std"],
                       scalers=["identity", "amplification", "attenuation"], deg=torch.tensor([0, 4, 8, 6, 3, 2, 1]))


ZOO = {
    "SimpleConv": (lambda a, b: gnn.SimpleConv(aggr="mean", combine_root="self_loop"), _plain),
    "GCNConv": (lambda a, b: gnn.GCNConv(a, b), _weighted),
    "GCNConv-unweighted": (lambda a, b: gnn.GCNConv(a, b), _plain),
    "GCNConv-improved": (lambda a, b: gnn.GCNConv(a, b, improved=True), _plain),
    "GCNConv-cached": (lambda a, b: gnn.GCNConv(a, b, cached=True), _weighted),
    "ChebConv": (lambda a, b: gnn.ChebConv(a, b, K=3), _weighted),
    "SAGEConv": (lambda a, b: gnn.SAGEConv(a, b), _plain),
    "SAGEConv-max": (lambda a, b: gnn.SAGEConv(a, b, aggr="max"), _plain),
    "GraphConv": (lambda a, b: gnn.GraphConv(a, b), _weighted),
    "GatedGraphConv": (lambda a, b: gnn.GatedGraphConv(HIDDEN, num_layers=2), _weighted, "fixed"),
    "ResGatedGraphConv": (lambda a, b: gnn.ResGatedGraphConv(a, b), _plain),
    "GATConv": (lambda a, b: gnn.GATConv(a, b, heads=2, concat=False), _plain),
    "GATConv-edge": (lambda a, b: gnn.GATConv(a, b, heads=2, edge_dim=3), _attr, "heads2"),
    "GATv2Conv": (lambda a, b: gnn.GATv2Conv(a, b, heads=2, concat=False), _plain),
    "TransformerConv": (lambda a, b: gnn.TransformerConv(a, b, heads=2, concat=False, edge_dim=3), _attr),
    "AGNNConv": (lambda a, b: gnn.AGNNConv(), _plain, "fixed"),
    "TAGConv": (lambda a, b: gnn.TAGConv(a, b, K=2), _weighted),
    "GINConv": (lambda a, b: gnn.GINConv(_mlp(a, b)), _plain),
    "GINConv-batchnorm": (lambda a, b: gnn.GINConv(_mlp(a, b, norm=True)), _plain),
    "GINEConv": (lambda a, b: gnn.GINEConv(_mlp(a, b), edge_dim=3), _attr),
    "ARMAConv": (lambda a, b: gnn.ARMAConv(a, b, num_stacks=2, num_layers=2), _weighted),
    "SGConv": (lambda a, b: gnn.SGConv(a, b, K=2), _weighted),
    "SGConv-cached": (lambda a, b: gnn.SGConv(a, b, K=2, cached=True), _weighted),
    "SSGConv": (lambda a, b: gnn.SSGConv(a, b, alpha=0.1, K=2), _weighted),
    "APPNP": (lambda a, b: gnn.APPNP(K=3, alpha=0.1), _weighted, "fixed"),
    "MFConv": (lambda a, b: gnn.MFConv(a, b, max_degree=6), _plain),
    "RGCNConv": (lambda a, b: gnn.RGCNConv(a, b, num_relations=2), _typed),
    "FastRGCNConv": (lambda a, b: gnn.FastRGCNConv(a, b, num_relations=2), _typed),
    "RGATConv": (lambda a, b: gnn.RGATConv(a, b, num_relations=2), _typed),
    "DNAConv": (lambda a, b: gnn.DNAConv(HIDDEN, heads=2, groups=1), _stack, "fixed"),
    "PointNetConv": (lambda a, b: gnn.PointNetConv(_mlp(a + 3, b), _mlp(b, b)), _pos),
    "GMMConv": (lambda a, b: gnn.GMMConv(a, b, dim=3, kernel_size=2), _attr),
    "NNConv": (lambda a, b: gnn.NNConv(a, b, nn.Linear(3, a * b)), _attr),
    "CGConv": (lambda a, b: gnn.CGConv(HIDDEN, dim=3), _attr, "fixed"),
    "EdgeConv": (lambda a, b: gnn.EdgeConv(_mlp(2 * a, b)), _plain),
    "PPFConv": (lambda a, b: gnn.PPFConv(_mlp(a + 4, b), _mlp(b, b)), _ppf),
    "FeaStConv": (lambda a, b: gnn.FeaStConv(a, b, heads=2), _plain),
    "PointTransformerConv": (lambda a, b: gnn.PointTransformerConv(a, b), _pos),
    "LEConv": (lambda a, b: gnn.LEConv(a, b), _weighted),
    "PNAConv": (_pna, _plain),
    "ClusterGCNConv": (lambda a, b: gnn.ClusterGCNConv(a, b), _plain),
    "GENConv": (lambda a, b: gnn.GENConv(a, b), _plain),
    "GENConv-edge-batchnorm": (lambda a, b: gnn.GENConv(a, b, edge_dim=3), _attr),
    "EdgeConv-mlp-batchnorm": (lambda a, b: gnn.EdgeConv(gnn.MLP([2 * a, b, b])), _plain),
    "PointNetConv-mlp-batchnorm": (lambda a, b: gnn.PointNetConv(gnn.MLP([a + 3, b, b]), gnn.MLP([b, b, b])), _pos),
    "GENConv-edge": (lambda a, b: gnn.GENConv(a, b, edge_dim=3, norm="layer"), _attr),
    "GCN2Conv": (lambda a, b: gnn.GCN2Conv(HIDDEN, alpha=0.1), _with_x0, "fixed"),
    "WLConvContinuous": (lambda a, b: gnn.WLConvContinuous(), _weighted, "fixed"),
    "FiLMConv": (lambda a, b: gnn.FiLMConv(a, b, num_relations=2), _typed),
    "SuperGATConv": (lambda a, b: gnn.SuperGATConv(a, b, heads=2, concat=False), _plain),
    "FAConv": (lambda a, b: gnn.FAConv(HIDDEN), _with_x0_unweighted, "fixed"),
    "EGConv": (lambda a, b: gnn.EGConv(a, b, aggregators=["symnorm"], num_heads=1, num_bases=2), _plain),
    # self loops added inside the layer with the vertex count inferred from the graph it is given
    "EGConv-aggregators": (lambda a, b: gnn.EGConv(a, b, aggregators=["mean", "max"], num_heads=4), _plain),
    "PDNConv": (lambda a, b: gnn.PDNConv(a, b, edge_dim=3, hidden_channels=8), _attr),
    "GeneralConv": (lambda a, b: gnn.GeneralConv(a, b, in_edge_channels=3), _attr),
    "LGConv": (lambda a, b: gnn.LGConv(), _weighted, "fixed"),
    "PointGNNConv": (lambda a, b: gnn.PointGNNConv(_mlp(HIDDEN, 3), _mlp(HIDDEN + 3, HIDDEN), _mlp(HIDDEN, HIDDEN)),
                     _pos, "fixed"),
    "AntiSymmetricConv": (lambda a, b: gnn.AntiSymmetricConv(HIDDEN, num_iters=2), _plain, "fixed"),
    "DirGNNConv": (lambda a, b: gnn.DirGNNConv(gnn.GCNConv(a, b), alpha=0.5), _plain),
    "MixHopConv": (lambda a, b: gnn.MixHopConv(a, b, powers=[0, 1, 2]), _plain, "times3"),
    # pyg_pipe.saga layers: compiled to MessagePassing, each Gather route (gated, weighted, copy, edges)
    "SAGA-GGCN": (lambda a, b: saga.GGCN(a, b), _plain),
    "SAGA-GCN": (lambda a, b: saga.SAGAGCN(a, b), _weighted),
    "SAGA-GAT": (lambda a, b: saga.SAGAGAT(a, b, heads=2), _plain, "heads2"),
    "SAGA-mean-copy": (lambda a, b: saga_layers.MeanSAGE(a, b), _plain),
    "SAGA-weighted-max": (lambda a, b: saga_layers.WeightedMax(a, b), _weighted),
    "SAGA-edge-mlp": (lambda a, b: saga_layers.EdgeMLP(a, b), _attr),
}

SKIPPED = {
    "CuGraphSAGEConv": "needs pylibcugraphops (GPU only)", "CuGraphGATConv": "needs pylibcugraphops (GPU only)",
    "CuGraphRGCNConv": "needs pylibcugraphops (GPU only)", "FusedGATConv": "needs dgNN (GPU only)",
    "SplineConv": "needs torch-spline-conv", "XConv": "needs torch-cluster",
    "SignedConv": "takes a positive and a negative graph", "HypergraphConv": "takes hyperedges, not a graph",
    "PANConv": "returns a path-integral matrix for PANPooling", "WLConv": "colours integer labels, not trainable",
    "HGTConv": "heterogeneous graphs", "HANConv": "heterogeneous graphs", "HEATConv": "heterogeneous graphs",
    "HeteroConv": "heterogeneous graphs", "MeshCNNConv": "takes mesh edges", "GPSConv": "see test_models",
}


class ZooNet(nn.Module):
    """Three layers of one conv class with ReLU between them (linear maps around fixed-width layers)."""

    def __init__(self, name: str, c_in: int = 8, c_out: int = 3):
        super().__init__()
        entry = ZOO[name]
        make, self._call = entry[0], entry[1]
        flags = entry[2] if len(entry) > 2 else ""
        self.lin_in = nn.Linear(c_in, HIDDEN)
        if flags == "fixed":
            dims = [(HIDDEN, HIDDEN)] * 3
        elif flags == "heads2":
            dims = [(HIDDEN, HIDDEN // 2)] * 3
        elif flags == "times3":
            dims = [(HIDDEN, HIDDEN // 3)] * 3
        else:
            dims = [(HIDDEN, HIDDEN)] * 3
        self.convs = nn.ModuleList(make(a, b) for a, b in dims)
        self.lin_out = nn.Linear(HIDDEN, c_out)

    def forward(self, x, edge_index, edge_weight, edge_attr, edge_type, pos):
        g = dict(edge_index=edge_index, edge_weight=edge_weight, edge_attr=edge_attr, edge_type=edge_type, pos=pos)
        x = x0 = self.lin_in(x).relu()
        for i, conv in enumerate(self.convs):
            x = self._call(conv, x, x0, g)
            if i < len(self.convs) - 1:
                x = x.relu()
        return self.lin_out(x)


def zoo_graph(sizes=(16, 48), seed: int = 0, ring: bool = False):
    """Disconnected random undirected graphs of ``sizes`` vertices, a few self loops and one isolated
    vertex per part, and every edge tensor the zoo needs. With chunks of ``sizes[0]`` consecutive
    vertices (:func:`tests.harness.ranges`) the first chunk is a whole component, with no halo, while
    the others read each other's rows.

    ``ring``: the first part is a directed cycle instead (no self loops there), so that chunk has as
    many local edges as rows: tensors per vertex and per edge have the same length there."""
    gen = torch.Generator().manual_seed(seed)
    eis, offset = [], 0
    for i, size in enumerate(sizes):
        if ring and i == 0:
            eis.append(torch.stack([torch.arange(size), (torch.arange(size) + 1) % size]))
            offset += size
            continue
        src = torch.randint(0, size - 1, (3 * size,), generator=gen)
        dst = torch.randint(0, size - 1, (3 * size,), generator=gen)
        keep = src != dst
        eis.append(to_undirected(torch.stack([src[keep], dst[keep]]), num_nodes=size) + offset)
        offset += size
    N = offset
    loops = torch.arange(sizes[0] if ring else 0, N, 7)
    edge_index = torch.cat(eis + [torch.stack([loops, loops])], 1)
    E = edge_index.size(1)
    y = torch.randint(0, 3, (N,), generator=gen)
    x = torch.randn(N, 8, generator=gen) + F.one_hot(y, 8).float()
    mask = torch.rand(N, generator=gen) < 0.7
    inputs = dict(edge_index=edge_index, edge_weight=torch.rand(E, generator=gen) + 0.5,
                  edge_attr=torch.randn(E, 3, generator=gen), edge_type=torch.randint(0, 2, (E,), generator=gen),
                  pos=torch.randn(N, 3, generator=gen))
    assert int(degree(edge_index[1], N).max()) <= 16
    return x, inputs, y, mask
