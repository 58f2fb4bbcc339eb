"""The arguments of a call of the user's model, and how each is cut down to one chunk.

The engine replaces ``model(...)`` while it trains; every call's arguments are classified once:

========== ========================================================================================
graph      ``edge_index`` (a ``[2, E]`` integer tensor) or a sparse ``adj_t`` -> the chunk's local graph
node       one row per vertex (``x``, ``y``, masks, ...)           -> the chunk's rows
edge       one row per edge (``edge_weight``, ``edge_attr``, ...)  -> the chunk's local edges
other      anything else (``None``, numbers, other tensors)       -> unchanged
========== ========================================================================================

A ``Data`` argument (``forward(self, data)``) is cut attribute by attribute, with PyG's own notion of
node and edge attributes. Node inputs handed to the model are *clean*: a layer that receives one
unchanged gets its true halo rows from the whole input, with no exchange (:mod:`pyg_pipe.engine.step.layers`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..graph.chunks import ChunkedGraph, LocalGraph
from .errors import UnsupportedModelError
from .resolve import GraphResolver

EDGE_NAMES = ("edge_weight", "edge_attr", "edge_type", "edge_label", "edge_mask")


def is_graph_tensor(value: Any) -> bool:
    """True for ``edge_index`` ([2, E] integer tensor) and sparse adjacency matrices."""
    if isinstance(value, Tensor):
        if value.layout != torch.strided:
            return True
        return value.dim() == 2 and value.size(0) == 2 and not value.is_floating_point() \
            and value.dtype != torch.bool
    return type(value).__name__ == "SparseTensor"


def graph_edges(graph: Tensor) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(src, dst, values)`` of an ``edge_index`` or of a sparse ``adj_t`` (rows are destinations)."""
    if type(graph).__name__ == "SparseTensor":
        raise UnsupportedModelError(
            "torch_sparse.SparseTensor adjacencies are not supported by pyg_pipe yet; pass edge_index or a "
            "torch.sparse CSR/COO adj_t (torch_geometric.transforms.ToSparseTensor(layout=torch.sparse_csr)).")
    if graph.layout == torch.strided:
        return graph[0], graph[1], None
    coo = graph.to_sparse_coo().coalesce()
    dst, src = coo.indices()
    return src, dst, coo.values()


def same_structure(a: Tensor, b: Tensor) -> bool:
    """Whether graph tensors ``a`` and ``b`` have the same edges (a sparse graph's values aside)."""
    if a is b:
        return True
    if a.layout != b.layout or a.shape != b.shape or a.device != b.device:
        return False
    if a.layout == torch.strided:
        return torch.equal(a, b)
    if a.layout == torch.sparse_csr:
        return torch.equal(a.crow_indices(), b.crow_indices()) and torch.equal(a.col_indices(), b.col_indices())
    return torch.equal(a.coalesce().indices(), b.coalesce().indices())


def same_graph(a: Tensor, b: Tensor) -> bool:
    """Whether graph tensors ``a`` and ``b`` hold the same edges with the same values (a new tensor of the same
    graph every step, as Lightning's move of the batch to the device gives)."""
    if a is b:
        return True
    if not (a.dtype == b.dtype and same_structure(a, b)):
        return False
    if a.layout == torch.strided:
        return True
    if a.layout == torch.sparse_csr:
        return torch.equal(a.values(), b.values())
    return torch.equal(a.coalesce().values(), b.coalesce().values())


def fingerprint(value: Tensor) -> tuple:
    """Tells a tensor's values apart from other values: shape, dtype, the count of non-finite values and
    two sums (plain and position-weighted), computed block by block in float64 (a few MB extra at most).
    Sparse tensors are taken by their indices and values."""
    v = value.detach()
    if v.layout == torch.sparse_coo:
        v = v.coalesce()
        parts = [v.indices().reshape(-1), v.values().reshape(-1)]
    elif v.layout == torch.sparse_csr:
        parts = [v.crow_indices(), v.col_indices(), v.values().reshape(-1)]
    else:
        parts = [v.reshape(-1)]
    bad, total, weighted, offset = 0, 0.0, 0.0, 0
    for part in parts:
        for start in range(0, part.numel(), 1 << 20):
            flat = part[start:start + (1 << 20)].double()
            if flat.is_floating_point():
                bad += int((~torch.isfinite(flat)).sum())
                flat = torch.nan_to_num(flat, nan=0.5, posinf=1.5, neginf=-1.5)
            pos = torch.arange(offset + 1, offset + flat.numel() + 1, dtype=torch.float64, device=flat.device) % 997
            total += float(flat.sum())
            weighted += float((flat * pos).sum())
            offset += flat.numel()
    # 12 significant digits: a sum's last bits may differ with the order a reduction runs in
    return (tuple(value.shape), str(value.dtype), bad, float(f"{total:.12g}"), float(f"{weighted:.12g}"))


