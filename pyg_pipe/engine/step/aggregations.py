"""PyG aggregations whose output depends on the whole graph's size, given the whole graph's on a chunk.

Some of PyG's aggregations (``LSTMAggregation``, ``GRUAggregation``, ``LCMAggregation``,
``PatchTransformerAggregation``; ``SAGEConv(aggr="lstm")``) call :meth:`Aggregation.to_dense_batch`, which puts
every destination's messages in a ``[vertices, D, d]`` batch, zeros after its own, with ``D`` the largest
in-degree among the destinations, and then run over all ``D`` positions. A vertex's output so depends on ``D``:
on the largest in-degree of the whole graph, even of another component (measured: 0.4 apart in PyG on one device).
A chunk holds the in-degrees of its own rows only, so its ``D`` is smaller and its rows would silently differ
from one device's. Under the engine each such call inside a layer pads to the largest in-degree of the whole
graph the layer propagates over (counted once per chunked graph, in the direction of the layer's flow), so a
chunk's rows equal one device's. Aggregations that mask the padding (``SetTransformerAggregation``) or pad to a
fixed size (``MLPAggregation``, ``SortAggregation``) give the same results either way. A chunk's local ids,
renumbered, may leave the user's destination-sorted edges unsorted (a way of several chunks): they are sorted
again, stably, so every vertex's messages keep the user's order.

``QuantileAggregation`` and ``MedianAggregation`` read each destination's messages at its offset less one when it
has none, which PyG masks afterwards but which fails when the first destination has none (offset -1). On one
device that vertex is the whole graph's first; on a chunk it is the chunk's first, which may have no messages where
the whole graph's first has some. Under the engine they run over the destinations that have messages and give
the others the fill value, as PyG does.

``EquilibriumAggregation`` runs gradient steps on its outputs whose regulariser is a mean over every destination
vertex: each step is divided by the graph's vertex count, which on a chunk is the whole graph's.

A graph the layer builds itself (self loops it adds) has in-degrees the chunking does not hold: a padded call over
it is refused by name, on every rank after the checked pass (it is structural: the same for every chunk).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch_geometric.nn import MessagePassing
from torch_geometric.nn.aggr import Aggregation, EquilibriumAggregation, QuantileAggregation

from ...model.errors import UnsupportedModelError
from ..context import current
from ..reroute import Rerouted

ATTRS = ("to_dense_batch", "reg", "forward")  # the instance attributes install sets (popped at uninstall)


def install(name: str, layer: MessagePassing) -> List[Aggregation]:
    """Patches every aggregation inside ``layer`` (an instance attribute, popped by the caller; a deep copy of the
    model taken meanwhile gets PyG's own); returns them."""
    patched = []
    for aggr in layer.modules():
        if isinstance(aggr, Aggregation):
            aggr.to_dense_batch = Rerouted(aggr, _padded(name, layer, aggr), type(aggr).to_dense_batch)
            patched.append(aggr)
        if isinstance(aggr, EquilibriumAggregation):
            aggr.reg = Rerouted(aggr, _regulariser(aggr), type(aggr).reg)
        if isinstance(aggr, QuantileAggregation):
            aggr.forward = Rerouted(aggr, _over_present(aggr), type(aggr).forward)
    return patched


def _over_present(aggr: QuantileAggregation):
    """The quantiles over the destinations that have messages (renumbered in order, so the first has some); the
    others get ``fill_value``. Equal to PyG's forward wherever PyG's runs."""
    own = type(aggr).forward.__get__(aggr, type(aggr))

    def forward(x, index=None, ptr=None, dim_size=None, dim=-2):
        if current() is None or index is None:
            return own(x, index, ptr, dim_size, dim)
        dim = x.dim() + dim if dim < 0 else dim
        count = torch.bincount(index, minlength=dim_size or 0)
        present = count > 0
        compact = torch.cumsum(present, 0) - 1
        out = own(x, compact[index], None, None, dim)  # rows: the destinations with messages, in order
        shape = list(out.shape)
        shape[dim] = count.numel()
        full = out.new_full(shape, aggr.fill_value)
        where = present.nonzero().view(-1)
        return full.index_copy(dim, where, out) if where.numel() else full
    return forward


def _regulariser(aggr: EquilibriumAggregation):
    """``EquilibriumAggregation``'s regulariser ``softplus(lamb) * mean_i |y_i|^2`` averages over every destination
    vertex: each vertex's inner gradient steps are divided by the graph's vertex count. On a chunk, by the whole
    graph's, so that its rows take the steps they take on one device."""
    own = type(aggr).reg.__get__(aggr, type(aggr))

    def reg(y):
        ctx = current()
        if ctx is None or not ctx.stack or ctx.stack[-1].edge_graph is None:
            return own(y)
        cg = ctx.stack[-1].chunking(ctx.stack[-1].edge_graph)[0]
        return aggr.softplus(aggr.lamb) * y.square().sum(dim=-1).sum() / cg.num_nodes
    return reg


def _padded(name: str, layer: MessagePassing, aggr: Aggregation):
    own = type(aggr).to_dense_batch.__get__(aggr, type(aggr))

    def to_dense_batch(x, index=None, ptr=None, dim_size=None, dim=-2, fill_value=0.0, max_num_elements=None):
        ctx = current()
        if ctx is not None and ctx.stack and index is not None:
            largest, ordered = _graph(ctx, name, layer, aggr)
            if max_num_elements is None:
                max_num_elements = largest
            if ordered and index.numel() > 1 and not bool((index[:-1] <= index[1:]).all()):  # (PyG syncs too)
                order = torch.argsort(index, stable=True)  # each vertex's messages keep the user's edge order
                x, index = x.index_select(dim, order), index[order]
        return own(x, index, ptr, dim_size, dim, fill_value, max_num_elements)
    return to_dense_batch


def _graph(ctx, name: str, layer: MessagePassing, aggr: Aggregation) -> Tuple[Optional[int], bool]:
    """For the graph the running propagate was handed: the whole graph's largest in-degree (out-degree for
    ``flow="target_to_source"``), and whether the user's edges are sorted by destination (as these aggregations
    need: a chunk's local ids, renumbered, may not be; its edges are then sorted again, stably). With a refusal when
    the layer built that graph itself."""
    inv = ctx.stack[-1]
    graph = inv.edge_graph
    cg = inv.chunking(graph)[0] if graph is not None else None
    if cg is not None and cg.num_chunks == 1:  # the whole graph: PyG's own padding is the whole graph's
        return None, False
    if graph is None or not inv.handed(graph):
        message = (f"Layer '{name}' ({type(layer).__name__}) aggregates with {type(aggr).__name__}, which pads every "
                   f"vertex's messages to the largest in-degree of the whole graph, over a graph the layer built "
                   f"itself (self loops added, edges filtered), whose in-degrees pyg_pipe does not hold when the "
                   f"graph is cut. Build that graph before the model and pass it in, use another aggregation, or "
                   f"train with one chunk and no graph-parallel ways (strategy='gnnpipe', num_chunks=1).")
        if ctx.observer is None:
            raise UnsupportedModelError(message)
        ctx.observer.refuse(message)
        return None, True  # (sorted, so that the checked pass runs to its end on every rank, which then raise)
    hit = getattr(cg, "_padding", None)
    if hit is None:  # once per chunked graph (host syncs); a layer with flow="target_to_source" runs on the
        #              transposed graph's chunking (.layers), so its vertices aggregate at destinations there too
        largest = int(torch.bincount(cg.new_dst, minlength=cg.num_nodes).max()) if cg.new_dst.numel() else 0
        old = cg.perm[cg.new_dst]
        hit = cg._padding = (max(largest, 1), bool((old[:-1] <= old[1:]).all()))
    return hit
