"""DropEdge in a model's forward: one draw a step over the whole graph's edges, the same everywhere.

PyG's ``dropout_edge(edge_index, p, training=...)`` keeps each edge it is given with probability ``1 - p``. Under the
engine a forward runs on a chunk's local graph (its rows' in-edges and its halo), on several ranks, stage by stage,
and again when a chunk is replayed, so a draw on the local edges would leave each chunk, stage and replay a graph
of its own: a halo vertex's degree would not be the one its owner saw, and a later stage could not know the edges.
While the engine is installed, ``dropout_edge`` (the name in the model's modules, and in ``torch_geometric.utils``)
is :func:`dropout_edge` below, which on a chunk keeps the local edges by one draw over the whole graph::

    keep = rand(E, generator seeded by (seed, step, m, k)) >= p   m: the model's call in the step; k: the forward's
                                                                 k-th DropEdge call
    chunk c keeps its local edges e with keep[edge_ids[e]]       (graph.chunks.edge_keep, ChunkedGraph.keep_edges)

so every rank, chunk, stage and replay of a step keeps the same edges without communicating, and a layer's
normalisation completes its halo degrees from the kept whole graph (:mod:`.degrees`). The edges it returns are a
chunking derived from the input's (``Runtime.derive(cg, ("drop", m, k, p))``), with the input's halos; the mask it
returns marks the chunk's kept local edges (for the user's own per-edge tensors, as PyG's does). The draw is not
PyG's (``torch.rand`` on the given edges): the same model on one device keeps other edges, each with the same
probability. Outside a chunk, in eval mode, with ``p = 0`` or ``force_undirected=True``, PyG's function runs.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

from ...model.trace import AUTOWRAP
from ..context import current

_SWAPPED: List[Tuple[Dict[str, Any], str]] = []   # (namespace, name) bound to :func:`dropout_edge` by :func:`install`


_ORIGINAL: List[Any] = []


def dropout_edge(edge_index: Tensor, p: float = 0.5, force_undirected: bool = False,
                 training: bool = True) -> Tuple[Tensor, Tensor]:
    """PyG's ``dropout_edge``; on a chunk under the engine, the chunk's part of one draw over the whole graph."""
    ctx = current()
    if ctx is None or not training or p == 0.0 or force_undirected or not isinstance(edge_index, Tensor) \
            or edge_index.layout != torch.strided:
        return _ORIGINAL[0](edge_index, p, force_undirected, training)
    if p < 0.0 or p > 1.0:
        raise ValueError(f"Dropout probability has to be between 0 and 1 (got {p})")
    hit = ctx.graphs.resolve(edge_index)
    if hit is None:  # a graph computed in forward: the layer given it says so
        return _ORIGINAL[0](edge_index, p, force_undirected, training)
    cg, lg, _ = hit
    k, ctx.drops = ctx.drops, ctx.drops + 1
    with ctx.engine_work():  # (a model called twice in a step, contrastive views, draws twice: the call is in the key)
        dropped = ctx.graphs.derived(cg, ("drop", ctx.graphs.localizer.call, k, float(p)))
        local = dropped.chunks[lg.index]
        ctx.graphs.add(local.edge_index, dropped, local)
        return local.edge_index, dropped.local_keep[lg.index]


dropout_edge.__name__ = dropout_edge.__qualname__ = "chunk_dropout_edge"  # (not random to the stage split: each
# stage computes it itself, the same edges: model.trace.Program.recomputable)
dropout_edge.numbered = True  # (a traced stage numbers its calls in the whole forward's order: runtime.program)


def install(module: torch.nn.Module) -> None:
    """Binds ``dropout_edge`` to :func:`dropout_edge` in ``torch_geometric.utils`` and in the namespaces of the code of
    ``module``'s classes (where ``from torch_geometric.utils import dropout_edge`` put PyG's)."""
    import torch_geometric.utils as utils
    from torch_geometric.utils import dropout as module_of_pyg
    if not _ORIGINAL:
        _ORIGINAL.append(module_of_pyg.__dict__["dropout_edge"])
    pyg = _ORIGINAL[0]
    spaces = [utils.__dict__, module_of_pyg.__dict__]
    for m in module.modules():
        fn = getattr(type(m).forward, "__globals__", None)
        if fn is not None:
            spaces.append(fn)
    inst = module.__dict__.get("forward")
    if inst is not None and hasattr(getattr(inst, "__func__", None), "__globals__"):
        spaces.append(inst.__func__.__globals__)
    for space in {id(s): s for s in spaces}.values():
        for name, value in list(space.items()):
            if value is pyg:
                space[name] = dropout_edge
                _SWAPPED.append((space, name))


def uninstall() -> None:
    """Puts PyG's ``dropout_edge`` back where :func:`install` bound it."""
    while _SWAPPED:
        space, name = _SWAPPED.pop()
        if space.get(name) is dropout_edge:
            space[name] = _ORIGINAL[0]


AUTOWRAP.append(dropout_edge)  # (fx records the call, not the draw inside it)
