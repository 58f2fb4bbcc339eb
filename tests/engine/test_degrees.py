"""Degrees on a chunk: PyG's ``gcn_norm`` and ``get_laplacian`` computed on a chunk's local graph give the
whole graph's values on every edge into the chunk's rows (halo vertices' in-degrees and every vertex's
out-degree completed from the whole graph), and are PyG's own outside the engine.
"""
import pytest
import torch
from torch_geometric.nn.conv.gcn_conv import gcn_norm as pyg_gcn_norm
from torch_geometric.utils import get_laplacian as pyg_get_laplacian

from pyg_pipe.engine.step import degrees
from pyg_pipe.engine.context import ChunkContext, Invocation
from pyg_pipe.graph import ChunkedGraph
from tests.harness import ranges
from tests.zoo import zoo_graph


def _by_edge(edge_index, weight, ids=None):
    """``{(source, destination): weight}`` in user vertex ids."""
    src, dst = edge_index if ids is None else (ids[edge_index[0]], ids[edge_index[1]])
    return {(int(s), int(d)): float(w) for s, d, w in zip(src, dst, weight)}


@pytest.fixture
def chunk():
    torch.set_default_dtype(torch.float64)
    x, g, _, _ = zoo_graph()
    ei, w = g["edge_index"], g["edge_weight"]
    perm, ptr = ranges(ei, x.size(0), 4)
    cg = ChunkedGraph(ei[0], ei[1], x.size(0), perm, ptr)
    lg = cg.chunks[2]                                    # a chunk with a halo
    assert lg.halo.numel() > 0
    ctx = ChunkContext(cg, lg, None, None, None, {})
    local_w = cg.local_edges(lg, w)
    ctx.add_edge_input(local_w, w)
    ctx.stack.append(Invocation("conv", 0, cg, lg, True, graphs={id(lg.edge_index): (lg.edge_index, cg, lg, True)}))
    yield ei, w, cg, lg, ctx, local_w
    torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("improved", [False, True])
def test_gcn_norm_on_a_chunk_equals_the_whole_graph(chunk, weighted, improved):
    ei, w, cg, lg, ctx, local_w = chunk
    with ctx:
        out_ei, out_w = degrees.gcn_norm(lg.edge_index, local_w if weighted else None, lg.num_local, improved)
    whole = _by_edge(*pyg_gcn_norm(ei, w if weighted else None, cg.num_nodes, improved))
    local = _by_edge(out_ei, out_w, cg.perm[lg.nodes])
    into_rows = {k: v for (k, v), d in zip(local.items(), out_ei[1]) if d < lg.rows}
    assert into_rows and all(abs(v - whole[k]) < 1e-12 for k, v in into_rows.items())


@pytest.mark.parametrize("normalization", [None, "sym", "rw"])
def test_the_laplacian_uses_the_whole_graphs_out_degrees(chunk, normalization):
    ei, w, cg, lg, ctx, local_w = chunk
    with ctx:
        out_ei, out_w = degrees.get_laplacian(lg.edge_index, local_w, normalization, num_nodes=lg.num_local)
    whole = _by_edge(*pyg_get_laplacian(ei, w, normalization, num_nodes=cg.num_nodes))
    local = _by_edge(out_ei, out_w, cg.perm[lg.nodes])
    into_rows = {k: v for (k, v), d in zip(local.items(), out_ei[1]) if d < lg.rows}
    assert into_rows and all(abs(v - whole[k]) < 1e-12 for k, v in into_rows.items())


def test_outside_the_engine_they_are_pygs_own():
    x, g, _, _ = zoo_graph()
    ei, w = g["edge_index"], g["edge_weight"]
    for a, b in zip(degrees.gcn_norm(ei, w, x.size(0)), pyg_gcn_norm(ei, w, x.size(0))):
        assert torch.equal(a, b)
    for a, b in zip(degrees.get_laplacian(ei, w, "sym", num_nodes=x.size(0)),
                    pyg_get_laplacian(ei, w, "sym", num_nodes=x.size(0))):
        assert torch.equal(a, b)
