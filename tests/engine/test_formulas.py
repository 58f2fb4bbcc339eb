"""The per-step communication formulas, against values computed by hand and by brute force.

Protects the predictions the communication tests compare the measured bytes with: GNNPipe's
``(S-1)·|V|·d·b`` per direction, the carried tensors and the output, the graph-parallel halo and
weight all-reduce terms, and ``Σ_p |halo(p)|`` (distinct outside vertices with an edge into each
partition of a reordered graph).
"""
import pytest
import torch

from pyg_pipe.engine import CATEGORIES, gnnpipe_bytes, graph_parallel_bytes, halo_rows


def brute_halo(edges, perm, ptr):
    """``Σ_p |{u outside p : (u, v) an edge with v in p}|`` by listing sets (``perm[new] = old``)."""
    part = {}
    for p in range(len(ptr) - 1):
        for new in range(ptr[p], ptr[p + 1]):
            part[perm[new]] = p
    total = 0
    for p in range(len(ptr) - 1):
        total += len({u for u, v in edges if part[v] == p and part[u] != p})
    return total


def halo_of(edges, perm, ptr):
    return halo_rows(torch.tensor(edges, dtype=torch.long).t().reshape(2, -1), torch.tensor(perm), torch.tensor(ptr))


# ---------------------------------------------------------------------------------------------- halo_rows
def test_halo_rows_of_a_hand_made_graph_with_identity_order():
    # partitions {0, 1} and {2, 3}; into {2, 3}: from 0 and 1; into {0, 1}: from 3
    edges = [(0, 2), (1, 2), (0, 3), (3, 1), (2, 3), (0, 1)]
    assert halo_of(edges, [0, 1, 2, 3], [0, 2, 4]) == 3


def test_a_vertex_with_several_edges_into_a_partition_counts_once_there():
    edges = [(0, 2), (0, 3), (0, 2), (1, 3)]
    assert halo_of(edges, [0, 1, 2, 3], [0, 2, 4]) == 2


def test_a_vertex_read_by_two_partitions_counts_once_for_each():
    # partitions {0}, {1}, {2}: vertex 0 feeds both others
    assert halo_of([(0, 1), (0, 2)], [0, 1, 2], [0, 1, 2, 3]) == 2


def test_edges_count_in_their_direction_only():
    # 0 -> 2 and 1 -> 2 put 0 and 1 in the halo of {2, 3}; reversed, only 2 is in the halo of {0, 1}
    assert halo_of([(0, 2), (1, 2)], [0, 1, 2, 3], [0, 2, 4]) == 2
    assert halo_of([(2, 0), (2, 1)], [0, 1, 2, 3], [0, 2, 4]) == 1


def test_halo_rows_follow_the_order_not_the_user_ids():
    # perm[new] = old: new ids 0, 1 are old 2, 0 (partition 0 = {2, 0}); partition 1 = {3, 1}
    edges = [(0, 2), (1, 3), (1, 0), (3, 0), (2, 1)]
    # into {0, 2}: from 1 and 3 -> 2; into {1, 3}: from 2 -> 1
    assert halo_of(edges, [2, 0, 3, 1], [0, 2, 4]) == 3
    # identity order: into {0, 1} from 3 and 2, into {2, 3} from 0 and 1
    assert halo_of(edges, [0, 1, 2, 3], [0, 2, 4]) == brute_halo(edges, [0, 1, 2, 3], [0, 2, 4]) == 4


def test_one_partition_and_a_graph_without_cut_edges_have_no_halo():
    edges = [(0, 1), (1, 0), (2, 3), (3, 2)]
    assert halo_of(edges, [0, 1, 2, 3], [0, 4]) == 0
    assert halo_of(edges, [0, 1, 2, 3], [0, 2, 4]) == 0
    assert halo_of([(0, 0), (3, 3)], [0, 1, 2, 3], [0, 2, 4]) == 0      # self-loops


@pytest.mark.parametrize("seed", range(6))
def test_halo_rows_match_brute_force_on_random_graphs_orders_and_partitions(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(4, 20, (1,), generator=g))
    m = int(torch.randint(1, 4 * n, (1,), generator=g))
    edges = torch.randint(0, n, (m, 2), generator=g).tolist()
    perm = torch.randperm(n, generator=g).tolist()
    parts = int(torch.randint(1, 5, (1,), generator=g))
    cuts = sorted(torch.randint(0, n + 1, (parts - 1,), generator=g).tolist())   # empty partitions allowed
    ptr = [0, *cuts, n]
    assert halo_of([tuple(e) for e in edges], perm, ptr) == brute_halo([tuple(e) for e in edges], perm, ptr)


