"""PyG layers given a torch.sparse ``adj_t`` run the fused kernel after ``install()`` and give PyG's
own results: outputs, gradients w.r.t. inputs and parameters, and w.r.t. the adjacency's values."""
import copy
import warnings

import pytest
import torch
import torch_geometric.utils
from torch_geometric.nn import GCN2Conv, GCNConv, GraphConv, SAGEConv
from torch_geometric.nn.conv import gcn_conv, sage_conv

from pyg_pipe import ops
from pyg_pipe.ops import pyg as ops_pyg

N = 30
needs_kernel = pytest.mark.skipif(ops.backend() not in ("cpp", "cuda"), reason="compiled kernel not available")


@pytest.fixture(autouse=True)
def _clean():
    ops.uninstall()
    yield
    ops.uninstall()


def _graph(layout=torch.sparse_csr, seed=0):
    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, N, (2, 150), generator=gen)
    edge_index = edge_index[:, ~torch.isin(edge_index[1], torch.tensor([2, 9]))]  # empty rows 2, 9
    weight = torch.rand(edge_index.size(1), generator=gen) + 0.1
    adj_t = torch.sparse_coo_tensor(edge_index.flip(0), weight, (N, N)).coalesce()
    if layout == torch.sparse_csr:
        adj_t = adj_t.to_sparse_csr()
    x = torch.randn(N, 12, generator=gen)
    return x, adj_t


def _run(conv, x, adj_t, *extra):
    x = x.clone().requires_grad_()
    out = conv(x, *extra, adj_t)
    loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    params = [p for p in conv.parameters()]
    grads = torch.autograd.grad(loss, [x] + params)
    return out.detach(), grads


CONVS = {
    "gcn": lambda: GCNConv(12, 8, cached=False),
    "gcn_no_norm": lambda: GCNConv(12, 8, normalize=False),
    "sage_mean": lambda: SAGEConv(12, 8, aggr="mean"),
    "sage_max": lambda: SAGEConv(12, 8, aggr="max"),
    "graph_max": lambda: GraphConv(12, 8, aggr="max"),
    "graph_sum": lambda: GraphConv(12, 8, aggr="add"),
}


@needs_kernel
@pytest.mark.parametrize("name", list(CONVS))
@pytest.mark.parametrize("layout", [torch.sparse_csr, torch.sparse_coo], ids=["csr", "coo"])
def test_conv_equals_pyg(name, layout, monkeypatch):
    torch.manual_seed(0)
    conv = CONVS[name]()
    x, adj_t = _graph(layout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyG warns about COO -> CSR conversions
        ref_out, ref_grads = _run(copy.deepcopy(conv), x, adj_t)
        calls = []
        real = ops_pyg.csr_aggregate
        monkeypatch.setattr(ops_pyg, "csr_aggregate", lambda *a, **k: calls.append(k["reduce"]) or real(*a, **k))
        with ops.fused_kernels():
            out, grads = _run(conv, x, adj_t)
    assert calls, "the fused kernel was not used"
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_gcn2conv_equals_pyg():
    torch.manual_seed(0)
    conv = GCN2Conv(12, alpha=0.1, theta=0.5, layer=2)
    x, adj_t = _graph()
    x0 = torch.randn(N, 12)
    ref_out, ref_grads = _run(copy.deepcopy(conv), x, adj_t, x0)
    ops.install()
    out, grads = _run(conv, x, adj_t, x0)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("layout", [torch.sparse_csr, torch.sparse_coo], ids=["csr", "coo"])
def test_gradient_to_adjacency_values(reduce, layout):
    """``adj_t.requires_grad``: the sparse gradient (values and layout) equals PyG's torch.sparse.mm."""
    x, adj_t = _graph(layout)
    x = x.double().requires_grad_()
    grads = []
    for use_kernel in (False, True):
        adj = adj_t.detach().double().requires_grad_()
        if use_kernel:
            ops.install()
        out = torch_geometric.utils.spmm(adj, x, reduce=reduce)
        gx, ga = torch.autograd.grad((out * out).sum(), [x, adj])
        grads.append((out.detach(), gx, ga))
        ops.uninstall()
    (o0, gx0, ga0), (o1, gx1, ga1) = grads
    torch.testing.assert_close(o1, o0)
    torch.testing.assert_close(gx1, gx0)
    assert ga1.layout == ga0.layout == layout
    torch.testing.assert_close(ga1.to_dense(), ga0.to_dense())


def test_install_is_idempotent_and_reversible():
    original = torch_geometric.utils.spmm
    assert not ops.installed()
    ops.install()
    ops.install()
    assert ops.installed()
    fused = torch_geometric.utils.spmm
    assert fused is not original and gcn_conv.spmm is fused and sage_conv.spmm is fused
    ops.uninstall()
    ops.uninstall()
    assert not ops.installed()
    assert torch_geometric.utils.spmm is original and gcn_conv.spmm is original and sage_conv.spmm is original


def test_context_manager_nests():
    with ops.fused_kernels():
        assert ops.installed()
        with ops.fused_kernels():
            assert ops.installed()
        assert ops.installed()  # the inner scope did not install, so it does not uninstall
    assert not ops.installed()
    ops.install()
    with ops.fused_kernels():
        pass
    assert ops.installed()  # installed before the scope: stays


def test_unsupported_calls_go_to_pyg(monkeypatch):
    """Other reductions, dtypes and dense/edge-index inputs reach PyG's original spmm unchanged."""
    x, adj_t = _graph()
    calls = []
    monkeypatch.setattr(ops_pyg, "csr_aggregate", lambda *a, **k: calls.append(1))
    ops.install()
    spmm = torch_geometric.utils.spmm
    torch.testing.assert_close(spmm(adj_t, x, "min"), torch.sparse.mm(adj_t, x, "amin"))
    with pytest.raises(ValueError, match="must be a"):
        spmm(adj_t.to_dense(), x, "sum")  # PyG's own error for a dense src
    uncoalesced = torch.sparse_coo_tensor(adj_t.to_sparse_coo().indices(), adj_t.values(), (N, N))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spmm(uncoalesced, x, "sum")
    with pytest.raises(ValueError):
        spmm(adj_t, x, "median")  # PyG's own error message
    assert calls == []
