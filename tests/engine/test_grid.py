"""The rank grid: rank ``s·W + w`` runs stage ``s`` of way ``w``, and the grid shape chosen for P devices.

Protects the layout every message relies on (a rank's stage, way, neighbours on its way and the
owners of each stage's parameters), the choice of ``(S, W)`` from what the user gave, and that every
refused shape names the fix. Runs without ``torch.distributed``: no process group is created.
"""
import pytest
import torch.distributed as dist

from pyg_pipe.engine.plan.grid import RankGrid, check_chunks_per_way, grid_shape, ways_for_layers


# ---------------------------------------------------------------------------------------------- RankGrid
# rank, stages, ways -> stage, way, prev, next, is_last, owner_ranks (written by hand)
GRIDS = [
    (0, 1, 1, 0, 0, None, None, True, [0]),
    (0, 4, 1, 0, 0, None, 1, False, [0, 1, 2, 3]),
    (2, 4, 1, 2, 0, 1, 3, False, [0, 1, 2, 3]),
    (3, 4, 1, 3, 0, 2, None, True, [0, 1, 2, 3]),
    (3, 1, 4, 0, 3, None, None, True, [0]),
    (1, 2, 3, 0, 1, None, 4, False, [0, 3]),
    (3, 3, 2, 1, 1, 1, 5, False, [0, 2, 4]),
    (4, 3, 2, 2, 0, 2, None, True, [0, 2, 4]),
    (5, 3, 2, 2, 1, 3, None, True, [0, 2, 4]),
]


@pytest.mark.parametrize("rank,S,W,stage,way,prev,next_,last,owners", GRIDS)
def test_a_rank_knows_its_stage_way_neighbours_and_owners(rank, S, W, stage, way, prev, next_, last, owners):
    assert not dist.is_initialized()
    g = RankGrid(rank, S * W, S, W)
    assert (g.stage, g.way) == (stage, way)
    assert g.prev == prev
    assert g.next == next_
    assert g.is_last is last
    assert g.owner_ranks == owners
    assert g.stage_group is None


def test_rank_of_defaults_to_this_ranks_way():
    g = RankGrid(3, 6, 3, 2)                   # stage 1, way 1
    assert [g.rank_of(s) for s in range(3)] == [1, 3, 5]
    assert [g.rank_of(s, 0) for s in range(3)] == [0, 2, 4]
    assert g.rank_of(2, 1) == 5


@pytest.mark.parametrize("S,W", [(1, 6), (2, 3), (3, 2), (6, 1)])
def test_ranks_and_grid_cells_correspond_one_to_one(S, W):
    cells = {}
    for rank in range(S * W):
        g = RankGrid(rank, S * W, S, W)
        assert g.rank_of(g.stage, g.way) == rank
        cells[(g.stage, g.way)] = rank
    assert sorted(cells) == [(s, w) for s in range(S) for w in range(W)]


def test_prev_and_next_stay_on_the_same_way():
    for rank in range(8):
        g = RankGrid(rank, 8, 4, 2)
        for other in (g.prev, g.next):
            if other is not None:
                assert other % 2 == g.way
                assert abs(other // 2 - g.stage) == 1


def test_a_grid_whose_product_is_not_the_world_size_is_refused():
    with pytest.raises(ValueError, match=r"stages=4 x ways=2 = 8 ranks, but 6 processes run; choose stages and ways "
                                         r"whose product is the number of devices"):
        RankGrid(0, 6, 4, 2)


# ---------------------------------------------------------------------------------------------- grid_shape
@pytest.mark.parametrize("P,min_ways,want", [(1, 1, (1, 1)), (6, 1, (6, 1)), (6, 2, (3, 2)), (6, 4, (1, 6)),
                                              (8, 3, (2, 4)), (7, 2, (1, 7)), (4, 0, (4, 1))])
def test_with_neither_given_the_fewest_ways_at_least_min_ways_dividing_p_are_used(P, min_ways, want):
    assert grid_shape(P, None, None, min_ways) == want


@pytest.mark.parametrize("P,stages,ways,want", [(6, 2, None, (2, 3)), (6, 6, None, (6, 1)), (6, None, 3, (2, 3)),
                                                (6, None, 1, (6, 1)), (8, 2, 4, (2, 4)), (5, 1, None, (1, 5))])
def test_the_missing_one_is_derived_from_the_one_given(P, stages, ways, want):
    assert grid_shape(P, stages, ways) == want


def test_min_ways_does_not_override_ways_given():
    assert grid_shape(4, None, 1, min_ways=2) == (4, 1)


def test_ways_that_do_not_divide_the_devices_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="ways=4 does not divide the 6 processes; choose a divisor of the device"):
        grid_shape(6, None, 4)


def test_stages_that_do_not_divide_the_devices_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="stages=4 does not divide the 6 processes; choose a divisor"):
        grid_shape(6, 4, None)


def test_stages_and_ways_whose_product_is_not_the_devices_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="stages=2 x ways=2 = 4 ranks, but 6 processes run; choose stages and ways"):
        grid_shape(6, 2, 2)


def test_min_ways_above_the_device_count_is_refused_with_a_value_error():
    with pytest.raises(ValueError, match="ways"):
        grid_shape(1, None, None, min_ways=2)


# ---------------------------------------------------------------------------------------------- ways_for_layers
@pytest.mark.parametrize("P,layers,min_ways,want", [
    (8, 8, 1, (8, 1)),      # one layer per stage: no ways needed
    (8, 20, 1, (8, 1)),
    (8, 3, 1, (2, 4)),      # 8 and 4 stages leave some without a layer, 2 stages do not
    (6, 4, 1, (3, 2)),
    (6, 2, 1, (2, 3)),
    (8, 3, 8, (1, 8)),      # min_ways forces more ways than the layers need
    (4, 1, 1, (1, 4)),
    (4, 0, 1, (1, 4)),      # no layers: one stage
])
def test_ways_for_layers_adds_the_fewest_ways_that_give_every_stage_a_layer(P, layers, min_ways, want):
    S, W = ways_for_layers(P, layers, min_ways)
    assert (S, W) == want
    assert S * W == P


# ---------------------------------------------------------------------------------------------- chunks per way
@pytest.mark.parametrize("chunks,ways", [(4, 1), (4, 2), (8, 4), (3, 3)])
def test_chunks_that_are_a_multiple_of_the_ways_are_accepted(chunks, ways):
    check_chunks_per_way(chunks, ways)


@pytest.mark.parametrize("chunks,ways,suggested", [(6, 4, 4), (2, 4, 4), (10, 4, 8), (7, 2, 6), (1, 3, 3)])
def test_chunks_not_a_multiple_of_the_ways_are_refused_suggesting_a_multiple(chunks, ways, suggested):
    with pytest.raises(ValueError) as err:
        check_chunks_per_way(chunks, ways)
    msg = str(err.value)
    assert f"num_chunks={chunks} must be a multiple of the {ways} graph-parallel ways" in msg
    assert "each way owns the same number of chunks" in msg
    assert msg.endswith(f"use e.g. num_chunks={suggested}.")
    check_chunks_per_way(suggested, ways)   # the suggestion itself is accepted
