"""One pass over a rank's chunks: the fill and its records, the drain, the exact pass, and when a call's
history is (re)filled. One process with four chunks (history read and written), driven through the
step functions with a runtime built from a plan, as the engine does.
"""
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GCNConv, GraphConv

from pyg_pipe.engine import Comm, PipelineConfig
from pyg_pipe.engine.step import pipeline as step
from pyg_pipe.engine.plan.grid import RankGrid
from pyg_pipe.engine.step.layers import LayerHooks
from pyg_pipe.engine.plan.plan import make_plan
from pyg_pipe.engine.plan.shape import decide_shape
from pyg_pipe.engine.runtime.runtime import Runtime
from pyg_pipe.engine.step.norms import StatisticsHooks
from pyg_pipe.model.inputs import CallInputs
from pyg_pipe.model.trace import forward_function
from tests.harness import ranges
from tests.zoo import zoo_graph


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = GCNConv(8, 12), GraphConv(12, 3)

    def forward(self, x, edge_index, edge_weight=None):
        return self.conv2(self.conv1(x, edge_index, edge_weight).relu(), edge_index)


@pytest.fixture
def setup():
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph()
    torch.manual_seed(0)
    model = Net()
    comm = Comm(torch.device("cpu"))
    inputs = CallInputs((x, g["edge_index"], g["edge_weight"]), {})
    config = PipelineConfig(num_chunks=4, partition=ranges, shuffle_chunks=False, snapshot_period=None)
    shape = decide_shape(model, inputs, 1, 1, 1, 1, None)
    plan = make_plan(model, config, shape, inputs, comm, 0)
    rt = Runtime(plan, RankGrid(0, 1, 1, 1), comm, config, model, forward_function(model), inputs)
    hooks = [LayerHooks(model), StatisticsHooks(model)]
    for h in hooks:
        h.install()
    yield rt, model, inputs, x, g, y, mask
    for h in hooks:
        h.remove()
    torch.set_default_dtype(torch.float32)


def test_the_exact_pass_equals_the_plain_model(setup):
    rt, model, inputs, x, g, *_ = setup
    with torch.no_grad():
        got = step.exact(rt, inputs)
        for h in (model.conv1, model.conv2):
            assert h._forward_pre_hooks  # installed, yet inert outside a pass
        want = model(x, g["edge_index"], g["edge_weight"])
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_fill_runs_every_chunk_in_order_and_drain_walks_them_back(setup):
    rt, model, inputs, x, g, y, mask = setup
    step.prepare_history(rt, inputs, 0)
    out, record = step.fill(rt, inputs, 0, 0)
    assert [r.chunk for r in record.chunks] == [0, 1, 2, 3]     # no shuffling: the chunk order
    torch.testing.assert_close(out, model(x, g["edge_index"], g["edge_weight"]).detach(), atol=1e-12, rtol=0)
    leaf = out.detach().requires_grad_()  # the engine's autograd Function hands the drain this gradient
    F.cross_entropy(leaf[mask], y[mask]).backward()
    step.drain(leaf.grad, record)
    assert all(p.grad is not None for p in model.parameters())
    assert record.run.history.grads == {}                        # pending cross-chunk gradients consumed


def test_a_call_history_is_filled_once_and_again_for_new_edge_values(setup, monkeypatch):
    rt, model, inputs, x, g, *_ = setup
    passes = []
    exact = step.exact
    monkeypatch.setattr(step, "exact", lambda *a, **k: passes.append(1) or exact(*a, **k))
    step.prepare_history(rt, inputs, 0)
    step.prepare_history(rt, inputs, 0)
    assert len(passes) == 1 and rt.history.of(0).initialised
    same_values = CallInputs((x, g["edge_index"], g["edge_weight"].clone()), {})
    step.prepare_history(rt, same_values, 0)                     # another tensor, same values: nothing to do
    assert len(passes) == 1
    new_values = CallInputs((x, g["edge_index"], g["edge_weight"] * 2), {})
    step.prepare_history(rt, new_values, 0)                      # new weights change every layer: refilled
    assert len(passes) == 2
    step.prepare_history(rt, inputs, 1)                          # a second call of the step has its own history
    assert len(passes) == 3 and rt.history.of(1).initialised


