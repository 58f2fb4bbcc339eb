"""Aggregations whose output depends on the whole graph's size. Those that pad each vertex's messages to the
graph's largest in-degree (PyG's LSTM, GRU and LCM aggregations; ``SAGEConv(aggr="lstm")``): in PyG a vertex's
output depends on that largest in-degree, even of another component, and a chunk holds only its own rows'
in-degrees. They used to differ from one device
silently (a training forward off by 5e-2 with 4 chunks); they now pad to the whole graph's, and equal one
device in every mode, also where a way's renumbered rows leave its edges unsorted (they are sorted again, each
vertex's messages in the user's order). One over a graph the layer built itself is refused by name.
``EquilibriumAggregation``, whose inner gradient steps are divided by the vertex count, sees the whole graph's.
PyG's quantile and median aggregations fail when the first destination has no messages, which on a chunk is the
chunk's first vertex: they crashed on the rank holding it (the others waited); they now run on a graph where a
third of the vertices, among them every chunk's first, have no messages.

Each mode is one launch running every case (:func:`tests.harness.check_mode`).
"""
import pytest
import torch
from torch import nn
from torch_geometric import nn as gnn
from torch_geometric.nn import aggr as A
from torch_geometric.utils import add_self_loops, sort_edge_index

from tests import shapes
from tests.dist import run_distributed
from tests.harness import check_mode
from tests.zoo import zoo_graph

H = 12


class Stack(nn.Module):
    """A GCN layer, then two layers of the class under test, then a linear map."""

    def __init__(self, make):
        super().__init__()
        self.conv1, self.conv2, self.conv3 = gnn.GCNConv(8, H), make(H), make(H)
        self.lin = nn.Linear(H, 3)

    def forward(self, x, edge_index):
        x = self.conv1(x, edge_index).relu()
        return self.lin(self.conv3(self.conv2(x, edge_index).relu(), edge_index))


class LoopedLSTM(gnn.MessagePassing):
    """LSTM aggregation over a graph the layer builds itself (self loops added, sorted again)."""

    def __init__(self, h):
        super().__init__(aggr=A.LSTMAggregation(h, h))
        self.lin = nn.Linear(h, h)

    def forward(self, x, edge_index):
        edge_index, _ = add_self_loops(edge_index, num_nodes=x.size(0))
        edge_index = sort_edge_index(edge_index, num_nodes=x.size(0), sort_by_row=False)
        return self.propagate(edge_index, x=self.lin(x))


EXACT = {
    "SAGEConv(aggr='lstm')": lambda: Stack(lambda h: gnn.SAGEConv(h, h, aggr="lstm")),
    "SAGEConv(aggr=GRUAggregation)": lambda: Stack(lambda h: gnn.SAGEConv(h, h, aggr=A.GRUAggregation(h, h))),
    "GraphConv(aggr=LCMAggregation)": lambda: Stack(lambda h: gnn.GraphConv(h, h, aggr=A.LCMAggregation(h, h))),
    "SAGEConv(aggr=MultiAggregation([LSTM, mean]))": lambda: Stack(lambda h: gnn.SAGEConv(
        h, h, aggr=A.MultiAggregation([A.LSTMAggregation(h, h), A.MeanAggregation()], mode="sum"))),
    "SAGEConv(aggr=EquilibriumAggregation)": lambda: Stack(lambda h: gnn.SAGEConv(
        h, h, aggr=A.EquilibriumAggregation(h, h, [4]))),
}


QUANTILES = {
    "SAGEConv(aggr=MedianAggregation)": lambda: Stack(lambda h: gnn.SAGEConv(h, h, aggr=A.MedianAggregation())),
    "SAGEConv(aggr=QuantileAggregation(0.3, 'linear'))": lambda: Stack(lambda h: gnn.SAGEConv(
        h, h, aggr=A.QuantileAggregation(0.3, interpolation="linear"))),
}


def _few_messages(g):
    """The zoo graph less the edges into a third of its vertices, and into the first vertex of every chunk of
    ``check_mode``'s consecutive ranges (vertex 0 keeps its edges: PyG on one device needs them)."""
    x, e, _, _ = g
    ei = e["edge_index"]
    keep = (ei[1] % 3 != 1) | (ei[1] == 0)
    for start in torch.linspace(0, x.size(0), 5).long()[1:-1]:
        keep &= ei[1] != start
    return dict(x=x, edge_index=ei[:, keep])


def _worker(rank, world, mode, outcomes):
    g = zoo_graph()
    _, _, y, mask = g
    inputs = shapes._by_destination(g)  # sorted by destination, as these aggregations need
    cases = [(name, make, inputs) for name, make in dict(EXACT, looped=lambda: Stack(LoopedLSTM)).items()]
    for name, make, case_inputs in cases + [(name, make, _few_messages(g)) for name, make in QUANTILES.items()]:
        got = check_mode(mode, make, case_inputs, y, mask, world)
        if rank == 0:
            outcomes.put((name, got))


MODES = {"graph_parallel": 2, "chunks": 2, "graph_parallel_chunks": 2, "streaming": 1, "hybrid": 4}


@pytest.mark.parametrize("mode", list(MODES))
def test_aggregations_that_read_the_graphs_size_equal_one_device(mode):
    import torch.multiprocessing as mp
    outcomes = mp.get_context("forkserver").Manager().Queue()
    run_distributed(_worker, MODES[mode], mode, outcomes, timeout=400)
    got = dict(outcomes.get() for _ in range(len(EXACT) + len(QUANTILES) + 1))
    for name in list(EXACT) + list(QUANTILES):
        assert got[name] == "exact", (mode, name, got[name])
    assert got["looped"].startswith("refused:"), got["looped"]  # on every rank (check_mode agrees)
    assert "Layer 'conv2' (LoopedLSTM) aggregates with LSTMAggregation" in got["looped"], got["looped"]