class CallInputs:
    """One call's arguments, with the graph tensors and sizes found in them.

    Attributes:
        args, kwargs: as given.
        graphs: every graph tensor (top level or inside a ``Data``), in order; ``graphs[0]`` is the
            primary graph, which chunks the vertices.
        num_nodes, num_edges: |V| and the primary graph's |E|.
    """

    def __init__(self, args: tuple, kwargs: dict):
        self.args, self.kwargs = args, kwargs
        self.graphs: List[Tensor] = []
        self.data = []
        for value in list(args) + list(kwargs.values()):
            self._scan(value)
        if not self.graphs:
            raise UnsupportedModelError(self._no_graph())
        self.primary = self.graphs[0]
        self.num_nodes = self._num_nodes()
        #: every graph's edge count (an edge tensor is cut with the first graph of its length)
        self.edge_counts = [graph_edges(g)[0].numel() for g in self.graphs]
        self.num_edges = self.edge_counts[0]

    def _scan(self, value) -> None:
        from torch_geometric.data import Data
        if is_graph_tensor(value):
            if not any(value is g for g in self.graphs):
                self.graphs.append(value)
        elif isinstance(value, Data):
            self.data.append(value)
            for _, v in value.items():
                if is_graph_tensor(v):
                    self._scan(v)
        elif isinstance(value, (tuple, list)):
            for v in value:
                self._scan(v)

    def _no_graph(self) -> str:
        """Why no graph was found among the arguments: a malformed ``edge_index``, or none at all."""
        named = [(f"argument {i}", v) for i, v in enumerate(self.args)] + list(self.kwargs.items())
        for d in self.data:
            named += [(f"data.{k}", v) for k, v in d.items()]
        for name, v in named:
            if isinstance(v, Tensor) and v.dim() == 2 and v.size(0) == 2 and v.layout == torch.strided \
                    and (v.is_floating_point() or v.dtype == torch.bool or v.is_complex()):
                return (f"The pipelined model was given {name} of shape {tuple(v.shape)} and dtype {v.dtype}, which "
                        f"looks like an edge_index, but an edge_index must hold integer vertex ids (torch.long). "
                        f"Convert it with edge_index.long() (or build it as a LongTensor).")
        return ("The pipelined model was called without a graph (an edge_index [2, E] tensor or a sparse adj_t "
                "among its arguments, or a Data object holding one). pyg_pipe needs the graph to cut it into "
                "chunks: pass it to forward (forward(x, edge_index) or forward(data)), rather than reading a "
                "global variable inside forward.")

    def _num_nodes(self) -> int:
        if self.data:
            return int(self.data[0].num_nodes)
        g = self.primary
        if g.layout != torch.strided:
            return g.size(0)
        for v in list(self.args) + list(self.kwargs.values()):
            if isinstance(v, Tensor) and v.dim() > 0 and v.layout == torch.strided and not is_graph_tensor(v) \
                    and v.is_floating_point():
                return v.size(0)
        return int(g.max()) + 1 if g.numel() else 0

    def edge_tensors(self) -> List[Tensor]:
        """The call's per-edge inputs (edge weights, attributes, sparse adjacency values), in order."""
        out: List[Tensor] = []
        for v in list(self.args) + list(self.kwargs.values()):
            self._edge_tensors(v, out)
        return out

    def _edge_tensors(self, v, out: List[Tensor]) -> None:
        from torch_geometric.data import Data
        if isinstance(v, Tensor) and v.layout != torch.strided:
            out.append(graph_edges(v)[2])
        elif isinstance(v, Tensor) and v.dim() > 0 and not is_graph_tensor(v) and v.size(0) in self.edge_counts \
                and v.size(0) != self.num_nodes:
            out.append(v)
        elif isinstance(v, Data):
            for _, a in v.items():
                self._edge_tensors(a, out)
        elif isinstance(v, (tuple, list)):
            for a in v:
                self._edge_tensors(a, out)

    def requires_grad(self) -> Optional[str]:
        """The name of an input that requires grad (pyg_pipe does not back-propagate into inputs)."""
        for i, v in enumerate(self.args):
            if isinstance(v, Tensor) and v.requires_grad:
                return f"argument {i}"
        for k, v in self.kwargs.items():
            if isinstance(v, Tensor) and v.requires_grad:
                return k
        return None


