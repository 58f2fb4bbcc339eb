"""The GNNPipe schedule: which chunk each way runs at which clock, and which halo reads are fresh.

Protects the one definition the history store, the halo exchange and the backward all rely on: way
``w`` owns chunks ``w·cpw .. (w+1)·cpw - 1`` and runs them in the order ``π`` (the identity without
T1, a seeded permutation shared by every rank with it, drawn in pairs: an order, then its reverse); a read of chunk ``o``'s rows by chunk ``r``
is fresh iff ``clock(o) <= clock(r)``; and T3 scales the gradient of a fresh cross-chunk read by 2,
except for chunks that always run at the same clock as the reader (scale 1). Expected tables are
written by hand.
"""
import pytest
import torch

from pyg_pipe.engine.plan.schedule import Schedule


# ---------------------------------------------------------------------------------------------- order and clocks
def test_without_shuffle_one_way_runs_its_chunks_in_id_order():
    s = Schedule(4, 1, shuffle=False)
    for step in (0, 1, 7):
        assert s.local_order(step) == [0, 1, 2, 3]
        assert s.order(step, 0) == [0, 1, 2, 3]
        assert s.clocks(step).tolist() == [0, 1, 2, 3]


def test_without_shuffle_two_ways_run_their_own_chunks_at_the_same_clocks():
    s = Schedule(4, 2, shuffle=False)
    assert s.order(0, 0) == [0, 1]
    assert s.order(0, 1) == [2, 3]
    assert s.clocks(0).tolist() == [0, 1, 0, 1]


def test_three_ways_of_two_chunks_each():
    s = Schedule(6, 3, shuffle=False)
    assert [s.order(5, w) for w in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert s.clocks(5).tolist() == [0, 1, 0, 1, 0, 1]


def test_one_chunk_per_way_runs_at_clock_zero_even_when_shuffled():
    s = Schedule(3, 3, shuffle=True, seed=5)
    assert [s.order(2, w) for w in range(3)] == [[0], [1], [2]]
    assert s.clocks(2).tolist() == [0, 0, 0]


def test_a_shuffled_order_and_its_clocks_match_the_hand_written_table():
    # seed 0, step 0: π = torch.randperm(6) seeded with 0·1000003 + 0 = [2, 5, 3, 0, 1, 4]
    s = Schedule(12, 2, shuffle=True, seed=0)
    assert s.order(0, 0) == [2, 5, 3, 0, 1, 4]
    assert s.order(0, 1) == [8, 11, 9, 6, 7, 10]
    #                     chunk: 0  1  2  3  4  5
    assert s.clocks(0).tolist() == [3, 4, 0, 2, 5, 1] * 2


def _randperm(n: int, seed: int, step: int) -> list:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + step)).tolist()


@pytest.mark.parametrize("seed,step", [(0, 0), (0, 4), (2, 0), (7, 10)])
def test_an_even_step_draws_randperm_seeded_with_seed_times_1000003_plus_step(seed, step):
    assert Schedule(10, 2, shuffle=True, seed=seed).local_order(step) == _randperm(5, seed, step)


@pytest.mark.parametrize("seed,step", [(0, 1), (0, 3), (2, 1), (7, 11)])
def test_an_odd_step_runs_the_step_before_it_in_reverse(seed, step):
    assert Schedule(10, 2, shuffle=True, seed=seed).local_order(step) == _randperm(5, seed, step - 1)[::-1]


@pytest.mark.parametrize("seed,step", [(0, 0), (0, 3), (2, 0), (7, 11)])
def test_independent_orders_are_randperm_seeded_with_seed_times_1000003_plus_step(seed, step):
    assert Schedule(10, 2, shuffle="independent", seed=seed).local_order(step) == _randperm(5, seed, step)


