"""DropEdge and DropNode in a model's forward: one draw a step over the whole graph, the same everywhere.

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

PyG's ``dropout_node(edge_index, p, num_nodes, training, relabel_nodes=False)`` (DropNode) keeps each vertex with
probability ``1 - p`` and the edges between kept vertices. On a chunk it is :func:`dropout_node`, one draw over the
whole graph's vertices the same way (``graph.chunks.node_keep``, a stream of its own), whose kept edges are a derived
chunking as DropEdge's (``("drop nodes", m, k, p)``); it returns them, the mask of the chunk's kept local edges,
and the mask of the chunk's kept rows (the vertices the forward's tensors hold on a chunk). ``relabel_nodes=True``
(a graph of fewer vertices) runs PyG's function, and the layer given that graph refuses it by name.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ...model.trace import AUTOWRAP
from ..context import current

_SWAPPED: List[Tuple[Dict[str, Any], str, str]] = []   # (namespace, name, which) bound to ours by :func:`install`


_ORIGINAL: Dict[str, Any] = {}   # PyG's functions, by name


def dropout_edge(edge_index: Tensor, p: float = 0.5, force_undirected: bool = False,
                 training: bool = True) -> Tuple[Tensor, Tensor]:
    """PyG's ``dropout_edge``; on a chunk under the engine, the chunk's part of one draw over the whole graph."""
    ctx = current()
    if ctx is None or not training or p == 0.0 or force_undirected or not isinstance(edge_index, Tensor) \
            or edge_index.layout != torch.strided:
        return _ORIGINAL["dropout_edge"](edge_index, p, force_undirected, training)
    if p < 0.0 or p > 1.0:
        raise ValueError(f"Dropout probability has to be between 0 and 1 (got {p})")
    hit = ctx.graphs.resolve(edge_index)
    if hit is None:  # a graph computed in forward: the layer given it says so
        return _ORIGINAL["dropout_edge"](edge_index, p, force_undirected, training)
    cg, lg, _ = hit
    k, ctx.drops = ctx.drops, ctx.drops + 1
    with ctx.engine_work():  # (a model called twice in a step, contrastive views, draws twice: the call is in the key)
        dropped = ctx.graphs.derived(cg, ("drop", ctx.graphs.localizer.call, k, float(p)))
        local = dropped.chunks[lg.index]
        ctx.graphs.add(local.edge_index, dropped, local)
        return local.edge_index, dropped.local_keep[lg.index]


def dropout_node(edge_index: Tensor, p: float = 0.5, num_nodes: Optional[int] = None, training: bool = True,
                 relabel_nodes: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """PyG's ``dropout_node``; on a chunk under the engine, the chunk's part of one draw over the whole graph."""
    ctx = current()
    hit = None if ctx is None or relabel_nodes or not isinstance(edge_index, Tensor) \
        or edge_index.layout != torch.strided else ctx.graphs.resolve(edge_index)
    if hit is None:  # (a graph computed in forward: the layer given it says so)
        return _ORIGINAL["dropout_node"](edge_index, p, num_nodes, training, relabel_nodes)
    if p < 0.0 or p > 1.0:
        raise ValueError(f"Dropout probability has to be between 0 and 1 (got {p})")
    cg, lg, _ = hit
    if not training or p == 0.0:  # everything kept; the vertex mask over the chunk's rows, as below
        return (edge_index, edge_index.new_ones(edge_index.size(1), dtype=torch.bool),
                edge_index.new_ones(lg.rows, dtype=torch.bool))
    k, ctx.drops = ctx.drops, ctx.drops + 1
    with ctx.engine_work():
        dropped = ctx.graphs.derived(cg, ("drop nodes", ctx.graphs.localizer.call, k, float(p)))
        local = dropped.chunks[lg.index]
        ctx.graphs.add(local.edge_index, dropped, local)
        rows = dropped.node_keep[cg.perm[lg.start:lg.end]]
        return local.edge_index, dropped.local_keep[lg.index], rows


for _fn in (dropout_edge, dropout_node):  # (not random to the stage split: each stage computes its draws itself,
    #                                         the same edges: model.trace.Program.recomputable)
    _fn.__name__ = _fn.__qualname__ = f"chunk_{_fn.__name__}"
    _fn.numbered = True  # (a traced stage numbers its calls in the whole forward's order: runtime.program)


_OURS = {"dropout_edge": dropout_edge, "dropout_node": dropout_node}


def install(module: torch.nn.Module) -> None:
    """Binds ``dropout_edge`` / ``dropout_node`` to :func:`dropout_edge` / :func:`dropout_node` in
    ``torch_geometric.utils`` and in the namespaces of the code of ``module``'s classes (where ``from
    torch_geometric.utils import dropout_edge`` put PyG's)."""
    import torch_geometric.utils as utils
    from torch_geometric.utils import dropout as module_of_pyg
    for name in _OURS:
        _ORIGINAL.setdefault(name, module_of_pyg.__dict__[name])
    pyg = {id(fn): name for name, fn in _ORIGINAL.items()}
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
            which = pyg.get(id(value))
            if which is not None and value is _ORIGINAL[which]:
                space[name] = _OURS[which]
                _SWAPPED.append((space, name, which))


def uninstall() -> None:
    """Puts PyG's functions back where :func:`install` bound them."""
    while _SWAPPED:
        space, name, which = _SWAPPED.pop()
        if space.get(name) is _OURS[which]:
            space[name] = _ORIGINAL[which]


AUTOWRAP.extend(_OURS.values())  # (fx records the call, not the draw inside it)
