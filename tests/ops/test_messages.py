"""``fuse_messages``: PyG layers given an ``edge_index`` whose message is the source row (optionally times a
per-edge weight) aggregate through the fused kernel, with the same outputs and gradients as PyG's path;
other layers are left alone; ``remove()`` and deep copies behave."""
import copy

import pytest
import torch
from torch_geometric import nn as gnn

from pyg_pipe.ops import fuse_messages
from tests.saga.layers import EdgeMLPConv
from tests.zoo import zoo_graph

CASES = {
    "GCNConv": (lambda: gnn.GCNConv(8, 16), "edge_weight", True),
    "GCNConv-unweighted": (lambda: gnn.GCNConv(8, 16, normalize=False), None, True),
    "GCN2Conv": (lambda: gnn.GCN2Conv(8, alpha=0.1, theta=0.5, layer=2), "edge_weight", True),
    "SAGEConv-mean": (lambda: gnn.SAGEConv(8, 16), None, True),
    "SAGEConv-max": (lambda: gnn.SAGEConv(8, 16, aggr="max"), None, True),
    "GINConv": (lambda: gnn.GINConv(torch.nn.Linear(8, 16)), None, True),
    "GraphConv-max": (lambda: gnn.GraphConv(8, 16, aggr="max"), "edge_weight", True),
    "GATConv": (lambda: gnn.GATConv(8, 8, heads=2), None, True),
    "GATConv-edge": (lambda: gnn.GATConv(8, 8, heads=2, edge_dim=3), "edge_attr", True),
    "EdgeConv": (lambda: gnn.EdgeConv(torch.nn.Linear(16, 16)), None, False),
    "hand-written edge MLP": (lambda: EdgeMLPConv(8, 16), "edge_attr", False),
    "SAGEConv-lstm": (lambda: gnn.SAGEConv(8, 16, aggr="lstm"), None, False),
}


@pytest.fixture(autouse=True)
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def _call(layer, x, g, arg):
    if isinstance(layer, gnn.GCN2Conv):
        return layer(x, x, g["edge_index"], g[arg])
    if arg is None:
        return layer(x, g["edge_index"])
    return layer(x, g["edge_index"], g[arg])


@pytest.mark.parametrize("name", list(CASES))
def test_fused_equals_pyg(name):
    make, arg, fused = CASES[name]
    torch.manual_seed(0)
    x, g, _, _ = zoo_graph()
    if name == "SAGEConv-lstm":  # LSTM aggregation needs destinations sorted
        order = torch.argsort(g["edge_index"][1], stable=True)
        g = dict(g, edge_index=g["edge_index"][:, order])
    ref = make()
    layer = copy.deepcopy(ref)
    handle = fuse_messages(layer)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = _call(layer, xa, g, arg), _call(ref, xb, g, arg)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [xa, *layer.parameters()], grad)
    exp = torch.autograd.grad(want, [xb, *ref.parameters()], grad)
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    assert handle.fused_calls == (1 if fused else 0)
    # a deep copy fuses with its own weights; remove() restores PyG's path
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2)
    torch.testing.assert_close(_call(layer, x, g, arg), want.detach(), atol=1e-10, rtol=0)
    handle.remove()
    assert "message" not in layer.__dict__
    torch.testing.assert_close(_call(layer, x, g, arg), want.detach(), atol=1e-10, rtol=0)
    assert handle.fused_calls == 0


def test_none_arguments_take_their_own_route():
    """GCNConv's message is ``x_j`` without weights and ``w * x_j`` with them: each call traces its own."""
    x, g, _, _ = zoo_graph()
    ref = gnn.GCNConv(8, 4, normalize=False)
    layer = copy.deepcopy(ref)
    handle = fuse_messages(layer)
    for w in (None, g["edge_weight"], None):
        torch.testing.assert_close(layer(x, g["edge_index"], w), ref(x, g["edge_index"], w), atol=1e-10, rtol=0)
    assert handle.fused_calls == 3
    assert set(layer._pyg_pipe_fused.routes) == {(), ("edge_weight",)}


def test_sparse_adjacency_keeps_its_own_path():
    """Given a sparse ``adj_t``, layers with ``message_and_aggregate`` never call ``message``: nothing is
    made lazy, so a GATConv called next (its ``edge_updater`` lifts rows too) is untouched."""
    from torch_geometric.utils import to_torch_csr_tensor
    x, g, _, _ = zoo_graph()
    adj_t = to_torch_csr_tensor(g["edge_index"].flip(0), size=(x.size(0), x.size(0)))
    gcn, gat = gnn.GCNConv(8, 8), gnn.GATConv(8, 4, heads=2)
    model = torch.nn.ModuleList([gcn, gat])
    ref = copy.deepcopy(model)
    handle = fuse_messages(model)
    out = model[1](model[0](x, adj_t), g["edge_index"])
    torch.testing.assert_close(out, ref[1](ref[0](x, adj_t), g["edge_index"]), atol=1e-10, rtol=0)
    assert handle.fused_calls == 1   # GATConv's, not GCNConv's


def test_weights_in_csr_order_are_kept_only_while_they_are_the_same():
    """``in_csr_order`` keeps ``w[perm]`` for the same weights (the very tensor kept), permutes anew after an
    in-place change and for another tensor, and never keeps weights that require a gradient in a grad-enabled
    call (their result carries this call's autograd graph)."""
    from pyg_pipe.ops import messages
    messages.clear_cache()
    perm = torch.randperm(40)
    w = torch.rand(40, 1)
    first = messages.in_csr_order(w, perm)
    assert torch.equal(first, w[perm]) and messages.in_csr_order(w, perm) is first
    assert any(t is first for t in messages.held())
    w.mul_(2.0)  # changed in place: permuted again
    assert torch.equal(messages.in_csr_order(w, perm), w[perm]) and messages.in_csr_order(w, perm) is not first
    learned = torch.rand(40, 1, requires_grad=True)
    a, b = messages.in_csr_order(learned, perm), messages.in_csr_order(learned, perm)
    assert a is not b and a.grad_fn is not None
    a.sum().backward()
    assert torch.equal(learned.grad, torch.ones(40, 1))
    messages.clear_cache()
    assert messages.held() == []
