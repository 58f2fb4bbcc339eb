"""The cost model of ``balance="time"``: one measured cost per layer group, from a pass that changes nothing."""
import copy

import pytest

import torch
from torch import nn
from torch_geometric.nn import GCNConv

from pyg_pipe.engine.step.layers import LayerHooks
from pyg_pipe.engine.profile import (grouped_pass_seconds, layer_costs, pooled, step_signature,
                                     training_pass_seconds)
from pyg_pipe.graph.partition import make_chunks
from pyg_pipe.model.inputs import CallInputs
from pyg_pipe.model.split import stage_groups
from pyg_pipe.model.trace import forward_function, trace
from tests.zoo import zoo_graph


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(12)
        self.convs = nn.ModuleList([GCNConv(8, 12), GCNConv(12, 12), GCNConv(12, 3)])

    def forward(self, x, edge_index):
        x = torch.nn.functional.dropout(self.bn(self.convs[0](x, edge_index)).relu(), p=0.5, training=self.training)
        return self.convs[2](self.convs[1](x, edge_index).relu(), edge_index)


def test_one_cost_per_layer_group_and_the_pass_changes_nothing():
    x, g, _, _ = zoo_graph()
    model = Net()
    before = copy.deepcopy(model.state_dict())
    inputs = CallInputs((x, g["edge_index"]), {})
    program = trace(model, inputs.args, inputs.kwargs)
    groups, _ = stage_groups(program)
    rng = torch.get_rng_state()
    costs = layer_costs(model, forward_function(model), program, groups, inputs, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), rng)    # the ranks' random streams stay in step
    assert len(costs) == len(groups) == 3 and all(c > 0 for c in costs)
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():          # running statistics untouched as well
        assert torch.equal(v, before[k]), k


