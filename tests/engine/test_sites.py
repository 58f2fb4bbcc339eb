"""The call sites a stage meets: their keys, the check that every chunk makes the same calls, and resume checks.

Protects the key format (site, source arguments, clean flag), the refusal of a chunk whose calls
differ from the pass's first chunk naming the first differing call, the refusal to resume with a
model that makes other calls than the checkpoint's, and a kind of call that is stable across calls
and runs and tells training from evaluation. Single process: no collective happens (``group=None``).
"""
import pytest
import torch

from pyg_pipe import UnsupportedModelError
from pyg_pipe.engine import Comm
from pyg_pipe.engine.context import Site
from pyg_pipe.engine.runtime.sites import CallSites, kind_of, same_as_first_chunk, site_keys

SIG = (True, ("tensor", "tensor"), ())


def comm():
    return Comm(torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- keys
def test_site_keys_name_the_site_its_sources_and_whether_they_were_clean():
    sites = [Site("conv1#0.0", ("x",), True), Site("conv2#0.1", ("x", "edge_attr"), False), Site("lin#1.0", (), True)]
    assert site_keys(sites) == ["conv1#0.0:x:1", "conv2#0.1:x,edge_attr:0", "lin#1.0::1"]


def test_site_keys_of_no_sites_is_empty():
    assert site_keys([]) == []


# ---------------------------------------------------------------------------------------------- same calls per chunk
def test_a_chunk_with_the_first_chunks_calls_is_accepted():
    same_as_first_chunk(["a:x:0", "b:x:0"], ["a:x:0", "b:x:0"])
    same_as_first_chunk([], [])


def test_a_chunk_with_another_call_is_refused_naming_the_first_difference():
    with pytest.raises(UnsupportedModelError) as err:
        same_as_first_chunk(["a:x:0", "c:x:0", "d:x:0"], ["a:x:0", "b:x:0", "e:x:0"])
    msg = str(err.value)
    assert "(call 1: b:x:0 for one chunk, c:x:0 for another)" in msg
    assert "control flow depends on the data" in msg


def test_a_chunk_with_fewer_calls_is_refused_naming_the_missing_one():
    with pytest.raises(UnsupportedModelError, match=r"call 2: c:x:0 for one chunk, none for another"):
        same_as_first_chunk(["a:x:0", "b:x:0"], ["a:x:0", "b:x:0", "c:x:0"])


def test_a_chunk_with_more_calls_is_refused_naming_the_extra_one():
    with pytest.raises(UnsupportedModelError, match=r"call 1: none for one chunk, b:x:1 for another"):
        same_as_first_chunk(["a:x:0", "b:x:1"], ["a:x:0"])


def test_a_difference_in_the_clean_flag_alone_is_refused():
    with pytest.raises(UnsupportedModelError, match=r"call 0: a:x:0 for one chunk, a:x:1 for another"):
        same_as_first_chunk(["a:x:1"], ["a:x:0"])


# ---------------------------------------------------------------------------------------------- record and resume
def test_the_first_pass_of_each_kind_is_recorded_and_later_ones_ignored():
    sites = CallSites(comm())
    sites.record("train:1", ["a:x:0"])
    sites.record("train:1", ["other:x:0"])
    sites.record("eval:1", ["b:x:1"])
    assert sites.state_dict() == {"train:1": ["a:x:0"], "eval:1": ["b:x:1"]}


def test_resuming_with_the_same_calls_is_accepted():
    old = CallSites(comm())
    old.record("train:1", ["a:x:0", "b:x:0"])
    new = CallSites(comm())
    new.load_state_dict(old.state_dict())
    new.record("train:1", ["a:x:0", "b:x:0"])
    assert new.state_dict() == old.state_dict()


def test_resuming_with_another_model_is_refused():
    old = CallSites(comm())
    old.record("train:1", ["a:x:0", "b:x:0"])
    new = CallSites(comm())
    new.load_state_dict(old.state_dict())
    with pytest.raises(UnsupportedModelError) as err:
        new.record("train:1", ["a:x:0", "c:x:0"])
    msg = str(err.value)
    assert "other layer calls than when the checkpoint was saved" in msg
    assert "resume with the same model, or start a new run without ckpt_path" in msg


def test_a_kind_the_checkpoint_never_met_is_recorded_without_a_check():
    new = CallSites(comm())
    new.load_state_dict({"train:1": ["a:x:0"]})
    new.record("eval:1", ["z:x:1"])
    assert new.state_dict() == {"eval:1": ["z:x:1"]}


def test_a_checkpoint_without_sites_checks_nothing():
    new = CallSites(comm())
    new.load_state_dict(None)
    new.record("train:1", ["a:x:0"])
    assert new.state_dict() == {"train:1": ["a:x:0"]}


def test_the_saved_table_is_a_copy():
    sites = CallSites(comm())
    sites.record("train:1", ["a:x:0"])
    state = sites.state_dict()
    state["train:2"] = ["b:x:0"]
    assert list(sites.state_dict()) == ["train:1"]


# ---------------------------------------------------------------------------------------------- kind of call
def test_kind_of_is_the_same_on_every_call():
    assert kind_of(True, SIG) == kind_of(True, (True, ("tensor", "tensor"), ()))


def test_kind_of_is_stable_across_runs():
    # a crc32 of the signature's repr: no per-process hash seed; a checkpoint's kinds must match a new run's
    assert kind_of(True, SIG) == "train:c5c3efe9"


def test_kind_of_tells_training_from_evaluation():
    train, ev = kind_of(True, SIG), kind_of(False, SIG)
    assert train.startswith("train:") and ev.startswith("eval:")
    assert train != ev


def test_kind_of_tells_argument_kinds_apart():
    kinds = {kind_of(True, s) for s in [SIG, (True, ("tensor", "None"), ()), (True, ("tensor",), ()),
                                        (True, ("tensor", "tensor"), (("edge_weight", "tensor"),))]}
    assert len(kinds) == 4
