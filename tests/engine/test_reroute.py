"""A module's ``forward`` routed elsewhere without wrapping the module, and deep copies taken while routed.

Protects what the engine's install relies on: calling the module (or ``module.forward``) goes to the
route with every argument, removing the instance attribute restores the class's forward, and a deep
copy taken while routed (Lightning and users copy models, e.g. for EMA or evaluation) is a plain
module whose forward is its own, bound to the copy, with the original still routed.
"""
import copy

import torch
from torch import nn

from pyg_pipe.engine.reroute import Rerouted


class AddBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.tensor([1.0, 2.0]))

    def forward(self, x, scale=1.0):
        return x * scale + self.bias


def routed(module, calls):
    def route(*args, **kwargs):
        calls.append((args, kwargs))
        return "routed"
    module.forward = Rerouted(module, route, type(module).forward)
    return module


def test_calling_a_rerouted_module_calls_the_route_with_every_argument():
    calls = []
    m = routed(AddBias(), calls)
    x = torch.zeros(2)
    assert m(x, scale=3.0) == "routed"
    assert m.forward(x) == "routed"
    assert len(calls) == 2
    (args, kwargs), (args2, kwargs2) = calls
    assert args[0] is x and kwargs == {"scale": 3.0}
    assert args2[0] is x and kwargs2 == {}


def test_the_module_its_class_and_its_state_dict_stay_the_users():
    m = routed(AddBias(), [])
    assert type(m) is AddBias
    assert list(m.state_dict()) == ["bias"]
    assert list(m.children()) == []                            # not registered as a submodule
    assert AddBias()(torch.zeros(2)).tolist() == [1.0, 2.0]    # other instances are not routed


def test_removing_the_attribute_restores_the_modules_own_forward():
    calls = []
    m = routed(AddBias(), calls)
    del m.__dict__["forward"]
    assert m(torch.zeros(2)).tolist() == [1.0, 2.0]
    assert calls == []


def test_a_deep_copy_taken_while_rerouted_runs_its_own_forward():
    calls = []
    m = routed(AddBias(), calls)
    c = copy.deepcopy(m)
    assert torch.equal(c(torch.ones(2), scale=2.0), torch.tensor([3.0, 4.0]))
    assert calls == []
    assert m(torch.ones(2)) == "routed"                        # the original is still routed
    assert len(calls) == 1


def test_the_copys_forward_is_bound_to_the_copy_not_the_original():
    m = routed(AddBias(), [])
    c = copy.deepcopy(m)
    assert c.forward.__self__ is c
    assert c.forward.__func__ is AddBias.forward
    with torch.no_grad():
        c.bias.fill_(10.0)                                     # the copy's own parameters are used
    assert c(torch.zeros(2)).tolist() == [10.0, 10.0]
    assert m.bias.tolist() == [1.0, 2.0]


def test_a_deep_copy_of_a_parent_gives_rerouted_children_their_own_forward():
    calls = []
    child = routed(AddBias(), calls)
    parent = nn.Sequential(child, nn.Identity())
    c = copy.deepcopy(parent)
    assert c[0].forward.__self__ is c[0]
    assert c(torch.zeros(2)).tolist() == [1.0, 2.0]
    assert calls == []
    assert parent[0](torch.zeros(2)) == "routed"


def test_a_copy_of_a_copy_is_still_plain():
    m = routed(AddBias(), [])
    c2 = copy.deepcopy(copy.deepcopy(m))
    assert c2.forward.__self__ is c2
    assert c2(torch.zeros(2)).tolist() == [1.0, 2.0]
