"""A call's inputs cut down to one chunk (:class:`Localizer`): graphs to the chunk's local graph, node
inputs to its rows (clean: their halo rows come from the whole input), edge inputs to its local edges,
``Data`` attribute by attribute (what each argument is: :mod:`.inputs`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..graph.chunks import ChunkedGraph, LocalGraph
from .errors import UnsupportedModelError
from .inputs import EDGE_NAMES, CallInputs, call_tensors, graph_edges, is_graph_tensor, same_graph
from .resolve import GraphResolver


class Localizer:
    """Cuts :class:`CallInputs` down to one chunk of a chunking.

    Args:
        inputs: the call's arguments.
        chunked: the :class:`ChunkedGraph` of every graph in ``inputs.graphs`` (same order).
        tables: the model's tensors with a row per vertex, ``(module, attribute)`` (:func:`~.find.vertex_tables`:
            embedding tables, per-vertex parameters and buffers): a chunk sees its rows as the attribute, clean
            inputs like the features (their halo rows the true ones), and a parameter's gradient reaches its rows
            through them.
        keep: keep each chunk's rows of the node inputs in ``cache`` across calls (one more copy of the inputs,
            and of their halo rows once joined; the runtime decides from the free memory).
    """

    def __init__(self, inputs: CallInputs, chunked: List[ChunkedGraph], cache: Optional[Dict] = None,
                 tables: Sequence[Tuple[torch.nn.Module, str]] = (), keep: bool = False):
        self.inputs = inputs
        self.call = 0  # which call of the model in its training step (set by the engine; DropEdge draws per call)
        self.tables = tables
        self.keep = keep
        self.chunked = chunked
        self.cg = chunked[0]
        self._adjacency: Dict = {} if cache is None else cache  # local sparse adjacencies, kept across calls
        # a chunk's rows of each node input, kept across calls while the input is the same, unchanged tensor
        # (full-graph training hands the same features every step): cut once, not once per chunk and layer group
        self._kept: Dict[tuple, tuple] = self._adjacency.setdefault("node rows", {})
        self._same: Dict[tuple, bool] = {}  # (id of a graph cut before, id of this call's): the same graph
        live = {id(t) for t in call_tensors(inputs)}
        for key in [k for k, hit in self._kept.items() if id(hit[0]) not in live]:
            del self._kept[key]

    def localize(self, c: int, ctx) -> Tuple[tuple, dict]:
        """``(args, kwargs)`` for chunk ``c``; registers clean node inputs, edge inputs and local graphs in ``ctx``."""
        lg = self.cg.chunks[c]
        memo: Dict[int, Any] = {}
        args = tuple(self._cut(v, lg, ctx, memo) for v in self.inputs.args)
        kwargs = {k: self._cut(v, lg, ctx, memo, name=k) for k, v in self.inputs.kwargs.items()}
        for owner, attr in self.tables:
            whole, every = getattr(owner, attr), _every_row(self.cg, lg)
            # (every row in order: an alias, so what the forward writes there reaches the model; an alias, not the
            # tensor itself, which an embedding's lookup by id still reads as the whole table)
            rows = whole.view_as(whole) if every else whole.index_select(0, _rows_index(self.cg, lg))
            ctx.add_clean(rows, _extender(whole))
            ctx.swap_table(owner, attr, rows, whole, copied=not every)
        return args, kwargs

    def _cut(self, value, lg: LocalGraph, ctx, memo: Dict[int, Any], name: str = "", kind: Optional[str] = None):
        from torch_geometric.data import Data
        if id(value) in memo:
            return memo[id(value)]
        out = value
        if is_graph_tensor(value):
            if isinstance(value, Tensor) and value.layout != torch.strided:
                _, _, out, values = self._local_adjacency(value, lg)
                # its values are an edge input (degrees from the whole graph)
                ctx.add_edge_input(out, values, self.chunked[self._graph_index(value)])
            else:
                out = self.local_graph(value, lg)
        elif isinstance(value, Data):
            out = type(value)()
            for key, v in value.items():
                k = "node" if value.is_node_attr(key) else "edge" if value.is_edge_attr(key) else "other"
                out[key] = self._cut(v, lg, ctx, memo, name=key, kind=k)
            if "num_nodes" in value._store:
                out.num_nodes = lg.rows
        elif isinstance(value, (tuple, list)):
            out = type(value)(self._cut(v, lg, ctx, memo) for v in value)
        elif isinstance(value, Tensor) and value.dim() > 0 and value.layout == torch.strided:
            kind = kind or self._kind(value, name)
            if kind == "node":
                out = self._rows(value, lg)
                ctx.add_clean(out, _extender(value))
            elif kind == "edge" and value.size(0) in self.inputs.edge_counts:
                cg = self._edge_chunking(value)
                out = cg.local_edges(cg.chunks[lg.index], value)
                ctx.add_edge_input(out, value, cg)
        memo[id(value)] = out
        return out

    def _rows(self, value: Tensor, lg: LocalGraph) -> Tensor:
        """The chunk's rows of the node input ``value`` (kept while neither it nor they change)."""
        if not self.keep or value.requires_grad:
            return value.index_select(0, _rows_index(self.cg, lg))
        key = (id(value), id(self.cg), lg.index)
        hit = self._kept.get(key)
        if hit is not None and hit[0] is value and hit[1] == value._version and hit[2]._version == hit[3]:
            return hit[2]
        out = value.index_select(0, _rows_index(self.cg, lg))
        self._kept[key] = (value, value._version, out, out._version)
        return out

    def _edge_chunking(self, value: Tensor) -> ChunkedGraph:
        """The chunked graph an edge tensor is cut with: the first input graph with as many edges."""
        return self.chunked[self.inputs.edge_counts.index(value.size(0))]

    def _graph_index(self, graph: Tensor) -> int:
        return next(i for i, g in enumerate(self.inputs.graphs) if g is graph)

    def _kind(self, value: Tensor, name: str) -> str:
        n, N = value.size(0), self.inputs.num_nodes
        if n in self.inputs.edge_counts and (n != N or name in EDGE_NAMES or name.startswith("edge_")):
            return "edge"
        if n == N:
            return "node"
        if N in value.shape[1:]:
            raise UnsupportedModelError(
                f"Argument '{name or 'of the model'}' has shape {tuple(value.shape)}: one row per vertex along "
                f"dimension {list(value.shape).index(N)}, not 0. pyg_pipe cuts inputs into chunks along "
                f"dimension 0; pass per-vertex inputs with vertices first (e.g. x.transpose(0, 1)).")
        return "other"

    def local_graph(self, graph: Tensor, lg_primary: LocalGraph):
        """The local form of one of the input graphs for the chunk of ``lg_primary``."""
        if graph.layout == torch.strided:
            return self.chunked[self._graph_index(graph)].chunks[lg_primary.index].edge_index
        return self._local_adjacency(graph, lg_primary)[2]

    def _local_adjacency(self, graph: Tensor, lg_primary: LocalGraph) -> tuple:
        """``(graph, version, local adj_t, values)`` of a sparse input graph for the chunk of
        ``lg_primary``: the values in its chunked graph's edge order (the local adjacency's are cut
        from them). Kept across calls, cut again when the values change."""
        cg = self.chunked[self._graph_index(graph)]
        lg = cg.chunks[lg_primary.index]
        key = (id(cg), lg.index)
        hit = self._adjacency.get(key)
        if hit is None or not self._serves(hit, graph):  # new values: cut again
            values = self._values(graph, cg)
            hit = (graph, graph._version, cg.local_adjacency(lg, values, graph.layout, values.dtype), values)
            self._adjacency[key] = hit
        return hit

    def row_adjacency(self, cg: ChunkedGraph, lg: LocalGraph, local: Tensor) -> Tensor:
        """The row graph (``[rows, num_local]``) of the local sparse adjacency ``local`` handed out for chunk
        ``lg`` of ``cg`` (the same object every time)."""
        hit = self._adjacency.get((id(cg), lg.index))
        if hit is None or hit[2] is not local:
            raise RuntimeError("pyg_pipe: a row graph was asked for an adjacency this chunk was not given "
                               "(internal error)")
        key = (id(cg), lg.index, "rows")
        rect = self._adjacency.get(key)
        if rect is None or rect[0] is not local:
            values = hit[3]
            if lg.num_local == lg.rows and lg.num_edges == lg.row_edges:  # no halo (one chunk a way, one way)
                rows = local
            elif local.layout == torch.sparse_csr:  # its first rows: views of the local graph's arrays, no copy
                rows = first_rows(local, lg.rows)
            else:
                rows = cg.local_adjacency(lg, values, local.layout, values.dtype, rows_only=True)
            rect = self._adjacency[key] = (local, rows)
        return rect[1]

    def _values(self, graph: Tensor, cg: ChunkedGraph) -> Tensor:
        """The values of a sparse input graph in its chunked graph's edge order, once per graph and version,
        shared by every chunk (a copy: a view would keep the whole coalesced index tensor alive)."""
        key = (id(cg), "values")
        hit = self._adjacency.get(key)
        if hit is None or not self._serves(hit, graph):
            _, _, values = graph_edges(graph)
            dtype = values.dtype if values.is_floating_point() else torch.get_default_dtype()
            hit = self._adjacency[key] = (graph, graph._version, values.to(dtype, copy=True))
        return hit[2]

    def _serves(self, hit: tuple, graph: Tensor) -> bool:
        """Whether a cut kept from ``hit[0]`` at version ``hit[1]`` serves ``graph``: the same tensor unchanged,
        or an unchanged one with the same edges and values (compared once per call; its cut is then kept for
        ``graph``, so a new tensor of the same graph each step is not cut again each step)."""
        if hit[0] is graph:
            return hit[1] == graph._version
        if hit[1] != hit[0]._version:
            return False
        key = (id(hit[0]), id(graph))
        same = self._same.get(key)
        if same is None:
            same = self._same[key] = same_graph(hit[0], graph)
        return same

    def resolver(self, c: int, derived: Callable[[ChunkedGraph, str], ChunkedGraph]):
        """The graph resolver for chunk ``c`` (see :class:`~.resolve.GraphResolver`)."""
        return GraphResolver(self, c, derived)


