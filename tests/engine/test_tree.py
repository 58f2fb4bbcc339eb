"""Nested values taken apart into leaves and put back (what the stage link and checkpoints rely on).

Protects the round trip ``unflatten(*flatten(v)) == v`` for tensors in nested tuples, lists and
dicts with other values kept in the structure, leaves in depth-first order, a custom ``leaf``
predicate, and a structure that is picklable and compares equal exactly when the nesting and the
kept values are equal (the link sends it once and compares it every step).
"""
import collections
import pickle

import pytest
import torch

from pyg_pipe.engine.tree import flatten, unflatten


def same(a, b):
    """Equal values of equal types all the way down (tensors by value)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def nested():
    t1, t2, t3 = torch.tensor([1.0, 2.0]), torch.tensor([[3]]), torch.tensor(4.0)
    value = {"b": (t1, [t2, 3, "s"]), "a": None, "c": {"d": t3, "e": ()}, "f": [1.5, {"g": []}]}
    return value, [t1, t2, t3]


def test_the_leaves_are_the_tensors_in_depth_first_order():
    value, tensors = nested()
    leaves, _ = flatten(value)
    assert len(leaves) == 3
    assert all(a is b for a, b in zip(leaves, tensors))


def test_a_nested_value_round_trips_with_its_types_and_non_tensor_values():
    value, _ = nested()
    back = unflatten(*flatten(value))
    assert same(back, value)
    assert isinstance(back["b"], tuple) and isinstance(back["b"][1], list)
    assert list(back) == ["b", "a", "c", "f"]              # dict order kept


def test_other_leaves_take_the_places_of_the_original_ones():
    value, _ = nested()
    leaves, structure = flatten(value)
    back = unflatten([x * 10 for x in leaves], structure)
    assert torch.equal(back["b"][0], torch.tensor([10.0, 20.0]))
    assert torch.equal(back["b"][1][0], torch.tensor([[30]]))
    assert torch.equal(back["c"]["d"], torch.tensor(40.0))
    assert back["b"][1][1:] == [3, "s"] and back["a"] is None


@pytest.mark.parametrize("value", [torch.ones(2), 7, None, "x", (), [], {}, [torch.ones(1)], (torch.ones(1),),
                                   ((torch.zeros(1), torch.ones(1)), [None, (2,)])])
def test_simple_values_round_trip(value):
    assert same(unflatten(*flatten(value)), value)


def test_a_bare_tensor_is_a_single_leaf():
    t = torch.arange(3)
    leaves, structure = flatten(t)
    assert len(leaves) == 1 and leaves[0] is t
    assert unflatten(leaves, structure) is t


def test_a_custom_leaf_predicate_makes_every_non_container_a_leaf():
    not_container = lambda v: not isinstance(v, (tuple, list, dict))  # noqa: E731 - the link's rule
    t = torch.ones(2)
    value = (t, None, [3, {"k": "s"}])
    leaves, structure = flatten(value, not_container)
    assert leaves[0] is t and leaves[1:] == [None, 3, "s"]
    back = unflatten([torch.zeros(2), None, 4, "u"], structure)
    assert same(back, (torch.zeros(2), None, [4, {"k": "u"}]))


def test_with_the_default_predicate_none_stays_in_the_structure():
    leaves, structure = flatten((torch.ones(1), None))
    assert len(leaves) == 1
    assert unflatten([torch.zeros(1)], structure)[1] is None


def test_the_structure_survives_pickling():
    value, _ = nested()
    leaves, structure = flatten(value)
    again = pickle.loads(pickle.dumps(structure))
    assert again == structure
    assert same(unflatten(leaves, again), value)


def test_structures_are_equal_for_values_of_the_same_nesting():
    a = flatten({"x": (torch.ones(2), [torch.zeros(3)]), "n": 1})[1]
    b = flatten({"x": (torch.rand(5), [torch.ones(1, 1)]), "n": 1})[1]
    assert a == b


@pytest.mark.parametrize("other", [
    {"x": [torch.ones(2), [torch.zeros(3)]], "n": 1},          # list instead of tuple
    {"x": (torch.ones(2), [torch.zeros(3)]), "n": 2},          # another kept value
    {"y": (torch.ones(2), [torch.zeros(3)]), "n": 1},          # another key
    {"n": 1, "x": (torch.ones(2), [torch.zeros(3)])},          # another key order
    {"x": (torch.ones(2), [torch.zeros(3), None]), "n": 1},    # one more entry
    {"x": (torch.ones(2), [1]), "n": 1},                       # a value where a tensor was
])
def test_structures_differ_when_the_nesting_or_kept_values_differ(other):
    a = flatten({"x": (torch.ones(2), [torch.zeros(3)]), "n": 1})[1]
    assert flatten(other)[1] != a


def test_a_namedtuple_round_trips_as_a_tuple():
    Pair = collections.namedtuple("Pair", "values indices")
    value = Pair(torch.ones(2), torch.zeros(2, dtype=torch.long))
    back = unflatten(*flatten(value))
    assert isinstance(back, tuple)
    assert torch.equal(back[0], value.values)