def test_an_empty_partition_between_others_is_handled():
    # partitions {0, 1}, {}, {2, 3}
    edges = [(0, 2), (3, 1), (1, 3)]
    assert halo_of(edges, [0, 1, 2, 3], [0, 2, 2, 4]) == 3


# ---------------------------------------------------------------------------------------------- gnnpipe_bytes
def test_gnnpipe_bytes_of_three_stages_by_hand():
    got = gnnpipe_bytes(num_nodes=10, num_stages=3, width=4, out_width=2, carried_width=1)
    assert set(got) == {*CATEGORIES, "total"}
    assert got["stage_activations"] == 2 * 10 * 4 * 4 == 320
    assert got["stage_gradients"] == 320
    assert got["carried"] == 2 * 2 * 10 * 1 * 4 == 160
    assert got["output"] == 2 * 10 * 2 * 4 == 160
    assert got["halo_forward"] == got["halo_backward"] == got["weight_allreduce"] == got["other"] == 0
    assert got["total"] == 960


def test_gnnpipe_output_goes_to_every_other_rank_and_values_may_be_half_precision():
    got = gnnpipe_bytes(num_nodes=10, num_stages=3, width=4, out_width=2, num_ranks=6, bytes_per_value=2)
    assert got["stage_activations"] == 2 * 10 * 4 * 2 == 160
    assert got["carried"] == 0
    assert got["output"] == 5 * 10 * 2 * 2 == 200
    assert got["total"] == 160 + 160 + 200


def test_bf16_boundaries_halve_the_stage_carried_and_halo_terms_only():
    full = graph_parallel_bytes(num_nodes=10, halo=3, widths=[4], num_params=50, ways=2, out_width=2, num_stages=2,
                                width=8, carried_width=1)
    half = graph_parallel_bytes(num_nodes=10, halo=3, widths=[4], num_params=50, ways=2, out_width=2, num_stages=2,
                                width=8, carried_width=1, boundary_bytes=2)
    for c in ("stage_activations", "stage_gradients", "carried", "halo_forward", "halo_backward"):
        assert half[c] * 2 == full[c] > 0, c
    assert half["output"] == full["output"] and half["weight_allreduce"] == full["weight_allreduce"]


def test_a_single_stage_sends_nothing():
    one = gnnpipe_bytes(num_nodes=7, num_stages=1, width=16, out_width=3, carried_width=5)
    assert all(v == 0 for v in one.values())


# ---------------------------------------------------------------------------------------------- graph_parallel_bytes
def test_graph_parallel_bytes_of_two_ways_by_hand():
    got = graph_parallel_bytes(num_nodes=10, halo=3, widths=[4, 2], num_params=100, ways=2, out_width=2)
    assert set(got) == {*CATEGORIES, "total"}
    assert got["halo_forward"] == got["halo_backward"] == (4 + 2) * 3 * 4 == 72
    assert got["weight_allreduce"] == 2 * 1 * 100 * 4 == 800
    assert got["output"] == 1 * 10 * 2 * 4 == 80                    # to the one other rank
    assert got["stage_activations"] == got["stage_gradients"] == got["carried"] == got["other"] == 0
    assert got["total"] == 72 + 72 + 800 + 80


def test_hybrid_bytes_add_the_pipeline_terms_between_stages():
    got = graph_parallel_bytes(num_nodes=10, halo=3, widths=[4], num_params=50, ways=2, out_width=2, num_stages=2,
                               width=8, carried_width=1, bytes_per_value=2)
    assert got["stage_activations"] == got["stage_gradients"] == 1 * 10 * 8 * 2 == 160
    assert got["carried"] == 2 * 1 * 10 * 1 * 2 == 40
    assert got["output"] == 3 * 10 * 2 * 2 == 120                   # P = 4 ranks
    assert got["halo_forward"] == got["halo_backward"] == 4 * 3 * 2 == 24
    assert got["weight_allreduce"] == 2 * 1 * 50 * 2 == 200
    assert got["total"] == 160 + 160 + 40 + 120 + 24 + 24 + 200


def test_one_way_and_no_computed_sites_send_nothing_among_ways():
    got = graph_parallel_bytes(num_nodes=10, halo=0, widths=[], num_params=100, ways=1, out_width=2)
    assert got["total"] == 0


def test_halo_rows_feed_graph_parallel_bytes():
    halo = halo_of([(0, 2), (1, 2), (0, 3), (3, 1)], [0, 1, 2, 3], [0, 2, 4])
    got = graph_parallel_bytes(num_nodes=4, halo=halo, widths=[5], num_params=0, ways=2, out_width=1)
    assert got["halo_forward"] == 5 * 3 * 4