def test_only_the_same_live_unchanged_objects_skip_the_digest():
    w = torch.ones(5)
    seen = ((weakref.ref(w), w._version), "digest")
    assert step._same_objects(seen, [w])
    w.mul_(2)                                   # changed in place: a new version
    assert not step._same_objects(seen, [w])
    assert not step._same_objects(seen, [torch.ones(5)])
    assert not step._same_objects(seen, [w, w]) and not step._same_objects((), [])


def test_a_sparse_adjacency_is_known_by_itself_not_by_its_values():
    """A sparse ``adj_t`` hands out its values as a new tensor at every call, so compared by those it was digested
    again every step (converted, summed, read on the host); the adjacency itself is the same object, and its
    version counter (shared with its values and indices) says whether it changed in place."""
    from torch_geometric.utils import to_torch_csr_tensor
    x = torch.rand(3, 2)
    adj = to_torch_csr_tensor(torch.tensor([[0, 1, 2], [1, 2, 0]]), torch.rand(3), size=(3, 3))
    inputs = CallInputs((x, adj), {})
    holders = inputs.edge_tensors(holders=True)
    assert len(holders) == 1 and holders[0] is adj
    assert torch.equal(inputs.edge_tensors()[0], adj.to_sparse_coo().coalesce().values())  # (what is digested)
    seen = tuple((weakref.ref(t), t._version) for t in holders) + ("digest",)
    assert step._same_objects(seen, CallInputs((x, adj), {}).edge_tensors(holders=True))  # the next call
    adj.values().mul_(2)                        # its values changed in place: the adjacency's version moves
    assert not step._same_objects(seen, inputs.edge_tensors(holders=True))
    seen = tuple((weakref.ref(t), t._version) for t in inputs.edge_tensors(holders=True)) + ("digest",)
    adj.col_indices()[0] = 2                    # its edges changed in place too
    assert not step._same_objects(seen, inputs.edge_tensors(holders=True))
    other = to_torch_csr_tensor(torch.tensor([[0, 1, 2], [1, 2, 0]]), torch.rand(3), size=(3, 3))
    assert not step._same_objects(seen, CallInputs((x, other), {}).edge_tensors(holders=True))


def test_a_new_tensor_at_a_freed_tensors_address_is_not_the_same_object():
    """A sparse input's values are taken anew each call and die at once, so the next call's tensor
    usually gets the same ``id`` and version: that identity must not pass for "unchanged" (it once
    skipped the refill for new adjacency values on one rank and not on another)."""
    w = torch.rand(5)
    old_id, seen = id(w), ((weakref.ref(w), w._version), "digest")
    del w
    new = [torch.rand(5) for _ in range(1)][0]
    for _ in range(100):                        # CPython reuses the freed slot almost at once
        if id(new) == old_id:
            break
        new = torch.rand(5)
    assert not step._same_objects(seen, [new])
    if id(new) != old_id:
        pytest.skip("the allocator gave the new tensor another address this time")
    assert new._version == seen[0][1]           # an id-and-version key would have called it the same


def test_the_output_has_to_be_per_vertex():
    """Per-vertex tensors in a structure pack into one (tree.pack_rows); an auxiliary loss (SuperGAT's example
    returns one beside the logits) or a row per graph is refused with the fixes that work."""
    from pyg_pipe.engine.tree import pack_rows, unpack_rows
    packed, spec = pack_rows({"a": torch.zeros(3, 2), "b": (torch.ones(3), torch.zeros(3, 2, 2))}, 3)
    assert packed.shape == (3, 2 + 1 + 4)
    back = unpack_rows(packed, spec)
    assert back["a"].shape == (3, 2) and back["b"][0].shape == (3,) and back["b"][1].shape == (3, 2, 2)
    with pytest.raises(Exception, match="must return per-vertex tensors.*compute it after the model.*'ddp'"):
        step.check_output(pack_rows((torch.zeros(3, 2), torch.tensor(0.5)), 3)[0], 3)
    with pytest.raises(Exception, match=r"shape \(4, 2\) for a chunk of 5 vertices"):
        step.check_output(torch.zeros(4, 2), 5)


