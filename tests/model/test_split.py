"""Tracing PyG models into units and cutting them into stages."""
import torch
from torch import nn
from torch_geometric.nn import GCN, GCNConv

from torch.distributed.pipelining import pipe_split as torch_pipe_split

import pyg_pipe
from pyg_pipe import SplitPoint
from pyg_pipe.model.split import stage_groups
from pyg_pipe.model import balance, layer_groups, parameter_stages, split, trace
from tests.models import CustomNet, gcnii, small_graph
from tests.shapes import Flipped, ResGCNPlus, RevGNN


def program(model, **kw):
    x, edge_index, _, _ = small_graph()
    kw = kw or dict(edge_index=edge_index)
    return trace(model, (x,), kw)


def test_balance_minimises_the_slowest_stage():
    assert balance([1, 1, 1, 1], 2) == [2, 2]
    assert balance([3, 1, 1, 1], 2) == [1, 3]
    sizes = balance([1, 1, 1, 1, 1, 5], 3)
    assert sizes == [2, 3, 1] and max(2, 3, 5) == 5  # the slowest block (5) cannot be beaten
    assert balance([1.0] * 32, 4) == [8, 8, 8, 8]
    assert balance([5, 1, 1, 1, 1, 1], 2) == [1, 5]


def test_basic_gnn_one_unit_per_layer():
    prog = program(GCN(8, 16, 4, 3))
    assert [n.target for n in prog.units] == ["convs.0", "convs.1", "convs.2", "convs.3"]
    groups = layer_groups(prog)
    stages = split(prog, groups, [2, 2])
    assert stages[0].inputs == [] and len(stages[1].inputs) == 1
    assert stages[1].activation == stages[1].inputs[0] == stages[0].outputs[0]
    owners = parameter_stages(prog.root, stages)
    assert owners["convs.0.lin.weight"] == {0} and owners["convs.3.lin.weight"] == {1}


def test_gcnii_carries_x0_across_every_cut():
    prog = program(gcnii(8, 16, 3, num_layers=6))
    stages = split(prog, layer_groups(prog), [2, 2, 2])
    for s in (1, 2):
        assert len(stages[s].inputs) == 2  # the activation and x0
        assert stages[s].activation in stages[s].inputs
    assert stages[2].outputs == [prog.output.args[0].name]


def test_custom_layers_are_found_inside_a_plain_module():
    assert [n.target for n in program(CustomNet(8, 16, 3, num_layers=3)).units] == ["convs.0", "convs.1", "convs.2"]


def test_submodules_that_do_not_trace_become_units():
    """DeepGCNLayer(res+, ckpt_grad) has control flow on tensors; GroupAddRev is a custom autograd
    Function (reversible): both run whole, as one unit each, and the rest still traces finely."""
    x, edge_index, _, _ = small_graph()
    attr = torch.randn(edge_index.size(1), 3)
    res = trace(ResGCNPlus(4, ckpt_grad=True), (x,), dict(edge_index=edge_index, edge_attr=attr))
    assert [n.target for n in res.units] == ["layers.0.conv", "layers.1", "layers.2.conv", "layers.3"]
    rev = program(RevGNN(3))
    assert [n.target for n in rev.units] == ["convs.0", "convs.1", "convs.2"]


def test_the_edge_encoders_output_crosses_cuts_but_recomputable_values_do_not():
    x, edge_index, _, _ = small_graph()
    res = trace(ResGCNPlus(4), (x,), dict(edge_index=edge_index, edge_attr=torch.randn(edge_index.size(1), 3)))
    stages = split(res, layer_groups(res), [2, 2])
    encoded = next(n.name for n in res.graph.nodes if n.target == "edge_encoder")
    assert encoded in stages[1].inputs                              # an edge tensor, sent per chunk
    flipped = program(Flipped())
    stages = split(flipped, layer_groups(flipped), [2, 2])
    flip = next(n.name for n in flipped.graph.nodes if n.op == "call_method" and n.target == "flip")
    assert flip not in stages[1].inputs and flip in [n.name for n in stages[1].steps]  # recomputed there


class Marked(nn.Module):
    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(GCNConv(8 if i == 0 else 8, 8) for i in range(4))

    def forward(self, x, edge_index):
        x = self.convs[0](x, edge_index).relu()
        pyg_pipe.pipe_split()
        x = self.convs[1](x, edge_index).relu()
        torch_pipe_split()  # torch.distributed.pipelining's marker works too
        for conv in self.convs[2:]:
            x = conv(x, edge_index).relu()
        return x


def test_split_points_mark_stage_boundaries():
    marked = program(Marked())
    groups, forced = stage_groups(marked, None)
    assert forced and [[n.target for n in g if n.op == "call_module"] for g in groups] == \
        [["convs.0"], ["convs.1"], ["convs.2", "convs.3"]]
    plain = program(GCN(8, 16, 4, 3))
    groups, forced = stage_groups(plain, {"convs.3": SplitPoint.BEGINNING})
    assert forced and [n.target for n in groups[1] if n.op == "call_module"] == ["convs.3"]


class _Keywords(GCNConv):
    """A layer whose forward has positional-only, defaulted and keyword-only parameters."""

    def forward(self, x, /, edge_index, edge_weight=None, *, scale: float = 1.0):
        return super().forward(x, edge_index, edge_weight) * scale


def test_a_layer_as_the_whole_model_is_one_unit_called_as_a_layer():
    """``model = SGConv(...)`` (PyG's sgc.py): the engine runs a function of the forward's own parameters that calls
    the layer through ``__call__`` (its hooks run), and a trace of it sees the layer as one unit."""
    import inspect

    from pyg_pipe.model.trace import as_layer_call, forward_function
    x, edge_index, _, _ = small_graph()
    layer = _Keywords(x.size(1), 4)
    fn = as_layer_call(layer, forward_function(layer))
    assert inspect.signature(fn) == inspect.signature(_Keywords.forward)
    called = []
    handle = layer.register_forward_pre_hook(lambda m, args: called.append(len(args)))
    try:
        assert torch.equal(fn(layer, x, edge_index, scale=2.0), layer.forward(x, edge_index, scale=2.0))
        assert torch.equal(fn(layer, x, edge_index), layer.forward(x, edge_index, None))
    finally:
        handle.remove()
    assert called == [3, 3]  # through __call__, every positional argument passed on (the default too)
    model = GCN(x.size(1), 8, 3, 2)
    assert as_layer_call(model, forward_function(model)) is forward_function(model)  # a model is its own forward
    assert [n.target for n in trace(layer, (x, edge_index), {}, fn).units] == [""]
