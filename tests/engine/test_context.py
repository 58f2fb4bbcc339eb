"""The chunk context: what hooks see while a chunk runs, and nothing outside it.

Inputs handed out for the chunk are *clean* only while unchanged (an in-place change makes them the
model's own values); copies sharing their storage are recognised; a layer's per-edge rows know their
destinations in PyG's message order; the observer (the row check) does not judge the engine's own
work.
"""
import torch
from torch_geometric.utils import to_edge_index

from pyg_pipe.engine.context import ChunkContext, Invocation, current, in_backward
from pyg_pipe.engine.step.rows import RowCheck


def _ctx(observer=None):
    return ChunkContext(cg=None, lg=None, halo=None, graphs=None, statistics=None, cache={}, observer=observer)


def test_current_is_the_innermost_context_and_none_outside():
    assert current() is None
    outer, inner = _ctx(), _ctx()
    with outer:
        assert current() is outer
        with inner:
            assert current() is inner
        assert current() is outer
    assert current() is None


def test_an_input_is_clean_until_changed_in_place():
    ctx = _ctx()
    local = torch.randn(4, 3)
    rows = []
    ctx.add_clean(local, lambda cg, lg: rows.append(1) or torch.zeros(2, 3))
    assert ctx.is_clean(local)
    assert not ctx.is_clean(local.clone())
    assert ctx.clean_rows(local.detach())(None, None).shape == (2, 3)  # a detached copy: found by its storage
    local.add_(1.0)
    assert not ctx.is_clean(local)


def test_edge_inputs_are_known_while_unchanged():
    ctx = _ctx()
    whole, local = torch.rand(10), torch.rand(4)
    ctx.add_edge_input(local, whole)
    assert ctx.edge_input(local) is whole
    assert ctx.edge_input(local * 2) is None
    local.mul_(2)
    assert ctx.edge_input(local) is None


def test_per_edge_rows_know_their_destinations():
    ei = torch.tensor([[0, 1, 2, 2], [1, 2, 0, 1]])
    inv = Invocation("conv", 0, None, None, False)
    inv.edge_graph = ei
    assert torch.equal(inv.destinations(), ei[1])
    adj_t = torch.sparse_coo_tensor(torch.stack([ei[1], ei[0]]), torch.ones(4), (3, 3)).coalesce().to_sparse_csr()
    inv.edge_graph = adj_t
    assert torch.equal(inv.destinations(), to_edge_index(adj_t)[0][0])  # rows of adj_t are destinations


def test_the_observer_does_not_judge_the_engines_work():
    check = RowCheck(rows=4, names={}, cut="num_chunks=2")
    ctx = _ctx(check)
    x = torch.randn(4, 3)
    with ctx, check:
        check.returned(x, 0)
        with ctx.engine_work():
            x.sum(0)                      # the engine's: not judged
        assert check.found is None
        x.sum(0)                          # the model's: combines the rows of different vertices
    assert check.found is not None and "reduces over the rows of different vertices" in check.found


def test_in_backward_tells_recomputation_from_the_forward():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            seen.append(in_backward())
            return t * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(in_backward())
            return g * 2

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [False, True]
