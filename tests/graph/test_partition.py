"""Chunking keeps its contract (a permutation into contiguous, non-empty chunks) and cuts few edges."""

import math

import pytest
import torch

from pyg_pipe.graph import cut_edges, make_chunks, partition_nodes, sbm_graph
from pyg_pipe.graph.greedy import _rebalance
from pyg_pipe.graph.partition import _fill_empty_parts, _generator, _symmetric_edges

CHEAP_METHODS = ["contiguous", "random", "greedy"]


@pytest.fixture(scope="module")
def sbm():
    return sbm_graph(1200, num_classes=4, avg_degree=12.0, homophily=0.9, seed=1)


def _methods():
    out = list(CHEAP_METHODS)
    try:
        import pymetis  # noqa: F401
        out.append("metis")
    except ImportError:
        out.append(pytest.param("metis", marks=pytest.mark.skip(reason="pymetis not installed")))
    return out


def _check_chunks(perm, chunk_ptr, num_nodes, num_chunks):
    assert perm.dtype == torch.long and chunk_ptr.dtype == torch.long
    assert torch.equal(torch.sort(perm).values, torch.arange(num_nodes))     # a permutation
    assert chunk_ptr.shape == (num_chunks + 1,)
    assert chunk_ptr[0] == 0 and chunk_ptr[-1] == num_nodes                 # ranges cover all
    assert bool((chunk_ptr[1:] > chunk_ptr[:-1]).all())                      # non-empty, ordered


@pytest.mark.parametrize("method", _methods())
def test_make_chunks_contract(sbm, method):
    n = sbm.num_nodes
    perm, ptr = make_chunks(sbm.edge_index, n, 6, method=method, seed=3)
    _check_chunks(perm, ptr, n, 6)
    for c in range(6):  # within a chunk, original ids ascend
        block = perm[ptr[c]:ptr[c + 1]]
        assert bool((block[1:] > block[:-1]).all())


def test_single_chunk_is_identity(sbm):
    perm, ptr = make_chunks(sbm.edge_index, sbm.num_nodes, 1, method="random", seed=5)
    assert torch.equal(perm, torch.arange(sbm.num_nodes))
    assert ptr.tolist() == [0, sbm.num_nodes]


@pytest.mark.parametrize("bad", [0, -1, 11])
def test_num_chunks_out_of_range(bad):
    edge_index = torch.tensor([[0, 1], [1, 0]])
    with pytest.raises(ValueError, match="num_chunks"):
        make_chunks(edge_index, 10, bad)


def test_parts_capped_at_num_nodes():
    # 5 chunks * 4 parts > 7 vertices: parts are capped, every chunk still gets a vertex
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]])
    for method in CHEAP_METHODS:
        perm, ptr = make_chunks(edge_index, 7, 5, method=method)
        _check_chunks(perm, ptr, 7, 5)
    perm, ptr = make_chunks(edge_index, 7, 7, method="greedy")
    assert ptr.tolist() == list(range(8))


@pytest.mark.parametrize("method", _methods())
def test_parts_non_empty_and_balanced(sbm, method):
    n, k = sbm.num_nodes, 16
    part = partition_nodes(sbm.edge_index, n, k, method=method, seed=0)
    assert part.shape == (n,) and part.dtype == torch.long
    size = torch.bincount(part, minlength=k)
    assert size.numel() == k and bool((size > 0).all())
    assert size.max().item() <= 1.5 * n / k
    if method in ("random", "contiguous"):
        assert size.max() - size.min() <= 1
    if method == "greedy":
        assert size.max().item() <= math.ceil(1.1 * n / k)


@pytest.mark.parametrize("method", ["greedy", "metis"])
def test_fewer_cut_edges_than_random(sbm, method):
    if method == "metis":
        pytest.importorskip("pymetis")
    k = 8
    random_cut = cut_edges(sbm.edge_index, partition_nodes(sbm.edge_index, sbm.num_nodes, k, method="random"))
    cut = cut_edges(sbm.edge_index, partition_nodes(sbm.edge_index, sbm.num_nodes, k, method=method))
    assert cut < 0.8 * random_cut


