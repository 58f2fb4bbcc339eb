"""Chunk-local graphs: halos, local edges, and layers on a chunk equal to the full graph's rows."""
import torch
from torch_geometric.nn import GATConv, GraphConv, SAGEConv

from pyg_pipe.graph import ChunkedGraph, make_chunks, make_way_chunks
from tests.models import small_graph


def _graph():
    x, edge_index, _, _ = small_graph()
    loops = torch.arange(0, 60, 7)
    return x, torch.cat([edge_index, torch.stack([loops, loops])], 1)


def test_local_edges_are_the_in_edges_plus_halo_self_loops():
    x, edge_index = _graph()
    perm, ptr = make_chunks(edge_index, 60, 4, method="random")
    g = ChunkedGraph(edge_index[0], edge_index[1], 60, perm, ptr)
    inv = g.inv
    dst_chunk = g.chunk_of[inv[edge_index[1]]]
    for lg in g.chunks:
        into = torch.nonzero(dst_chunk == lg.index).view(-1)
        assert torch.equal(lg.edge_ids[:into.numel()].sort().values, into)
        # the rest are self loops of halo vertices
        rest = lg.edge_ids[into.numel():]
        assert bool((edge_index[0, rest] == edge_index[1, rest]).all())
        assert set(inv[edge_index[0, rest]].tolist()) <= set(lg.halo.tolist())
        # halo: exactly the sources outside the chunk, ascending
        srcs = inv[edge_index[0, into]]
        outside = srcs[(srcs < lg.start) | (srcs >= lg.end)]
        assert torch.equal(lg.halo, torch.unique(outside))
        assert bool((lg.edge_index[1] < lg.rows).all() or rest.numel())
        # local ids map back to the user's vertices
        nodes = lg.nodes
        assert torch.equal(perm[nodes[lg.edge_index[0]]], edge_index[0, lg.edge_ids])
        assert torch.equal(perm[nodes[lg.edge_index[1]]], edge_index[1, lg.edge_ids])


def test_layers_on_a_chunk_equal_the_full_graph_rows():
    """Layers that do not normalise by degrees need nothing but the halo rows."""
    x, edge_index = _graph()
    w = torch.rand(edge_index.size(1), generator=torch.Generator().manual_seed(0))
    perm, ptr = make_chunks(edge_index, 60, 5, method="random", seed=3)
    g = ChunkedGraph(edge_index[0], edge_index[1], 60, perm, ptr)
    for conv, weighted in ((SAGEConv(8, 5), False), (GATConv(8, 5, heads=2), False), (GraphConv(8, 5), True)):
        full = conv(x, edge_index, w) if weighted else conv(x, edge_index)
        for lg in g.chunks:
            xl = x[perm[lg.nodes]]
            out = conv(xl, lg.edge_index, g.local_edges(lg, w)) if weighted else conv(xl, lg.edge_index)
            torch.testing.assert_close(out[:lg.rows], full[perm[lg.start:lg.end]], atol=1e-5, rtol=0)


def test_mirrors_are_the_rows_other_ways_read():
    x, edge_index = _graph()
    perm, ptr = make_way_chunks(edge_index, 60, 2, 2, method="greedy")
    g = ChunkedGraph(edge_index[0], edge_index[1], 60, perm, ptr, ways=2)
    mirrors = g.mirrors()
    for c in range(4):
        for w in range(2):
            if w == c // 2:
                continue
            read = torch.unique(torch.cat([g.chunks[r].halo for r in (2 * w, 2 * w + 1)]))
            want = read[(read >= g.chunks[c].start) & (read < g.chunks[c].end)]
            assert torch.equal(mirrors[(c, w)], want)


def test_out_degrees_follow_the_weights():
    x, edge_index = _graph()
    perm, ptr = make_chunks(edge_index, 60, 3, method="random")
    g = ChunkedGraph(edge_index[0], edge_index[1], 60, perm, ptr)
    w = torch.rand(edge_index.size(1))
    deg = g.out_degree(w, torch.float64)
    keep = edge_index[0] != edge_index[1]
    want = torch.zeros(60, dtype=torch.float64).index_add_(0, edge_index[0, keep], w[keep].double())
    torch.testing.assert_close(deg, want[perm])
    w2 = w * 2
    torch.testing.assert_close(g.out_degree(w2, torch.float64), 2 * want[perm])  # new values: recomputed


def test_in_degrees_match_pyg_normalisation():
    """The whole-graph degrees gcn_norm computes (self loops kept or filled, PyG's rule for no weights),
    for every combination of weights, added self loops and fill value."""
    from torch_geometric.utils import add_remaining_self_loops, scatter
    x, edge_index = _graph()
    perm, ptr = make_chunks(edge_index, 60, 3, method="random")
    g = ChunkedGraph(edge_index[0], edge_index[1], 60, perm, ptr)
    w = torch.rand(edge_index.size(1), dtype=torch.float64) + 0.5
    for weight in (None, w):
        for loops in (True, False):
            for fill in (1.0, 2.0):
                ei, ew = edge_index, weight
                if loops:
                    ei, ew = add_remaining_self_loops(ei, ew, fill, 60)
                if ew is None:
                    ew = torch.ones(ei.size(1), dtype=torch.float64)
                want = scatter(ew, ei[1], 0, dim_size=60, reduce="sum")
                got = g.in_degree(weight, loops, fill, torch.float64)
                torch.testing.assert_close(got, want[perm], msg=f"weights={weight is not None} loops={loops} {fill}")
    assert not g.repeated_loops
    twice = torch.cat([edge_index, torch.tensor([[0, 0], [0, 0]])], 1)
    assert ChunkedGraph(twice[0], twice[1], 60, perm, ptr).repeated_loops
