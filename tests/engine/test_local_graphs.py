"""Chunk-local graphs: halos, degree completion, and GCN normalisation equal to the global one."""
import torch
from torch_geometric.nn import GCNConv

from pyg_pipe.engine import ChunkedGraph
from pyg_pipe.graph import make_chunks
from tests.models import small_graph


def test_chunks_cover_every_edge_once_and_halos_are_outside():
    x, edge_index, _, _ = small_graph()
    perm, ptr = make_chunks(edge_index, 60, 4, method="random")
    g = ChunkedGraph(edge_index[0], edge_index[1], None, 60, perm, ptr)
    ids = torch.cat([c.edge_ids for c in g.chunks])
    assert torch.equal(torch.sort(ids).values, torch.arange(edge_index.size(1)))  # no self loops in this graph
    for c in g.chunks:
        assert ((c.halo < c.start) | (c.halo >= c.end)).all()
        assert (c.dst < c.rows).all()


def test_gcn_on_a_chunk_equals_the_full_graph_rows():
    """Degree completion: a GCN layer on each chunk's local graph reproduces the full-graph rows,
    with and without edge weights and with self loops in the graph."""
    x, edge_index, _, _ = small_graph()
    loops = torch.arange(0, 60, 7)
    edge_index = torch.cat([edge_index, torch.stack([loops, loops])], 1)
    weight = torch.rand(edge_index.size(1), generator=torch.Generator().manual_seed(0)) + 0.5
    conv = GCNConv(8, 5)
    for w in (None, weight):
        full = conv(x, edge_index, w)
        perm, ptr = make_chunks(edge_index, 60, 5, method="random", seed=3)
        g = ChunkedGraph(edge_index[0], edge_index[1], w, 60, perm, ptr)
        x_new = x[perm]
        for c in g.chunks:
            local, lw = g.local_graph(c, True, w, torch.float32)
            nodes = torch.cat([torch.arange(c.start, c.end), c.halo])
            xl = x_new[nodes]
            if c.has_dummy:
                xl = torch.cat([xl, xl.new_zeros(1, 8)])
            out = conv(xl, local, lw)[:c.rows]
            torch.testing.assert_close(out, full[perm[c.start:c.end]], atol=1e-5, rtol=0)
