"""The engine's knobs: every documented value passes ``validate()``; a bad one is refused naming the knob and the fix.

Protects the contract that a misconfigured strategy fails when it is set up, with a message that
names the knob, repeats the bad value and says what to use instead, rather than deep inside a step.
"""
import pytest

from pyg_pipe import SplitPoint
from pyg_pipe.engine import PipelineConfig
from pyg_pipe.graph.partition import PARTITION_METHODS


def my_partitioner(edge_index, num_nodes, num_chunks):
    raise AssertionError("validate() must not call the partitioner")


def test_the_defaults_are_valid():
    PipelineConfig().validate()


@pytest.mark.parametrize("knobs", [
    {"num_chunks": None}, {"num_chunks": 1}, {"num_chunks": 8},
    {"shuffle_chunks": False}, {"shuffle_chunks": "independent"},
    {"snapshot_period": None}, {"snapshot_period": 1}, {"snapshot_period": 100},
    {"unbiased_gradients": False}, {"late_gradients": True},
    {"balance": "time"}, {"balance": "layers"}, {"balance": [2, 1]}, {"balance": (1, 1, 1)},
    *({"partition": name} for name in PARTITION_METHODS),
    {"partition": my_partitioner}, {"partition": lambda e, n, c: None},
    {"seed": 17},
    {"per_chunk_statistics": True},
    {"split_points": None}, {"split_points": {}},
    {"split_points": {"conv2": SplitPoint.BEGINNING, "layers.3": SplitPoint.END}},
    {"halo_exchange": "all_to_all"}, {"halo_exchange": "ring"},
])
def test_every_documented_value_is_valid(knobs):
    PipelineConfig(**knobs).validate()


def test_the_documented_partitioners_are_the_ones_accepted():
    assert set(PARTITION_METHODS) == {"auto", "metis", "greedy", "random", "contiguous"}


@pytest.mark.parametrize("bad", [0, -1, True, False, 2.5, "4"])
def test_num_chunks_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError) as err:
        PipelineConfig(num_chunks=bad).validate()
    assert str(err.value) == (f"num_chunks={bad!r} must be a positive integer, 'auto' (from a measured cost model) "
                              f"or None (4 per stage).")


@pytest.mark.parametrize("bad", [0, -3, 2.5, "23"])
def test_snapshot_period_must_be_a_positive_integer_or_none(bad):
    with pytest.raises(ValueError) as err:
        PipelineConfig(snapshot_period=bad).validate()
    msg = str(err.value)
    assert msg.startswith(f"snapshot_period={bad!r} must be a positive integer")
    assert "or None to turn periodic snapshots off" in msg


def test_snapshot_period_true_is_refused_like_num_chunks_true():
    with pytest.raises(ValueError, match="snapshot_period=True"):
        PipelineConfig(snapshot_period=True).validate()


@pytest.mark.parametrize("bad", ["kmeans", "METIS", ""])
def test_an_unknown_partitioner_is_refused_listing_the_known_ones(bad):
    with pytest.raises(ValueError) as err:
        PipelineConfig(partition=bad).validate()
    msg = str(err.value)
    assert msg.startswith(f"partition={bad!r} must be one of ")
    for name in PARTITION_METHODS:
        assert name in msg
    assert "or a callable (edge_index, num_nodes, num_chunks) -> (perm, ptr)" in msg


@pytest.mark.parametrize("bad", ["fast", "Time", ""])
def test_an_unknown_balance_is_refused_naming_the_choices(bad):
    with pytest.raises(ValueError) as err:
        PipelineConfig(balance=bad).validate()
    assert str(err.value) == f"balance={bad!r} must be 'time', 'layers' or a list of layers per stage."


@pytest.mark.parametrize("bad", ["beginning", "END", 0, None])
def test_a_split_point_that_is_not_a_splitpoint_is_refused_naming_the_module(bad):
    with pytest.raises(ValueError) as err:
        PipelineConfig(split_points={"conv1": SplitPoint.END, "layers.2": bad}).validate()
    msg = str(err.value)
    assert msg.startswith(f"split_points={{'layers.2': {bad!r}}}: use SplitPoint.BEGINNING or SplitPoint.END")
    assert "conv1" not in msg


def test_the_first_bad_knob_is_the_one_named():
    with pytest.raises(ValueError, match="^num_chunks=0"):
        PipelineConfig(num_chunks=0, snapshot_period=0, partition="kmeans", balance="fast").validate()
    with pytest.raises(ValueError, match="^partition='kmeans'"):
        PipelineConfig(partition="kmeans", balance="fast").validate()


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_staleness_meter_must_be_a_bool(bad):
    with pytest.raises(ValueError, match=f"staleness_meter={bad!r}"):
        PipelineConfig(staleness_meter=bad).validate()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_max_age_must_be_a_count_of_updates(bad):
    with pytest.raises(ValueError, match=f"max_age={bad!r}"):
        PipelineConfig(max_age=bad).validate()


@pytest.mark.parametrize("bad", [-0.1, True, "0.1", float("nan")])
def test_max_staleness_must_be_a_drift(bad):
    with pytest.raises(ValueError, match="max_staleness="):
        PipelineConfig(max_staleness=bad).validate()


def test_max_staleness_needs_the_meter():
    with pytest.raises(ValueError, match="staleness_meter=True"):
        PipelineConfig(max_staleness=0.1, staleness_meter=False).validate()
    PipelineConfig(max_age=3, staleness_meter=False).validate()  # an age bound does not need it


@pytest.mark.parametrize("bad", [-0.1, 1.0, True, "0.5"])
def test_smoothing_must_be_a_momentum(bad):
    with pytest.raises(ValueError, match="smoothing="):
        PipelineConfig(smoothing=bad).validate()


@pytest.mark.parametrize("bad", ["paired", "Independent", 1, None])
def test_shuffle_chunks_is_true_false_or_independent(bad):
    with pytest.raises(ValueError, match=r"shuffle_chunks=.* must be True .* 'independent' .* or False"):
        PipelineConfig(shuffle_chunks=bad).validate()


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_late_gradients_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="late_gradients="):
        PipelineConfig(late_gradients=bad).validate()
