"""Tracing PyG models into programs and cutting them into stages."""
from torch_geometric.nn import GCN

from pyg_pipe.model import NODE, balance, bind_inputs, layer_groups, parameter_owner, split, trace
from tests.models import CustomNet, gcnii, small_graph


def program(model):
    x, edge_index, _, _ = small_graph()
    bound = bind_inputs(model, (x, edge_index), {})
    return trace(model, bound, x.size(0), edge_index.size(1))


def test_balance_minimises_the_slowest_stage():
    assert balance([1, 1, 1, 1], 2) == [2, 2]
    assert balance([3, 1, 1, 1], 2) == [1, 3]
    assert balance([1, 1, 1, 1, 1, 5], 3) == [3, 2, 1] or max(balance([1, 1, 1, 1, 1, 5], 3)) <= 3
    sizes = balance([1.0] * 32, 4)
    assert sizes == [8, 8, 8, 8]


def test_basic_gnn_groups_one_per_layer():
    prog = program(GCN(8, 16, 4, 3))
    groups = layer_groups(prog)
    assert len(groups) == len(prog.mp_steps) == 4
    stages = split(prog, [2, 2])
    assert [len(s.mp_steps) for s in stages] == [2, 2]
    assert stages[0].inputs == [] and len(stages[1].inputs) == 1
    assert stages[1].activation == stages[1].inputs[0] == stages[0].outputs[0]
    owners = parameter_owner(prog.root, stages)
    assert owners["convs.0.lin.weight"] == 0 and owners["convs.3.lin.weight"] == 1


def test_gcnii_carries_x0_across_every_cut():
    prog = program(gcnii(8, 16, 3, num_layers=6))
    stages = split(prog, [2, 2, 2])
    for s in (1, 2):
        assert len(stages[s].inputs) == 2  # the activation and x0
        carried = [v for v in stages[s].inputs if v != stages[s].activation]
        assert len(carried) == 1 and prog.kinds[carried[0]] == NODE
    assert stages[2].outputs == [prog.output.args[0].name]


def test_custom_layers_are_found_inside_a_plain_module():
    prog = program(CustomNet(8, 16, 3, num_layers=3))
    assert [n.target for n in prog.mp_steps] == ["convs.0", "convs.1", "convs.2"]
