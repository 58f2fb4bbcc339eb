"""The cost model of ``balance="time"``: one measured cost per layer group, from a pass that changes nothing."""
import copy

import torch
from torch import nn
from torch_geometric.nn import GCNConv

from pyg_pipe.engine.profile import layer_costs
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
