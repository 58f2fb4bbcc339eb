"""SAGA layers equal PyG's own layers and hand-written MessagePassing layers, on every Gather route, with
the rewrite on and off; the rewrite is decided by structure; the fused routes run inside the engine.

(Every pyg_pipe mode is covered by the zoo sweeps, tests/engine/test_zoo.py, whose ``SAGA-*`` cases
run one layer per route.)"""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import GATConv, GCNConv, ResGatedGraphConv, SAGEConv

from pyg_pipe.saga import GGCN, SAGAGAT, SAGAGCN, SAGALayer, compile_apply_edge
from tests.dist import run_distributed
from tests.saga.layers import EdgeMLP, EdgeMLPConv, MeanSAGE, WeightedMax, WeightedMaxConv
from tests.zoo import zoo_graph

ATOL = 1e-10


@pytest.fixture(autouse=True)
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _graph():
    """Two components with self loops and an isolated vertex per part, edge weights and features."""
    x, g, _, _ = zoo_graph()
    return x, g


def _copy_params(dst, pairs):
    with torch.no_grad():
        for a, b in pairs:
            a.copy_(b)


def _same(saga_layer, pyg_layer, call_saga, call_pyg, x):
    """Forward and the gradients w.r.t. the input and every parameter agree."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, out_b = call_saga(saga_layer, xa), call_pyg(pyg_layer, xb)
    torch.testing.assert_close(out_a, out_b, atol=ATOL, rtol=0)
    g = torch.randn_like(out_a)
    ga = torch.autograd.grad(out_a, [xa, *saga_layer.parameters()], g)
    gb = torch.autograd.grad(out_b, [xb, *pyg_layer.parameters()], g)
    torch.testing.assert_close(ga[0], gb[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(sorted(t.abs().sum().item() for t in ga[1:]),
                               sorted(t.abs().sum().item() for t in gb[1:]), atol=1e-8, rtol=1e-10)


def _ggcn_pair(rewrite=True, fused=True):
    ref = ResGatedGraphConv(12, 16)
    layer = GGCN(12, 16, rewrite=rewrite, fused=fused)
    _copy_params(layer, [(layer.A.weight, ref.lin_key.weight), (layer.A.bias, ref.lin_key.bias),
                         (layer.B.weight, ref.lin_query.weight), (layer.B.bias, ref.lin_query.bias),
                         (layer.V.weight, ref.lin_value.weight), (layer.V.bias, ref.lin_value.bias),
                         (layer.U.weight, ref.lin_skip.weight), (layer.bias, ref.bias)])
    return layer, ref


@pytest.mark.parametrize("rewrite,fused,route", [(True, True, "gated"), (True, False, "edges"),
                                                 (False, True, "edges"), (False, False, "edges")])
def test_ggcn_equals_resgatedgraphconv(rewrite, fused, route):
    torch.manual_seed(0)
    x, g = _graph()
    x = torch.randn(x.size(0), 12)
    layer, ref = _ggcn_pair(rewrite, fused)
    call = lambda m, h: m(h, g["edge_index"])  # noqa: E731
    _same(layer, ref, call, call, x)
    assert layer.route == route and layer.last_route == route


def test_ggcn_rewrite_moves_three_products_per_vertex():
    program = compile_apply_edge(GGCN(4, 4))
    assert len(program.hoisted("src")) == 2 and len(program.hoisted("dst")) == 1
    assert program.route == "gated"
    ops = [n.op for n in program.edge.nodes if n.op not in ("placeholder", "output")]
    assert "call_module" not in ops, "no linear layer may run per edge after the rewrite"


def test_gcn_equals_gcnconv():
    torch.manual_seed(0)
    x, g = _graph()
    ref, layer = GCNConv(8, 16), SAGAGCN(8, 16)
    _copy_params(layer, [(layer.lin.weight, ref.lin.weight), (layer.bias, ref.bias)])
    call = lambda m, h: m(h, g["edge_index"], g["edge_weight"])  # noqa: E731
    _same(layer, ref, call, call, x)
    assert layer.last_route == "weighted"


@pytest.mark.parametrize("heads", [1, 3])
def test_gat_equals_gatconv(heads):
    torch.manual_seed(0)
    x, g = _graph()
    ref, layer = GATConv(8, 5, heads=heads), SAGAGAT(8, 5, heads=heads)
    _copy_params(layer, [(layer.lin.weight, ref.lin.weight), (layer.att_src, ref.att_src),
                         (layer.att_dst, ref.att_dst), (layer.bias, ref.bias)])
    call = lambda m, h: m(h, g["edge_index"])  # noqa: E731
    _same(layer, ref, call, call, x)
    assert layer.last_route == "weighted"


def test_mean_copy_equals_sageconv():
    torch.manual_seed(0)
    x, g = _graph()
    ref, layer = SAGEConv(8, 16), MeanSAGE(8, 16)
    _copy_params(layer, [(layer.lin_l.weight, ref.lin_l.weight), (layer.lin_l.bias, ref.lin_l.bias),
                         (layer.lin_r.weight, ref.lin_r.weight)])
    call = lambda m, h: m(h, g["edge_index"])  # noqa: E731
    _same(layer, ref, call, call, x)
    assert layer.last_route == "copy"


@pytest.mark.parametrize("make,make_ref,arg,route", [
    (WeightedMax, WeightedMaxConv, "edge_weight", "weighted"),
    (EdgeMLP, EdgeMLPConv, "edge_attr", "edges"),
])
def test_equals_hand_written_message_passing(make, make_ref, arg, route):
    torch.manual_seed(0)
    x, g = _graph()
    layer, ref = make(8, 16), make_ref(8, 16)
    ref.load_state_dict(layer.state_dict())
    call = lambda m, h: m(h, g["edge_index"], g[arg])  # noqa: E731
    _same(layer, ref, call, call, x)
    assert layer.last_route == route


class _Dropped(SAGALayer):
    def __init__(self):
        super().__init__(gather="sum")
        self.lin = torch.nn.Linear(4, 4)

    def apply_edge(self, src):
        return F.dropout(self.lin(src), p=0.5, training=self.training)


class _Columns(SAGALayer):
    def __init__(self):
        super().__init__(gather="sum")
        self.lin = torch.nn.Linear(4, 4)

    def apply_edge(self, src):
        return self.lin(src) - self.lin(src).mean(dim=0)   # a mean over the edges: not per vertex


class _Branchy(SAGALayer):
    def __init__(self):
        super().__init__(gather="sum")
        self.lin = torch.nn.Linear(4, 4)

    def apply_edge(self, src):
        h = self.lin(src)
        return h if bool(h.sum() > 0) else -h   # control flow on values: not traceable


def test_what_stays_per_edge():
    """Dropout draws per edge and a reduction over dimension 0 mixes edges: neither moves before Scatter
    (only the linear layer does); untraceable code runs as written."""
    dropped = compile_apply_edge(_Dropped())
    assert dropped.route == "edges" and len(dropped.hoisted("src")) == 1
    assert any(n.target is F.dropout for n in dropped.edge.nodes)
    columns = compile_apply_edge(_Columns())
    assert any(n.op == "call_method" and n.target == "mean" for n in columns.edge.nodes)
    branchy = compile_apply_edge(_Branchy())
    assert branchy.edge is None and "traced" in branchy.reason
    x, g = _graph()
    x = torch.randn(x.size(0), 4)
    layer = _Branchy()
    h = layer.lin(x)
    expect = torch.zeros_like(h).index_add_(0, g["edge_index"][1], h[g["edge_index"][0]])
    expect = expect if bool(expect.sum() > 0) else -expect
    # the branch is taken over the edges' messages, as PyG would
    msgs = h[g["edge_index"][0]]
    msgs = msgs if bool(msgs.sum() > 0) else -msgs
    out = layer(x, g["edge_index"])
    torch.testing.assert_close(out, torch.zeros_like(h).index_add_(0, g["edge_index"][1], msgs))


def test_program_depends_on_structure_only():
    a, b = GGCN(4, 4), GGCN(4, 4)
    with torch.no_grad():
        for p in b.parameters():
            p.zero_()
    pa, pb = compile_apply_edge(a), compile_apply_edge(b)
    assert (pa.route, pa.hoisted("src"), pa.hoisted("dst")) == (pb.route, pb.hoisted("src"), pb.hoisted("dst"))


def test_graphs_alternate_and_copies_are_independent():
    """The CSR cache never confuses two graphs; a deep copy or an unpickled layer uses its own weights."""
    torch.manual_seed(0)
    x, g = _graph()
    x = torch.randn(x.size(0), 12)
    layer, ref = _ggcn_pair()
    other = g["edge_index"][:, torch.randperm(g["edge_index"].size(1))[:100]]
    for ei in (g["edge_index"], other, g["edge_index"], other.clone()):
        torch.testing.assert_close(layer(x, ei), ref(x, ei), atol=ATOL, rtol=0)
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        with torch.no_grad():
            twin.V.weight.mul_(2)
        assert not torch.allclose(twin(x, g["edge_index"]), layer(x, g["edge_index"]))
        torch.testing.assert_close(layer(x, g["edge_index"]), ref(x, g["edge_index"]), atol=ATOL, rtol=0)


# ---- inside the engine: the fused routes are taken, results exact --------------------------------

def _engine_worker(rank, world):
    from tests import harness
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph(ring=True)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 12)
            self.convs = torch.nn.ModuleList([GGCN(12, 12), SAGAGAT(12, 6, heads=2), SAGAGCN(12, 12),
                                              MeanSAGE(12, 3)])

        def forward(self, x, edge_index, edge_weight):
            h = self.lin(x).relu()
            for conv in self.convs[:-2]:
                h = conv(h, edge_index).relu()
            h = self.convs[2](h, edge_index, edge_weight).relu()
            return self.convs[3](h, edge_index)

    made = []

    def make():
        made.append(Net())
        return made[-1]

    inputs = dict(x=x, edge_index=g["edge_index"], edge_weight=g["edge_weight"])
    for mode in ("graph_parallel", "chunks"):
        made.clear()
        assert harness.check_mode(mode, make, inputs, y, mask, world) == "exact", mode
        routes = [c.last_route for c in made[0].convs]   # None: a layer of the other stage
        expect = ["gated", "weighted", "weighted", "copy"]
        assert all(r in (None, e) for r, e in zip(routes, expect)) and any(routes), (mode, routes)
        if mode == "graph_parallel":
            assert routes == expect, routes


def test_fused_routes_inside_the_engine():
    run_distributed(_engine_worker, 2, timeout=240)