class Localizer:
    """Cuts :class:`CallInputs` down to one chunk of a chunking.

    Args:
        inputs: the call's arguments.
        chunked: the :class:`ChunkedGraph` of every graph in ``inputs.graphs`` (same order).
        tables: the model's embedding tables with a row per vertex (:func:`~.find.vertex_tables`): a chunk sees its
            rows as the table's ``weight``, clean inputs like the features (their halo rows the true ones), and
            the gradient reaches the table's rows through them.
        keep: keep each chunk's rows of the node inputs in ``cache`` across calls (one more copy of the inputs,
            and of their halo rows once joined; the runtime decides from the free memory).
    """

    def __init__(self, inputs: CallInputs, chunked: List[ChunkedGraph], cache: Optional[Dict] = None,
                 tables: Sequence[torch.nn.Module] = (), keep: bool = False):
        self.inputs = inputs
        self.tables = tables
        self.keep = keep
        self.chunked = chunked
        self.cg = chunked[0]
        self._adjacency: Dict = {} if cache is None else cache  # local sparse adjacencies, kept across calls
        # a chunk's rows of each node input, kept across calls while the input is the same, unchanged tensor
        # (full-graph training hands the same features every step): cut once, not once per chunk and layer group
        self._kept: Dict[tuple, tuple] = self._adjacency.setdefault("node rows", {})
        self._same: Dict[tuple, bool] = {}  # (id of a graph cut before, id of this call's): the same graph
        live = {id(t) for t in _tensors(inputs)}
        for key in [k for k, hit in self._kept.items() if id(hit[0]) not in live]:
            del self._kept[key]

    def localize(self, c: int, ctx) -> Tuple[tuple, dict]:
        """``(args, kwargs)`` for chunk ``c``; registers clean node inputs, edge inputs and local graphs in ``ctx``."""
        lg = self.cg.chunks[c]
        memo: Dict[int, Any] = {}
        args = tuple(self._cut(v, lg, ctx, memo) for v in self.inputs.args)
        kwargs = {k: self._cut(v, lg, ctx, memo, name=k) for k, v in self.inputs.kwargs.items()}
        for table in self.tables:
            whole = table.weight
            rows = whole.index_select(0, _rows_index(self.cg, lg))
            ctx.add_clean(rows, _extender(whole))
            ctx.swap_table(table, rows, whole)
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
            rect = self._adjacency[key] = (local, cg.local_adjacency(lg, values, local.layout, values.dtype,
                                                                     rows_only=True))
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


def node_input_bytes(inputs: CallInputs) -> int:
    """The bytes of a call's tensors with a row per vertex (what keeping their chunk rows costs)."""
    return sum(t.numel() * t.element_size() for t in _tensors(inputs)
               if t.layout == torch.strided and t.dim() > 0 and t.size(0) == inputs.num_nodes)


def _tensors(inputs: CallInputs) -> List[Tensor]:
    """The tensors of a call, top level and in its ``Data`` objects."""
    values = list(inputs.args) + list(inputs.kwargs.values())
    for d in inputs.data:
        values += [v for _, v in d.items()]
    return [v for v in values if isinstance(v, Tensor)]


def _rows_index(cg: ChunkedGraph, lg: LocalGraph) -> Tensor:
    idx = getattr(lg, "_rows_index", None)
    if idx is None:
        idx = lg._rows_index = cg.perm[lg.start:lg.end]
    return idx


def _extender(whole: Tensor):
    """The rows of input ``whole`` beyond a chunk, for any chunked graph of the same chunking."""
    def extend(cg: ChunkedGraph, lg: LocalGraph) -> Tensor:
        idx = getattr(lg, "_halo_index", None)
        if idx is None:
            idx = lg._halo_index = cg.perm[lg.halo]
        return whole.index_select(0, idx)
    return extend
