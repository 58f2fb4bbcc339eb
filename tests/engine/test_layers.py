"""The hooks around PyG's layers: inert outside the engine; on a chunk, node tensors extended to the local
graph and edge tensors left per edge, decided by what they are, also when a chunk has exactly as many
local edges as rows (a directed cycle); layers PyG runs with another flow refused by name; a layer given
several graphs that propagates a graph it built from one of them refused by name when the graph is cut.
"""
import copy

import pytest
import torch
from torch import nn
from torch_geometric.nn import GATConv, GraphConv, SAGEConv

from pyg_pipe import UnsupportedModelError
from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from pyg_pipe.engine.step.layers import LayerHooks, parameter_names
from tests.harness import ranges
from tests.shapes import TwoGraphConv, TwoGraphs, _two_graphs
from tests.zoo import zoo_graph


class EdgeWeighted(nn.Module):
    """Edge weights computed in the model, next to computed node features: on the cycle's chunk both have
    16 rows, so only the layer's parameter names (``x``, ``edge_weight``) tell them apart."""

    def __init__(self):
        super().__init__()
        self.lin, self.edge = nn.Linear(8, 12), nn.Linear(3, 1)
        self.conv1, self.conv2 = GraphConv(12, 12), GraphConv(12, 3)

    def forward(self, x, edge_index, edge_attr):
        ew = self.edge(edge_attr).squeeze(-1).sigmoid()
        h = self.conv1(self.lin(x).relu(), edge_index, ew).relu()
        return self.conv2(h, edge_index, ew)


def test_hooks_do_nothing_outside_the_engine():
    x, g, _, _ = zoo_graph()
    torch.manual_seed(0)
    model = EdgeWeighted()
    plain = copy.deepcopy(model)
    hooks = LayerHooks(model)
    hooks.install()
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(x, g["edge_index"], g["edge_attr"]),
                                       plain(x, g["edge_index"], g["edge_attr"]))
    finally:
        hooks.remove()
    assert not model.conv1._forward_pre_hooks and not model.conv1._propagate_forward_pre_hooks


def test_node_and_edge_tensors_of_the_same_length_on_a_chunk():
    torch.set_default_dtype(torch.float64)
    try:
        x, g, y, mask = zoo_graph(ring=True)     # chunk 0: a directed 16-cycle, 16 rows and 16 local edges
        torch.manual_seed(0)
        model = EdgeWeighted()
        plain = copy.deepcopy(model)
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=4, partition=ranges, shuffle_chunks=False),
                               Comm(torch.device("cpu")), num_stages=1)
        engine.install()
        lg = None
        for _ in range(2):                        # lr = 0: every training forward equals one process
            out = model(x, g["edge_index"], g["edge_attr"])
            out.sum().backward()
            lg = engine.runtime.graph.chunks[0]
        engine.uninstall()
        assert lg.rows == lg.num_edges == 16
        with torch.no_grad():
            torch.testing.assert_close(out.detach(), plain(x, g["edge_index"], g["edge_attr"]), atol=1e-9, rtol=0)
    finally:
        torch.set_default_dtype(torch.float32)


def test_parameter_names_are_the_layers_own():
    assert parameter_names(GraphConv(4, 4), 3) == ("x", "edge_index", "edge_weight")
    assert parameter_names(SAGEConv(4, 4), 3) == ("x", "edge_index", "size")
    assert parameter_names(GATConv(4, 4), 5)[:3] == ("x", "edge_index", "edge_attr")


def test_the_other_flow_on_a_sparse_adjacency_is_refused_by_name():
    """``flow="target_to_source"`` runs on an ``edge_index`` (tests/engine/test_flow.py); PyG itself runs it on
    nothing else, and the engine says so by name before PyG's own error."""
    from torch_geometric.utils import to_torch_csr_tensor

    class Backwards(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = GraphConv(8, 3, flow="target_to_source")

        def forward(self, x, adj_t):
            return self.conv(x, adj_t)

    x, g, _, _ = zoo_graph()
    adj_t = to_torch_csr_tensor(g["edge_index"].flip(0), size=(x.size(0), x.size(0)))
    engine = GNNPipeEngine(Backwards(), PipelineConfig(num_chunks=2), Comm(torch.device("cpu")), num_stages=1)
    engine.install()
    try:
        with pytest.raises(UnsupportedModelError, match=r"Layer 'conv' \(GraphConv\) uses flow='target_to_source' "
                                                        r"with a sparse adjacency"):
            engine.module(x, adj_t)
    finally:
        engine.uninstall()


def test_degrees_at_the_end_a_layer_does_not_aggregate_at_are_refused():
    """A layer that normalises with ``gcn_norm`` in the other direction than it aggregates sums degrees at the
    ends of its edges whose other edges live in other chunks: refused on a cut graph, not taken as complete."""
    from torch_geometric.nn import MessagePassing
    from torch_geometric.nn.conv import gcn_conv

    class OtherWay(MessagePassing):
        def forward(self, x, edge_index):  # (looked up at the call, as PyG's layers do)
            edge_index, w = gcn_conv.gcn_norm(edge_index, None, x.size(0), flow="target_to_source")
            return self.propagate(edge_index, x=x, w=w)

        def message(self, x_j, w):
            return w.view(-1, 1) * x_j

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.conv = nn.Linear(8, 4), OtherWay()

        def forward(self, x, edge_index):
            return self.conv(self.lin(x), edge_index)

    x, g, _, _ = zoo_graph()
    engine = GNNPipeEngine(Net(), PipelineConfig(num_chunks=2, streaming=False), Comm(torch.device("cpu")),
                           num_stages=1)
    engine.install()
    try:
        with pytest.raises(UnsupportedModelError, match=r"gcn_norm\(flow='target_to_source'\).*flow=self.flow"):
            engine.module(x, g["edge_index"])
    finally:
        engine.uninstall()


class TwoGraphLoopsConv(TwoGraphConv):
    """A layer given two graphs that adds self loops to one of them itself before propagating it."""

    def forward(self, x, edge_index_a, weight_a, edge_index_b, weight_b):
        from torch_geometric.utils import add_self_loops
        ei_b, _ = add_self_loops(edge_index_b, num_nodes=x.size(0))
        return self.propagate(edge_index_a, x=self.lin_a(x), w=weight_a) + self.propagate(
            ei_b, x=self.lin_b(x), w=torch.ones(ei_b.size(1), dtype=x.dtype))


@pytest.mark.parametrize("chunks", [1, 4])
def test_a_graph_built_in_a_layer_given_several_graphs_is_refused_when_the_graph_is_cut(chunks):
    """Whose halo a graph built inside the layer reads cannot be told; with one chunk there is no halo."""
    torch.manual_seed(0)
    model = TwoGraphs(TwoGraphLoopsConv)
    plain = copy.deepcopy(model)
    inputs = _two_graphs(zoo_graph())
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, partition=ranges, shuffle_chunks=False),
                           Comm(torch.device("cpu")), num_stages=1)
    engine.install()
    try:
        if chunks > 1:
            with pytest.raises(UnsupportedModelError, match=r"Layer 'convs.0' was given several graphs and calls "
                                                            r"propagate with a graph it built"):
                model(**inputs)
        else:
            torch.testing.assert_close(model(**inputs), plain(**inputs))
    finally:
        engine.uninstall()