class Deep(nn.Module):
    """Four layers of the same computation between an input and an output layer of other widths, the
    middle ones alternating between two graphs."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([GCNConv(8, 12)] + [GCNConv(12, 12) for _ in range(4)] + [GCNConv(12, 3)])

    def forward(self, x, edge_index, edge_index2):
        x = self.convs[0](x, edge_index).relu()
        for i, conv in enumerate(self.convs[1:-1]):
            x = conv(x, edge_index if i % 2 == 0 else edge_index2).relu()
        return self.convs[-1](x, edge_index)


def test_the_same_computation_gets_the_same_cost():
    """Steps of the same structure are pooled (one cost over all their times), so noise cannot tell equal layers apart;
    other widths, or another graph argument, keep their own cost."""
    x, g, _, _ = zoo_graph()
    model = Deep()
    ei = g["edge_index"]
    inputs = CallInputs((x, ei, ei.flip(0)), {})
    program = trace(model, inputs.args, inputs.kwargs)
    groups, _ = stage_groups(program)
    costs = layer_costs(model, forward_function(model), program, groups, inputs, torch.device("cpu"))
    assert len(costs) == 6 and all(c > 0 for c in costs)
    assert costs[1] == costs[3] and costs[2] == costs[4]       # the same layer on the same graph: one cost
    units = [n for grp in groups for n in grp if n.op == "call_module" and "convs" in str(n.target)]
    sig = [step_signature(program, n, ((1,), torch.float32)) for n in units]
    assert sig[1] == sig[3] and sig[1] != sig[2]                 # edge_index against edge_index2
    assert sig[0] != sig[1] and sig[-1] != sig[1]                # other parameter shapes


def test_pooled_takes_the_smallest_time_of_a_signature():
    noisy = [[1.3, 9.0, 8.0], [1.2, 1.1, 7.0], [5.0, 6.0, 5.5]]
    assert pooled(noisy, ["a", "a", "b"]) == [1.1, 1.1, 5.0]     # slowed samples (other work) do not make a layer dearer


def test_with_the_plans_chunking_a_pass_runs_a_chunk_as_the_pipeline_does():
    """Given the chunking, the cost model times the layers on one chunk as the pipeline runs them: a layer
    reading the model's inputs on the chunk's rows and their halo, the others on the chunk's rows only (so
    the first layer of a PyG GCN, dearer per chunk, can get a stage with fewer layers)."""
    x, g, _, _ = zoo_graph()
    ei = g["edge_index"]
    model = Deep()
    inputs = CallInputs((x, ei, ei.flip(0)), {})
    program = trace(model, inputs.args, inputs.kwargs)
    groups, _ = stage_groups(program)
    perm, ptr = make_chunks(ei, x.size(0), 4)
    seen = {}

    def rows_seen(i):
        def hook(module, args):
            seen.setdefault(i, args[0].size(0))
        return hook

    hooks = LayerHooks(model)
    hooks.install()  # (as the engine does before it plans), then hooks that see what the layers are given
    handles = [conv.register_forward_pre_hook(rows_seen(i)) for i, conv in enumerate(model.convs)]
    try:
        costs = layer_costs(model, forward_function(model), program, groups, inputs, torch.device("cpu"),
                            chunking=(perm, ptr))
    finally:
        hooks.remove()
        for h in handles:
            h.remove()
    rows = int(ptr[1] - ptr[0])
    assert len(costs) == 6 and all(c > 0 for c in costs) and costs[1] == costs[3]
    assert seen[0] > rows                                   # the input layer: the chunk's rows and their halo
    assert all(seen[i] == rows for i in range(1, 6))        # the others: the chunk's rows


def test_a_training_pass_on_a_chunk_changes_nothing_and_runs_its_backward():
    """``num_chunks="auto"`` times a training pass on a chunk (forward through the layer hooks, backward to the
    parameters): no ``.grad``, running statistic or random stream changes, and the backward does run (a
    pass with gradients takes longer than the no-grad pass of the same layers)."""
    x, g, _, _ = zoo_graph()
    ei = g["edge_index"]
    model = Net()
    before = copy.deepcopy(model.state_dict())
    inputs = CallInputs((x, ei), {})
    program = trace(model, inputs.args, inputs.kwargs)
    groups, _ = stage_groups(program)
    perm, ptr = make_chunks(ei, x.size(0), 4)
    used = []
    handle = model.convs[0].lin.weight.register_hook(lambda grad: used.append(grad.shape))
    hooks = LayerHooks(model)
    hooks.install()
    rng = torch.get_rng_state()
    try:
        seconds = training_pass_seconds(model, forward_function(model), program, groups, inputs,
                                        torch.device("cpu"), chunking=(perm, ptr))
    finally:
        hooks.remove()
        handle.remove()
    assert seconds > 0 and used and used[0] == model.convs[0].lin.weight.shape   # the backward reached layer 1
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("which", ["gcnii", "gat_jk", "revgnn"])
def test_the_pass_over_one_chunk_a_way_runs_a_layer_group_at_a_time_and_changes_nothing(which):
    """``num_chunks="auto"`` times one chunk a way's training pass one layer group at a time (so that no more than a
    group's activations are held): every parameter gets its gradient once per pass (each group's backward stops
    at its inputs, or earlier groups would get theirs again from later groups), with values that cross several
    groups (GCNII's ``x_0``; PyG's ``GAT`` with ``jk="cat"``, every layer's output read at the end), and through
    PyG's reversible ``GroupAddRev`` blocks, whose backward frees the output it hands on (the next group read
    freed storage and the pass failed, silently leaving one chunk a way to the line, until 2026-11-29); and it
    changes nothing (no ``.grad``, state or random stream)."""
    from torch_geometric.nn.models import GAT
    from tests.models import make_model
    from tests.shapes import RevGNN
    x, g, _, _ = zoo_graph()
    ei = g["edge_index"]
    torch.manual_seed(0)
    model = (make_model("gcnii", c_in=x.size(1)) if which == "gcnii" else RevGNN(3) if which == "revgnn"
             else GAT(x.size(1), 12, 3, 3, jk="cat"))
    before = copy.deepcopy(model.state_dict())
    plain, once = copy.deepcopy(model), {}   # how often one plain backward reaches each parameter (GroupAddRev: twice)
    for n, p in plain.named_parameters():
        p.register_hook(lambda grad, n=n: once.__setitem__(n, once.get(n, 0) + 1))
    plain(x, ei).sum().backward()
    inputs = CallInputs((x, ei), {})
    program = trace(model, inputs.args, inputs.kwargs)
    groups, _ = stage_groups(program)
    assert len(groups) >= 3
    calls = {n: 0 for n, p in model.named_parameters() if p.requires_grad}
    handles = [p.register_hook(lambda grad, n=n: calls.__setitem__(n, calls[n] + 1))
               for n, p in model.named_parameters() if p.requires_grad]
    hooks = LayerHooks(model)
    hooks.install()
    rng = torch.get_rng_state()
    try:
        whole = (torch.arange(x.size(0)), torch.tensor([0, x.size(0)]))
        seconds = grouped_pass_seconds(model, forward_function(model), program, groups, inputs, torch.device("cpu"),
                                       chunking=whole)
    finally:
        hooks.remove()
        for h in handles:
            h.remove()
    assert seconds > 0
    assert calls == {n: 2 * k for n, k in once.items()}, calls   # two passes, each as one plain backward
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_measuring_pass_that_fails_on_a_forward_the_row_check_refuses_gives_the_refusal():
    """A degree computed in forward from a chunk's edges (whose halo ids lie past the chunk's rows) fails with an
    index out of bounds inside the cost model's pass; the plan turns that failure into the row check's refusal,
    naming the operation and the fix, on every rank alike (the pass is the same on each). The check runs only
    when a pass fails: a forward that passes is checked in every chunk of the first training pass."""
    from pyg_pipe.model.errors import UnsupportedModelError
    from tests.shapes_pyg import DegreeFeature
    x, g, _, _ = zoo_graph()
    ei = g["edge_index"]
    torch.manual_seed(0)
    model = DegreeFeature()
    inputs = CallInputs((x, ei), {})
    program = trace(model, inputs.args, inputs.kwargs)
    groups, _ = stage_groups(program)
    perm, ptr = make_chunks(ei, x.size(0), 4)
    hooks = LayerHooks(model)
    hooks.install()
    try:
        with pytest.raises(UnsupportedModelError, match=r"(?s)calls `scatter_add_`.*outside the MessagePassing"):
            layer_costs(model, forward_function(model), program, groups, inputs, torch.device("cpu"),
                        chunking=(perm, ptr))
        # the whole graph as one chunk: nothing to refuse, the pass measures
        assert all(c > 0 for c in layer_costs(model, forward_function(model), program, groups, inputs,
                                              torch.device("cpu")))
    finally:
        hooks.remove()