@pytest.mark.parametrize("chunks,ways", [(2, 1), (5, 1), (8, 2), (12, 3)])
def test_over_every_two_steps_each_chunk_reads_each_other_chunk_of_its_way_fresh_once(chunks, ways):
    """T1's pairs (module docstring of the schedule): an order and its reverse, so a cross-chunk read of a way is
    fresh in exactly one of steps 2t and 2t + 1, and T3's doubling of its gradient is exact over the two."""
    s = Schedule(chunks, ways, shuffle=True, seed=3)
    cpw = chunks // ways
    for t in range(0, 8, 2):
        for reader in range(chunks):
            owners = torch.tensor([o for o in range(chunks) if o // cpw == reader // cpw and o != reader])
            fresh = Schedule.fresh(s.clocks(t), owners, reader).int() + Schedule.fresh(s.clocks(t + 1), owners,
                                                                                      reader).int()
            assert fresh.tolist() == [1] * owners.numel()
    independent = Schedule(chunks, ways, shuffle="independent", seed=3)  # (a coin a step: some pair is not even)
    if cpw == 2:
        assert any(independent.local_order(t) == independent.local_order(t + 1) for t in range(0, 16, 2))


def test_a_shuffled_order_is_a_permutation_of_each_ways_own_chunks():
    s = Schedule(12, 3, shuffle=True, seed=1)
    for step in range(6):
        for w in range(3):
            assert sorted(s.order(step, w)) == list(range(4 * w, 4 * w + 4))


def test_the_shuffled_order_is_the_same_on_every_call_and_every_rank():
    a, b = Schedule(12, 2, shuffle=True, seed=3), Schedule(12, 2, shuffle=True, seed=3)
    for step in range(5):
        assert a.local_order(step) == a.local_order(step) == b.local_order(step)
        assert torch.equal(a.clocks(step), b.clocks(step))


def test_the_shuffled_order_changes_across_steps_and_seeds():
    s = Schedule(12, 2, shuffle=True, seed=0)
    assert s.local_order(0) != s.local_order(1)
    assert len({tuple(s.local_order(t)) for t in range(8)}) > 4
    assert Schedule(12, 2, shuffle=True, seed=1).local_order(0) != s.local_order(0)


def test_drawing_an_order_leaves_the_global_random_state_alone():
    s = Schedule(12, 2, shuffle=True, seed=0)
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    s.local_order(4)
    s.clocks(4)
    assert torch.equal(torch.rand(3), want)


@pytest.mark.parametrize("step", range(4))
def test_the_clock_of_a_chunk_is_its_position_in_its_ways_order(step):
    s = Schedule(8, 2, shuffle=True, seed=9)
    clock = s.clocks(step)
    assert clock.dtype == torch.long and clock.shape == (8,)
    for w in range(2):
        assert [int(clock[c]) for c in s.order(step, w)] == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------- fresh and stale
def test_fresh_reads_are_those_of_chunks_at_the_same_or_an_earlier_clock_two_ways():
    clock = Schedule(4, 2, shuffle=False).clocks(0)        # [0, 1, 0, 1]
    owners = torch.arange(4)
    table = {0: [True, False, True, False],   # clock 0: the other clock-0 chunk (way 1) is live, clock 1 stale
             1: [True, True, True, True],     # clock 1: everything ran at clock 0 or runs now
             2: [True, False, True, False],
             3: [True, True, True, True]}
    for reader, want in table.items():
        assert Schedule.fresh(clock, owners, reader).tolist() == want


def test_fresh_follows_a_hand_written_clock():
    clock = torch.tensor([2, 0, 1])           # chunk 1 runs first, then 2, then 0
    owners = torch.tensor([0, 1, 2, 2, 1])
    assert Schedule.fresh(clock, owners, 0).tolist() == [True, True, True, True, True]
    assert Schedule.fresh(clock, owners, 1).tolist() == [False, True, False, False, True]
    assert Schedule.fresh(clock, owners, 2).tolist() == [False, True, True, True, True]


# ---------------------------------------------------------------------------------------------- gradient scale
def test_unbiased_gradients_double_cross_chunk_reads_on_one_way():
    s = Schedule(4, 1, shuffle=False, unbiased=True)
    assert s.gradient_scale(torch.arange(4), 1).tolist() == [2.0, 1.0, 2.0, 2.0]


def test_chunks_always_at_the_readers_clock_on_another_way_keep_scale_one():
    s = Schedule(4, 2, shuffle=True, seed=0, unbiased=True)
    owners = torch.arange(4)
    assert s.gradient_scale(owners, 0).tolist() == [1.0, 2.0, 1.0, 2.0]   # chunk 2: way 1's position 0
    assert s.gradient_scale(owners, 3).tolist() == [2.0, 1.0, 2.0, 1.0]   # chunk 1: way 0's position 1


def test_the_scale_is_per_read_row_including_repeats():
    s = Schedule(6, 2, shuffle=False, unbiased=True)
    assert s.gradient_scale(torch.tensor([4, 4, 1, 0]), 1).tolist() == [1.0, 1.0, 1.0, 2.0]


def test_biased_gradients_keep_every_scale_at_one():
    s = Schedule(4, 2, shuffle=True, unbiased=False)
    scale = s.gradient_scale(torch.tensor([0, 1, 2, 3, 1]), 0)
    assert scale.tolist() == [1.0] * 5


@pytest.mark.parametrize("chunks,ways", [(1, 1), (2, 2), (4, 4)])
def test_one_chunk_per_way_keeps_every_scale_at_one(chunks, ways):
    s = Schedule(chunks, ways, unbiased=True)
    assert s.gradient_scale(torch.arange(chunks), 0).tolist() == [1.0] * chunks


def test_scales_are_floats_of_the_same_dtype_in_every_case():
    owners = torch.arange(4)
    dtypes = {Schedule(4, 1, unbiased=True).gradient_scale(owners, 0).dtype,
              Schedule(4, 1, unbiased=False).gradient_scale(owners, 0).dtype,
              Schedule(4, 4, unbiased=True).gradient_scale(owners, 0).dtype}
    assert dtypes == {torch.get_default_dtype()}


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("chunks,ways", [(6, 4), (3, 2), (1, 2)])
def test_chunks_not_a_multiple_of_the_ways_are_refused_naming_both(chunks, ways):
    with pytest.raises(ValueError, match=f"num_chunks={chunks} must be a multiple of the {ways} graph-parallel ways"):
        Schedule(chunks, ways)
