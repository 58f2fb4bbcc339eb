"""Which local graph a layer's graph argument is, for one chunk (:class:`GraphResolver`): the graphs handed out
with the inputs, the whole input graphs themselves, copies sharing their storage and transposes."""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch
from torch import Tensor

from ..graph.chunks import ChunkedGraph, LocalGraph


class GraphResolver:
    """Tells which local graph a layer's graph argument is, for one chunk.

    Known: the local graphs handed out with the inputs, the whole input graphs themselves (a layer
    given ``data.edge_index`` directly), and transposes of the local edge lists (``flip(0)``), which
    map to the chunking of the transposed whole graph (``derived(cg, "flip")``).
    """

    def __init__(self, localizer: Any, c: int, derived: Callable[[ChunkedGraph, str], ChunkedGraph]):
        self.localizer, self.c, self.derived = localizer, c, derived
        self.known: Dict[int, Tuple[Any, ChunkedGraph, LocalGraph, Any]] = {}
        primary = localizer.cg.chunks[c]
        for graph, cg in zip(localizer.inputs.graphs, localizer.chunked):
            lg = cg.chunks[c]
            local = localizer.local_graph(graph, primary)
            self.known[id(local)] = (local, cg, lg, local)
            self.known[id(graph)] = (graph, cg, lg, local)

    def add(self, value: Tensor, cg: ChunkedGraph, lg: LocalGraph) -> None:
        """``value`` is chunk ``lg``'s local ``edge_index`` in chunking ``cg`` (a graph the engine derived in the
        forward: DropEdge's)."""
        self.known[id(value)] = (value, cg, lg, value)

    def row_graph(self, cg: ChunkedGraph, lg: LocalGraph, local):
        """The row graph of the local graph ``local`` (:mod:`pyg_pipe.graph.chunks`): the edges into the
        chunk's rows, for a layer that computes those rows only."""
        if local.layout == torch.strided:
            return lg.row_edge_index
        return self.localizer.row_adjacency(cg, lg, local)

    def resolve(self, value):
        """``(cg, lg, local graph)`` for a layer's graph argument, or ``None`` (a graph computed in forward).

        A graph is recognised by what it is, not by the Python object: besides the tensors handed out,
        a copy sharing their storage (what a reversible block or a recomputation hands the layer, dense
        or sparse) and a transpose of a local ``edge_index`` are understood."""
        hit = self.known.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1], hit[2], hit[3]
        if not isinstance(value, Tensor):
            return None
        for obj, cg, lg, local in list(self.known.values()):
            if _same_storage(obj, value):
                self.known[id(value)] = (value, cg, lg, local)
                return cg, lg, local
        if value.layout == torch.strided:  # (not of DropEdge's graphs: new edges every step)
            for obj, cg, lg, local in list(self.known.values()):
                if obj is local and local.layout == torch.strided and local.shape == value.shape \
                        and getattr(cg, "_base", None) is None and torch.equal(local.flip(0), value):
                    tcg = self.derived(cg, "flip")
                    tlg = tcg.chunks[self.c]
                    self.known[id(value)] = (value, tcg, tlg, tlg.edge_index)
                    return tcg, tlg, tlg.edge_index
        return None


def _same_storage(a: Tensor, b: Tensor) -> bool:
    """Whether ``b`` is ``a`` under another Python object (a detached copy): same layout, shape and the
    same index storage (for sparse tensors), or the same data (dense)."""
    if a.layout != b.layout or a.shape != b.shape:
        return False
    if a.layout == torch.strided:
        return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
    if a.layout == torch.sparse_csr:
        return a.crow_indices().data_ptr() == b.crow_indices().data_ptr() and \
            a.col_indices().data_ptr() == b.col_indices().data_ptr()
    if a.layout == torch.sparse_coo:
        return a._indices().data_ptr() == b._indices().data_ptr()
    return False
