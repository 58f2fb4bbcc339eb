"""Model shapes people write, built from PyG's own classes and building blocks (nothing pyg_pipe-specific).

``SHAPES`` maps a name to ``(make, inputs)``: ``make()`` builds the model, ``inputs(graph)`` the keyword
arguments of its forward from :func:`graph` (plain tensors, or a ``Data`` for ``forward(data)``).
All dropout is 0 so that the exactness checks can compare with one process.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric import nn as gnn
from torch_geometric.data import Data
from torch_geometric.nn import GAT, GCN, GIN, GraphSAGE
from torch_geometric.nn.models import PMLP, SGFormer, Polynormer

from tests.zoo import zoo_graph

H = 12


def graph(seed: int = 0):
    """The zoo's graph with components (``x``, ``y``, ``mask`` and every edge tensor)."""
    return zoo_graph(seed=seed)


def _plain(g):
    x, e, _, _ = g
    return dict(x=x, edge_index=e["edge_index"])


class ResGCNPlus(nn.Module):
    """ResGCN+ (the GNNPipe paper's model) from PyG's DeepGCNLayer(block="res+"): an edge encoder ahead
    of the first layer, the first layer's conv used before the blocks and its norm after them."""

    def __init__(self, layers: int = 4, ckpt_grad: bool = False):
        super().__init__()
        self.node_encoder = nn.Linear(8, H)
        self.edge_encoder = nn.Linear(3, H)
        self.layers = nn.ModuleList(
            gnn.DeepGCNLayer(gnn.GENConv(H, H, aggr="softmax", t=1.0, learn_t=True, num_layers=2, norm="layer"),
                             nn.LayerNorm(H), nn.ReLU(), block="res+", dropout=0.0,
                             ckpt_grad=ckpt_grad and i % 2 == 1)
            for i in range(layers))
        self.lin = nn.Linear(H, 3)

    def forward(self, x, edge_index, edge_attr):
        x = self.node_encoder(x)
        edge_attr = self.edge_encoder(edge_attr)
        x = self.layers[0].conv(x, edge_index, edge_attr)
        for layer in self.layers[1:]:
            x = layer(x, edge_index, edge_attr)
        x = self.layers[0].act(self.layers[0].norm(x))
        return self.lin(x)


class RevBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.conv = gnn.SAGEConv(channels, channels)

    def forward(self, x, edge_index, mask):
        return self.conv(self.norm(x).relu() * mask, edge_index)


