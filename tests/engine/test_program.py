"""What a stage runs: the forward itself with one stage; with several, its part of the traced program, so
that the stages run one after the other compute the forward; one traced program per kind of call.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GCNConv, SAGEConv

from pyg_pipe import UnsupportedModelError
from pyg_pipe.engine.runtime.program import Programs, StageProgram, WholeForward, signature
from pyg_pipe.model.inputs import CallInputs
from pyg_pipe.model.trace import forward_function, trace
from tests.zoo import zoo_graph


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 12)
        self.convs = nn.ModuleList([GCNConv(12, 12), SAGEConv(12, 12), GCNConv(12, 12), SAGEConv(12, 3)])

    def forward(self, x, edge_index, scale: float = 1.0):
        x = x0 = self.lin(x).relu()
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < 3:
                x = F.dropout(x.relu() + x0, p=0.5, training=self.training)
        return x * scale


def test_the_stages_in_turn_compute_the_forward():
    x, g, _, _ = zoo_graph()
    ei = g["edge_index"]
    torch.manual_seed(0)
    model = Net().eval()
    inputs = CallInputs((x, ei), {})
    programs = [Programs(model, forward_function(model), (1, 3), None, s, s == 1) for s in range(2)]
    first, second = (p.runner(inputs) for p in programs)
    assert isinstance(first, StageProgram) and first.stage.outputs == second.stage.inputs
    assert programs[0].next_activation(inputs) == second.stage.activation
    with torch.no_grad():
        sent, out = first.run((x, ei), {}, {})
        assert out is None and set(sent) == set(first.stage.outputs)  # the current x and x0 cross the cut
        _, out = second.run((x, ei), {}, sent)
        torch.testing.assert_close(out, model(x, ei))


def test_one_stage_runs_the_forward_untraced():
    x, g, _, _ = zoo_graph()
    model = Net().eval()
    runner = Programs(model, forward_function(model), None, None, 0, True).runner(CallInputs((x, g["edge_index"]), {}))
    assert isinstance(runner, WholeForward) and runner.stage is None
    with torch.no_grad():
        torch.testing.assert_close(runner.run((x, g["edge_index"]), {"scale": 2.0}, {})[1],
                                   model(x, g["edge_index"], scale=2.0))


def test_a_program_per_kind_of_call():
    x, g, _, _ = zoo_graph()
    ei = g["edge_index"]
    model = Net()
    programs = Programs(model, forward_function(model), (2, 2), None, 0, False)
    train = programs.runner(CallInputs((x, ei), {}))
    assert programs.runner(CallInputs((x * 2, ei), {})) is train     # other values, same kind: reused
    model.eval()
    assert programs.runner(CallInputs((x, ei), {})) is not train     # eval mode: traced again (dropout baked in)
    kinds = {signature(model, CallInputs((x, ei), kw)) for kw in ({}, {"scale": 2.0}, {"scale": 3.0})}
    assert len(kinds) == 3                                           # Python values are baked in by tracing


def test_a_call_with_other_layers_is_refused():
    x, g, _, _ = zoo_graph()
    model = Net()
    programs = Programs(model, forward_function(model), (2, 3), None, 0, False)  # cut for 5 units, the model has 4
    with pytest.raises(UnsupportedModelError, match="runs 4 pipeline units for this call but 5"):
        programs.runner(CallInputs((x, g["edge_index"]), {}))


def test_seeded_programs_are_not_traced_again():
    x, g, _, _ = zoo_graph()
    model = Net()
    inputs = CallInputs((x, g["edge_index"]), {})
    program = trace(model, inputs.args, inputs.kwargs)
    programs = Programs(model, forward_function(model), (2, 2), None, 1, True)
    programs.seed(inputs, program)
    assert programs.runner(inputs).program is program