def _rows_index(cg: ChunkedGraph, lg: LocalGraph) -> Tensor:
    idx = getattr(lg, "_rows_index", None)
    if idx is None:
        idx = lg._rows_index = cg.perm[lg.start:lg.end]
    return idx


def _every_row(cg: ChunkedGraph, lg: LocalGraph) -> bool:
    """Whether the chunk is every vertex in the graph's own order (one chunk, the identity order): a tensor with a row
    per vertex is then its own rows (decided once per chunk)."""
    hit = getattr(lg, "_every_row", None)
    if hit is None:
        idx = _rows_index(cg, lg)
        hit = lg._every_row = idx.numel() == cg.num_nodes and bool(torch.equal(idx.cpu(), torch.arange(idx.numel())))
    return hit


def _extender(whole: Tensor):
    """The rows of input ``whole`` beyond a chunk, for any chunked graph of the same chunking."""
    def extend(cg: ChunkedGraph, lg: LocalGraph) -> Tensor:
        idx = getattr(lg, "_halo_index", None)
        if idx is None:
            idx = lg._halo_index = cg.perm[lg.halo]
        return whole.index_select(0, idx)
    return extend


def first_rows(adj: Tensor, rows: int) -> Tensor:
    """The first ``rows`` rows of the CSR adjacency ``adj``, as a ``[rows, n]`` CSR tensor of views of its arrays.
    A chunk's local edges list the edges into its rows first, so this is its row graph, entry for entry."""
    crow = adj.crow_indices()[:rows + 1]
    nnz = int(crow[-1])  # (once per chunk: the caller keeps it)
    return torch.sparse_csr_tensor(crow, adj.col_indices()[:nnz], adj.values()[:nnz], (rows, adj.size(1)))