def test_a_training_fill_drops_the_exact_pass_rows_and_the_next_exact_pass_cuts_them_again(setup):
    """The inputs' rows cut for the one-chunk-per-way graphs would sit beside the training activations:
    a fill drops them, the next exact pass cuts them again and is as exact as before."""
    rt, model, inputs, x, g, *_ = setup
    way = {id(cg) for cg in rt.way_chunked}
    kept = lambda: [k for k in rt.adjacency.get("node rows", {}) if k[1] in way]  # noqa: E731
    with torch.no_grad():
        want = model(x, g["edge_index"], g["edge_weight"])
        step.prepare_history(rt, inputs, 0)                  # the exact pass filling history
        assert kept() or not rt.keep_inputs
        step.fill(rt, inputs, 1, 0)
        assert not kept()
        torch.testing.assert_close(step.exact(rt, inputs), want, atol=1e-12, rtol=0)


def test_the_row_graph_of_a_chunk_without_halo_is_its_local_graph():
    """One chunk a way on one way has no halo: its row graph and local graph are one adjacency, not two."""
    from pyg_pipe.graph.chunks import ChunkedGraph
    from pyg_pipe.model.localize import Localizer

    x, g, *_ = zoo_graph()
    src, dst = g["edge_index"]
    n = x.size(0)
    adj = torch.sparse_coo_tensor(torch.stack([dst, src]), torch.ones(src.numel()), (n, n)).coalesce().to_sparse_csr()
    cg = ChunkedGraph(src, dst, n, torch.arange(n), torch.tensor([0, n]), 1)
    loc = Localizer(CallInputs((x, adj), {}), [cg])
    lg = cg.chunks[0]
    local = loc.local_graph(adj, lg)
    assert loc.row_adjacency(cg, lg, local) is local


@pytest.mark.parametrize("layout", [torch.sparse_csr, torch.sparse_coo])
def test_the_row_graph_of_a_chunk_with_a_halo_is_its_rows_graph(layout):
    """A chunk with a halo gets as its row graph the local edges into its rows, entry for entry as built from them
    (a weighted graph of three components with self loops, 4 chunks of a shuffled vertex order); in CSR it is made
    of views of the local graph's arrays, not a copy."""
    from pyg_pipe.graph.chunks import ChunkedGraph
    from pyg_pipe.model.localize import Localizer

    x, g, *_ = zoo_graph()
    n = x.size(0)
    adj = torch.sparse_coo_tensor(g["edge_index"].flip(0), torch.rand(g["edge_index"].size(1)), (n, n)).coalesce()
    dst, src = adj.indices()
    adj = adj.to_sparse_csr() if layout == torch.sparse_csr else adj
    cg = ChunkedGraph(src, dst, n, torch.randperm(n), torch.tensor([0, n // 4, n // 2, 3 * n // 4, n]), 1)
    loc = Localizer(CallInputs((x, adj), {}), [cg])
    for lg in cg.chunks:
        assert lg.halo.numel()
        local = loc.local_graph(adj, lg)
        rows = loc.row_adjacency(cg, lg, local)
        want = cg.local_adjacency(lg, loc._values(adj, cg), layout, torch.float32, rows_only=True)
        assert rows.shape == (lg.rows, lg.num_local)
        torch.testing.assert_close(rows.to_dense(), want.to_dense(), rtol=0, atol=0)
        if layout == torch.sparse_csr:
            assert rows.col_indices().data_ptr() == local.col_indices().data_ptr()
            assert torch.equal(rows.crow_indices(), want.crow_indices())
            assert torch.equal(rows.col_indices(), want.col_indices())