class RevGNN(nn.Module):
    """Reversible blocks (PyG's GroupAddRev: channels split in two groups, inputs rebuilt in backward)
    sharing one multiplicative mask."""

    def __init__(self, blocks: int = 3):
        super().__init__()
        self.lin1 = nn.Linear(8, H)
        self.convs = nn.ModuleList(gnn.GroupAddRev(RevBlock(H // 2), num_groups=2) for _ in range(blocks))
        self.lin2 = nn.Linear(H, 3)

    def forward(self, x, edge_index):
        x = self.lin1(x)
        mask = torch.ones_like(x)
        for conv in self.convs:
            x = conv(x, edge_index, mask)
        return self.lin2(x.relu())


class LSTMDepth(nn.Module):
    """GAT breadth layers with an LSTM carrying its state ``(1, N, d)`` across them (vertex dim 1)."""

    def __init__(self, layers: int = 3):
        super().__init__()
        self.lin1 = nn.Linear(8, H)
        self.breadth = nn.ModuleList(gnn.GATConv(H, H, heads=1) for _ in range(layers))
        self.depth = nn.ModuleList(nn.LSTM(H, H) for _ in range(layers))
        self.lin2 = nn.Linear(H, 3)

    def forward(self, x, edge_index):
        x = self.lin1(x)
        h = torch.zeros(1, x.shape[0], H, device=x.device)
        c = torch.zeros(1, x.shape[0], H, device=x.device)
        for breadth, depth in zip(self.breadth, self.depth):
            x = torch.tanh(breadth(x, edge_index))
            x, (h, c) = depth(x[None, :], (h, c))
            x = x[0]
        return self.lin2(x)


class DataNet(nn.Module):
    """``forward(self, data)``, as PyG's citation benchmarks write it."""

    def __init__(self):
        super().__init__()
        self.conv1 = gnn.GCNConv(8, H)
        self.conv2 = gnn.GCNConv(H, H)
        self.conv3 = gnn.GCNConv(H, 3)

    def forward(self, data):
        x, edge_index, edge_weight = data.x, data.edge_index, data.edge_weight
        x = F.relu(self.conv1(x, edge_index, edge_weight))
        x = F.relu(self.conv2(x, edge_index, edge_weight))
        return F.log_softmax(self.conv3(x, edge_index, edge_weight), dim=1)


class ControlFlow(nn.Module):
    """Python control flow on a tensor value and item assignment between layers. (The value is a
    parameter's: a value computed over all vertices, such as ``x.abs().max()``, would be a graph-wide
    reduction, refused when the graph is cut.)"""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([gnn.SAGEConv(8, H), gnn.SAGEConv(H, H), gnn.SAGEConv(H, 3)])
        self.gate = nn.Parameter(torch.tensor(0.5))

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < 2:
                x = x.clone()
                x[x < 0] = 0.1 * x[x < 0]              # item assignment: a leaky ReLU
                if self.gate > 0:                       # control flow on a tensor value
                    x = x * (1 + self.gate)
        return x


class GPS(nn.Module):
    """PyG's ``GPSConv`` (a local layer plus multi-head attention over all vertices) between GCN layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = gnn.GCNConv(8, H)
        self.gps = gnn.GPSConv(H, gnn.GINConv(nn.Linear(H, H)), heads=2, norm=None)
        self.conv2 = gnn.GCNConv(H, 3)

    def forward(self, x, edge_index):
        return self.conv2(self.gps(self.conv1(x, edge_index).relu(), edge_index), edge_index)


class NormNet(nn.Module):
    """GCN layers with a graph-wide norm between them."""

    def __init__(self, norm: str):
        super().__init__()
        self.convs = nn.ModuleList([gnn.GCNConv(8, H), gnn.GCNConv(H, H), gnn.GCNConv(H, 3)])
        make = {"batch": lambda: gnn.BatchNorm(H), "layer": lambda: nn.LayerNorm(H),
                "graph": lambda: gnn.GraphNorm(H), "pyg_layer_graph": lambda: gnn.LayerNorm(H, mode="graph")}[norm]
        self.norms = nn.ModuleList([make(), make()])

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < 2:
                x = self.norms[i](x).relu()
        return x


class EdgeEncoder(nn.Module):
    """An edge encoder ahead of GINE layers: an edge tensor computed in forward, used by every layer."""

    def __init__(self):
        super().__init__()
        self.edge_lin = nn.Linear(3, H)
        self.lin = nn.Linear(8, H)
        self.convs = nn.ModuleList(gnn.GINEConv(nn.Sequential(nn.Linear(H, H), nn.ReLU(), nn.Linear(H, H)))
                                   for _ in range(3))
        self.out = nn.Linear(H, 3)

    def forward(self, x, edge_index, edge_attr):
        e = self.edge_lin(edge_attr).relu()
        x = self.lin(x)
        for conv in self.convs:
            x = conv(x, edge_index, e).relu()
        return self.out(x)


class Flipped(nn.Module):
    """Both edge directions: ``edge_index.flip(0)`` computed in forward."""

    def __init__(self):
        super().__init__()
        self.fwd = nn.ModuleList([gnn.GCNConv(8, H), gnn.GCNConv(H, 3)])
        self.bwd = nn.ModuleList([gnn.GCNConv(8, H), gnn.GCNConv(H, 3)])

    def forward(self, x, edge_index):
        rev = edge_index.flip(0)
        x = F.relu(self.fwd[0](x, edge_index) + self.bwd[0](x, rev))
        return self.fwd[1](x, edge_index) + self.bwd[1](x, rev)


class ZeroInit(nn.Module):
    """Residual GCN blocks whose convs start at zero weight (a common stabiliser): a decision taken from
    values at the start would treat them as reading no neighbours."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, H)
        self.convs = nn.ModuleList(gnn.GCNConv(H, H) for _ in range(3))
        for conv in self.convs:
            nn.init.zeros_(conv.lin.weight)
        self.out = nn.Linear(H, 3)

    def forward(self, x, edge_index, ew):
        x = self.lin(x)
        for conv in self.convs:
            x = (x + conv(x, edge_index, ew)).relu()
        return self.out(x)


class TwoGraphConv(gnn.MessagePassing):
    """One layer given two graphs, each with its own edge weights and GCN normalisation (a multiplex layer;
    the second graph is directed, so its halo differs from the first's)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__(aggr="add")
        self.lin_a, self.lin_b = nn.Linear(c_in, c_out), nn.Linear(c_in, c_out, bias=False)

    def forward(self, x, edge_index_a, weight_a, edge_index_b, weight_b):
        ei_a, w_a = gnn.conv.gcn_conv.gcn_norm(edge_index_a, weight_a, x.size(0))
        ei_b, w_b = gnn.conv.gcn_conv.gcn_norm(edge_index_b, weight_b, x.size(0), add_self_loops=False)
        return self.propagate(ei_a, x=self.lin_a(x), w=w_a) + self.propagate(ei_b, x=self.lin_b(x), w=w_b)

    def message(self, x_j, w):
        return w.view(-1, 1) * x_j


class TwoGraphs(nn.Module):
    def __init__(self, conv=TwoGraphConv):
        super().__init__()
        self.convs = nn.ModuleList([conv(8, H), conv(H, H), conv(H, 3)])

    def forward(self, x, edge_index, edge_weight, edge_index_b, edge_weight_b):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index, edge_weight, edge_index_b, edge_weight_b)
            x = x.relu() if i < 2 else x
        return x


class VariationalEncoder(nn.Module):
    """PyG's VGAE example's encoder (examples/autoencoder.py): ``(mu, logstd)`` from two GCN heads."""

    def __init__(self):
        super().__init__()
        self.conv1 = gnn.GCNConv(8, 2 * H)
        self.conv_mu, self.conv_logstd = gnn.GCNConv(2 * H, H), gnn.GCNConv(2 * H, H)

    def forward(self, x, edge_index):
        x = self.conv1(x, edge_index).relu()
        return self.conv_mu(x, edge_index), self.conv_logstd(x, edge_index)


class Heads(nn.Module):
    """A dict of per-vertex outputs (logits and the embedding they come from)."""

    def __init__(self):
        super().__init__()
        self.gnn = GraphSAGE(8, H, 3, H)
        self.head = nn.Linear(H, 3)

    def forward(self, x, edge_index):
        z = self.gnn(x, edge_index)
        return {"logits": self.head(z), "embedding": z}


class RGCN(nn.Module):
    """PyG's R-GCN example (examples/rgcn.py): relational layers without features (``x=None``: a learned row
    per vertex)."""

    def __init__(self, fast: bool = False):
        super().__init__()
        conv = gnn.FastRGCNConv if fast else gnn.RGCNConv
        self.conv1 = conv(64, H, 2, num_bases=2)
        self.conv2 = conv(H, 3, 2, num_bases=2)

    def forward(self, x, edge_index, edge_type):
        x = self.conv1(x, edge_index, edge_type).relu()
        return self.conv2(x, edge_index, edge_type)


class SizeGiven(nn.Module):
    """Layers given ``size=(x.size(0), x.size(0))``, as code written for bipartite calls passes it (a crash in every
    mode until 2026-11-28: the size counted the chunk's rows, the local graph has its halo too)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.conv3 = gnn.SAGEConv(8, H), gnn.GraphConv(H, H), gnn.SAGEConv(H, 3)

    def forward(self, x, edge_index):
        x = self.conv1(x, edge_index, size=(x.size(0), x.size(0))).relu()
        x = self.conv2(x, edge_index, size=(x.size(0), x.size(0))).relu()
        return self.conv3(x, edge_index, size=(x.size(0), x.size(0)))


def _typed(g):
    x, e, _, _ = g
    assert x.size(0) == 64
    return dict(x=None, edge_index=e["edge_index"], edge_type=e["edge_type"])


def _signed(g):
    """A signed graph: the zoo graph's edges split at random into positive and negative ones."""
    x, e, _, _ = g
    ei = e["edge_index"]
    positive = torch.rand(ei.size(1), generator=torch.Generator().manual_seed(5)) < 0.6
    return dict(x=x, pos_edge_index=ei[:, positive], neg_edge_index=ei[:, ~positive])


def _two_graphs(g):
    """The zoo graph and, as a second graph, a directed half of its edges reversed, each with weights."""
    x, e, _, _ = g
    ei = e["edge_index"]
    gen = torch.Generator().manual_seed(6)
    half = ei[:, torch.rand(ei.size(1), generator=gen) < 0.5].flip(0)
    return dict(x=x, edge_index=ei, edge_weight=e["edge_weight"], edge_index_b=half,
                edge_weight_b=torch.rand(half.size(1), generator=gen) + 0.5)


def _gcnii():
    layers = [(nn.Linear(8, H), "x -> x"), nn.ReLU(), (lambda x: (x, x), "x -> x, x0")]
    for i in range(4):
        layers += [(gnn.GCN2Conv(H, alpha=0.1, theta=0.5, layer=i + 1), "x, x0, edge_index -> x"), nn.ReLU()]
    layers += [(nn.Linear(H, 3), "x -> x")]
    return gnn.Sequential("x, edge_index", layers)


def _adjacency(g):
    """The graph as a torch.sparse CSR ``adj_t`` (rows are destinations), as PyG's RevGNN example passes it."""
    x, e, _, _ = g
    ei, N = e["edge_index"], x.size(0)
    adj_t = torch.sparse_coo_tensor(torch.stack([ei[1], ei[0]]), torch.ones(ei.size(1)), (N, N)).coalesce()
    return dict(x=x, edge_index=adj_t.to_sparse_csr())


def _by_destination(g):
    """The edges sorted by destination, as PyG's sequence aggregations (LSTM, GRU) require."""
    x, e, _, _ = g
    ei = e["edge_index"]
    return dict(x=x, edge_index=ei[:, torch.argsort(ei[1] * x.size(0) + ei[0])])


def _with_batch(g):
    x, e, _, _ = g
    return dict(x=x, edge_index=e["edge_index"], batch=torch.zeros(x.size(0), dtype=torch.long))


def _sequence_aggregations():
    """SAGE layers aggregating with an LSTM, then a GRU (padded to the graph's largest in-degree)."""
    from torch_geometric.nn.aggr import GRUAggregation
    return gnn.Sequential("x, edge_index", [
        (gnn.SAGEConv(8, H, aggr="lstm"), "x, edge_index -> x"), nn.ReLU(),
        (gnn.SAGEConv(H, H, aggr=GRUAggregation(H, H)), "x, edge_index -> x"), nn.ReLU(),
        (gnn.SAGEConv(H, 3, aggr="lstm"), "x, edge_index -> x")])


def _edge_index_typed(g):
    """The graph as PyG's ``EdgeIndex`` (sorted by destination, its sort order and size cached)."""
    from torch_geometric import EdgeIndex
    x, ei = g[0], _by_destination(g)["edge_index"]
    return dict(x=x, edge_index=EdgeIndex(ei, sparse_size=(x.size(0), x.size(0)), sort_order="col"))


class EdgeParameter(nn.Module):
    """A learned weight per edge, a parameter of the model (a learned adjacency), given to GCN layers: cut per
    chunk like an edge input, its gradient through the layers' degree normalisation reaching every edge."""

    def __init__(self):
        super().__init__()
        self.ew = nn.Parameter(torch.rand(zoo_graph()[1]["edge_index"].size(1)) + 0.5)
        self.conv1, self.conv2, self.conv3 = gnn.GCNConv(8, H), gnn.GCNConv(H, H), gnn.GCNConv(H, 3)

    def forward(self, x, edge_index):
        x = self.conv1(x, edge_index, self.ew).relu()
        return self.conv3(self.conv2(x, edge_index, self.ew).relu(), edge_index, self.ew)


def _hyperedges(g):
    """Twenty hyperedges over the zoo graph's vertices, as (vertex, hyperedge) pairs."""
    x = g[0]
    gen = torch.Generator().manual_seed(0)
    vertices = torch.randint(0, x.size(0), (120,), generator=gen)
    return dict(x=x, hyperedge_index=torch.stack([vertices, torch.randint(0, 20, (120,), generator=gen)]))


class Hypergraph(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = gnn.HypergraphConv(8, H), gnn.HypergraphConv(H, 3)

    def forward(self, x, hyperedge_index):
        return self.conv2(self.conv1(x, hyperedge_index).relu(), hyperedge_index)


def _data_inputs(g):
    x, e, y, _ = g
    return dict(data=Data(x=x, edge_index=e["edge_index"], edge_weight=e["edge_weight"], y=y))


SHAPES = {
    "GCN-jk-cat": (lambda: GCN(8, H, 3, 3, jk="cat"), _plain),
    "GraphSAGE-jk-max": (lambda: GraphSAGE(8, H, 3, 3, jk="max"), _plain),
    "GAT-jk-lstm": (lambda: GAT(8, H, 3, 3, jk="lstm", heads=2), _plain),
    "GIN": (lambda: GIN(8, H, 3, 3), _plain),
    "GCN-batchnorm": (lambda: NormNet("batch"), _plain),
    "GCN-layernorm": (lambda: NormNet("layer"), _plain),
    "GCN-graphnorm": (lambda: NormNet("graph"), _plain),
    "GCN-pyg-layernorm-graph": (lambda: NormNet("pyg_layer_graph"), _plain),
    "GCNII": (_gcnii, _plain),
    "ResGCN+": (lambda: ResGCNPlus(4), lambda g: dict(x=g[0], edge_index=g[1]["edge_index"],
                                                     edge_attr=g[1]["edge_attr"])),
    "ResGCN+-ckpt": (lambda: ResGCNPlus(4, ckpt_grad=True), lambda g: dict(x=g[0], edge_index=g[1]["edge_index"],
                                                                          edge_attr=g[1]["edge_attr"])),
    "GroupAddRev": (lambda: RevGNN(3), _plain),
    "GroupAddRev-adj_t": (lambda: RevGNN(3), _adjacency),
    "LSTM-state": (lambda: LSTMDepth(3), _plain),
    "forward(data)": (DataNet, _data_inputs),
    "control-flow": (ControlFlow, _plain),
    "GPSConv": (GPS, _plain),
    "edge-encoder": (EdgeEncoder, lambda g: dict(x=g[0], edge_index=g[1]["edge_index"], edge_attr=g[1]["edge_attr"])),
    "flipped-edge_index": (Flipped, _plain),
    "zero-init-residual": (ZeroInit, lambda g: dict(x=g[0], edge_index=g[1]["edge_index"], ew=g[1]["edge_weight"])),
    "APPNP-one-layer": (lambda: gnn.Sequential("x, edge_index", [(nn.Linear(8, H), "x -> x"), nn.ReLU(),
                                                        (nn.Linear(H, 3), "x -> x"),
                                                        (gnn.APPNP(K=4, alpha=0.1), "x, edge_index -> x")]), _plain),
    "GraphUNet": (lambda: gnn.GraphUNet(8, H, 3, depth=2), _plain),
    "HypergraphConv": (Hypergraph, _hyperedges),
    # several graphs in one forward and one layer, each with a halo of its own
    "SignedGCN": (lambda: gnn.SignedGCN(8, H, num_layers=3, lamb=5), _signed),
    "two-graphs-weighted": (TwoGraphs, _two_graphs),
    # structured outputs: a tuple (VGAE's encoder) and a dict of per-vertex tensors
    "VGAE-encoder": (VariationalEncoder, _plain),
    "dict-output": (Heads, _plain),
    "size-given": (SizeGiven, _plain),
    # featureless relational layers: x=None stands for the vertex ids
    "RGCN-featureless": (RGCN, _typed),
    "FastRGCN-featureless": (lambda: RGCN(fast=True), _typed),
    # the graph as PyG's EdgeIndex; a per-edge parameter of the model as the layers' edge weights
    "EdgeIndex": (lambda: GCN(8, H, 3, 3), _edge_index_typed),
    "edge-parameter": (EdgeParameter, _plain),
    # a model given to torch.compile: the engine routes the original and runs outside the compiler (eagerly)
    "torch.compile": (lambda: torch.compile(GCN(8, H, 3, 3), backend="eager"), _plain),
    # PyG's memory option splitting the features into decomposed propagations
    "GCN-decomposed": (lambda: gnn.Sequential("x, edge_index", [
        (gnn.GCNConv(8, H, decomposed_layers=2), "x, edge_index -> x"), nn.ReLU(),
        (gnn.GCNConv(H, H, decomposed_layers=3), "x, edge_index -> x"), nn.ReLU(),
        (gnn.GCNConv(H, 3, decomposed_layers=3), "x, edge_index -> x")]), _plain),
    # aggregations padding each vertex's messages to the whole graph's largest in-degree
    "SAGE-lstm-gru": (_sequence_aggregations, _by_destination),
    # PyG's models: an MLP in training with its graph layer in eval only; local and global attention
    "PMLP": (lambda: PMLP(8, H, 3, num_layers=3), _plain),
    "Polynormer-local": (lambda: Polynormer(8, H, 3, local_layers=2, global_layers=1, in_dropout=0.0, dropout=0.0,
                                            global_dropout=0.0), _with_batch),
    "SGFormer": (lambda: SGFormer(8, H, 3, trans_num_layers=1, gnn_num_layers=2, trans_dropout=0.0,
                                  gnn_dropout=0.0), _with_batch),
}