def test_chunks_cut_fewer_edges_than_random(sbm):
    n = sbm.num_nodes

    def chunk_cut(method):
        perm, ptr = make_chunks(sbm.edge_index, n, 4, method=method, seed=0)
        chunk = torch.empty(n, dtype=torch.long)
        chunk[perm] = torch.repeat_interleave(torch.arange(4), ptr.diff())
        return cut_edges(sbm.edge_index, chunk)

    assert chunk_cut("greedy") < 0.8 * chunk_cut("random")


@pytest.mark.parametrize("method", _methods())
def test_deterministic_for_a_seed(sbm, method):
    a = make_chunks(sbm.edge_index, sbm.num_nodes, 4, method=method, seed=7)
    b = make_chunks(sbm.edge_index, sbm.num_nodes, 4, method=method, seed=7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_seed_changes_random_partition(sbm):
    a = partition_nodes(sbm.edge_index, sbm.num_nodes, 4, method="random", seed=0)
    b = partition_nodes(sbm.edge_index, sbm.num_nodes, 4, method="random", seed=1)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("method", _methods())
def test_isolated_vertices_and_messy_input(method):
    # a triangle, a duplicated edge, a self loop, one direction only, and isolated vertices 6..19
    edge_index = torch.tensor([[0, 1, 2, 0, 0, 3, 3, 4], [1, 2, 0, 1, 0, 4, 4, 5]])
    part = partition_nodes(edge_index, 20, 5, method=method)
    assert bool((torch.bincount(part, minlength=5) > 0).all())
    perm, ptr = make_chunks(edge_index, 20, 3, method=method)
    _check_chunks(perm, ptr, 20, 3)


def test_graph_without_edges():
    empty = torch.empty(2, 0, dtype=torch.long)
    for method in CHEAP_METHODS:
        perm, ptr = make_chunks(empty, 9, 3, method=method)
        _check_chunks(perm, ptr, 9, 3)


def test_more_parts_than_vertices():
    part = partition_nodes(torch.tensor([[0], [1]]), 3, 5, method="greedy")
    assert part.tolist() == [0, 1, 2]


def test_auto_method(sbm):
    part = partition_nodes(sbm.edge_index, sbm.num_nodes, 4, method="auto")
    assert bool((torch.bincount(part, minlength=4) > 0).all())


def test_fill_empty_parts():
    part = torch.tensor([0, 0, 0, 0, 2, 2])
    fixed = _fill_empty_parts(part, 4)
    assert sorted(torch.bincount(fixed, minlength=4).tolist()) == [1, 1, 2, 2]
    assert bool((fixed[part == 2] == 2).all())  # only the largest part gave vertices away


def test_rebalance_trims_to_cap():
    path = torch.stack([torch.arange(99), torch.arange(1, 100)])
    row, col = _symmetric_edges(path, 100)
    part = torch.zeros(100, dtype=torch.long)
    part[90:] = 1
    fixed = _rebalance(row, col, part, 4, 27, _generator(0))
    assert torch.bincount(fixed, minlength=4).max() <= 27


def test_cut_edges_counts_columns():
    edge_index = torch.tensor([[0, 1, 1, 2, 2, 3], [1, 0, 2, 1, 3, 2]])
    assert cut_edges(edge_index, torch.tensor([0, 0, 1, 1])) == 2
    assert cut_edges(edge_index, torch.tensor([0, 0, 0, 0])) == 0


def test_bad_arguments():
    edge_index = torch.tensor([[0, 1], [1, 5]])
    with pytest.raises(ValueError, match=r"vertex ids from 0 to 5, but the graph has 4 vertices \(ids 0..3\)"):
        partition_nodes(edge_index, 4, 2)
    with pytest.raises(ValueError, match="method"):
        partition_nodes(edge_index, 6, 2, method="spectral")
    with pytest.raises(ValueError, match="num_parts"):
        partition_nodes(edge_index, 6, 0)
    with pytest.raises(ValueError, match="parts_per_chunk"):
        make_chunks(edge_index, 6, 2, parts_per_chunk=0)
