"""Degrees a layer computes from a chunk's local graph, completed to the whole graph's (and self loops added
on a chunk's row graph).

PyG's normalising layers compute vertex degrees from the edge list they are given, in two functions:
``gcn_norm`` (GCNConv, GCN2Conv, SGConv, APPNP, TAGConv, ARMAConv, SSGConv, FAConv, EGConv, LGConv,
MixHopConv, DNAConv, PDNConv, ...) scales each edge by the in-degrees of its source and destination,
``get_laplacian`` (ChebConv) by out-degrees. On a chunk (:mod:`pyg_pipe.graph.chunks`) a chunk row's
in-degree is complete, since all its in-edges are local, but a halo vertex's is not; out-degrees are
incomplete for every vertex.

While the engine runs, both functions (wherever a loaded module holds them, and where each layer's ``forward``
looks them up: its globals and closure) are replaced by versions that compute exactly what PyG's compute, with
the degrees completed:

* **in-degree** (``gcn_norm``): the chunk's rows' degrees are computed locally, with self loops added
  as PyG adds them. The halo vertices' degrees are the whole graph's, taken from the inputs when the
  layer normalises the local graph it was handed with weights given to the model's forward (under any
  name) or none, or the local sparse ``adj_t`` it was handed (its values are the input's): computed once per
  weight tensor and version. Otherwise (weights the model computes, such as PDNConv's, or an edge list the layer
  changed first) they are exchanged like source rows (:mod:`..runtime.halo`) at a call site
  ``module#invocation.degK``: fresh from other ways, from history for other chunks of a way, and gradients
  reach the owners of the weights.
* **out-degree** (``get_laplacian``): from the whole graph's weights, which must be a forward
  argument (or none), cached per weight tensor and version; weights computed inside the model are
  refused there.

A layer that computes the chunk's rows only (:mod:`.layers`) normalises the row graph with
``num_nodes`` = the chunk's rows: self loops go to those rows, and the sources' degrees (rows and halo)
are completed the same way.

A layer that counts degrees itself (``degree(col, x.size(0))`` in its ``forward``, PyG's tutorial GCN) runs on its
whole local graph (:func:`counts_degrees`), where :func:`degree` exchanges the halo's counts (site ``...sumK``).

``add_self_loops`` / ``add_remaining_self_loops`` called without ``num_nodes`` inside a layer give the loops
the whole graph's call gives the chunk's vertices (:func:`_with_loops`).

Outside the engine (no active chunk) the originals run unchanged.
"""
from __future__ import annotations

import functools
import sys
from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from ...model.errors import UnsupportedModelError
from ..context import current

_swapped: list = []  # what puts each replaced name back (callables, last first)
_installs = 0


def _originals():
    from torch_geometric.nn.conv import gcn_conv
    from torch_geometric.utils import _degree, laplacian, loop
    return {"gcn_norm": gcn_conv.gcn_norm, "get_laplacian": laplacian.get_laplacian,
            "add_self_loops": loop.add_self_loops, "add_remaining_self_loops": loop.add_remaining_self_loops,
            "degree": _degree.degree}


_ORIGINAL = _originals()  # PyG's own, taken before anything is swapped


def install(forwards: Iterable = ()) -> None:
    """Replaces ``gcn_norm``, ``get_laplacian``, the self-loop helpers and ``degree`` in every loaded module
    (reference counted), and where each of ``forwards`` (the layers' ``forward`` functions) looks them up."""
    global _installs
    _installs += 1
    if _installs == 1:
        for module in list(sys.modules.values()):
            _swap(getattr(module, "__dict__", None) or {})  # (not getattr: a module's __getattr__ may warn or import)
    for fn in forwards:
        _cover(fn)


def _cover(fn) -> None:
    """Replaces them where the function ``fn`` looks them up: its globals and its closure. A script started by a
    spawning launcher runs as a copy of its module whose dictionary is not the one its functions read (``runpy``),
    and a function may take them from an enclosing function's scope."""
    _swap(getattr(fn, "__globals__", None) or {})
    for cell in getattr(fn, "__closure__", None) or ():
        held = cell.cell_contents if _filled(cell) else None
        for name, original in _ORIGINAL.items():
            if held is original:
                cell.cell_contents = _REPLACEMENT[name]
                _swapped.append(functools.partial(setattr, cell, "cell_contents", original))


def _swap(held: dict) -> None:
    for name, original in _ORIGINAL.items():
        if held.get(name) is original:
            held[name] = _REPLACEMENT[name]
            _swapped.append(functools.partial(held.__setitem__, name, original))


def uninstall() -> None:
    global _installs
    _installs = max(0, _installs - 1)
    if _installs:
        return
    while _swapped:
        _swapped.pop()()  # puts one back


def _width(inv) -> int:
    """The vertices a layer's own tensors have: the chunk's rows (rows-only call) or all local vertices."""
    return inv.lg.rows if inv.rows_only else inv.lg.num_local


def _site(kind: str):
    """``(ctx, invocation)`` when called inside a layer running on a chunk, else ``None``."""
    ctx = current()
    if ctx is None or not ctx.stack:
        return None
    inv = ctx.stack[-1]
    n = inv.norms
    inv.norms += 1
    return ctx, inv, f"{inv.name}#{inv.index}.{kind}{n}"


def _engine_side(fn):
    """Runs ``fn`` inside a layer as the engine's own work: the row check (:mod:`.rows`) does not judge the sums over
    edges it computes (it completes them). Called by the model's forward outside the layers it is PyG's own, judged
    like any operation there."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        ctx = current()
        if ctx is None or not ctx.stack:
            return fn(*args, **kwargs)
        with ctx.engine_work():
            out = fn(*args, **kwargs)
        if ctx.observer is not None and isinstance(out, tuple) and isinstance(out[0], Tensor):
            ctx.observer.edges(out[0], ctx.stack[-1].reverse if ctx.stack else False)  # the graph it returns (self
            #                                                   loops added): its entries are still vertex ids
        return out
    return run


@_engine_side
def gcn_norm(edge_index, edge_weight: Optional[Tensor] = None, num_nodes: Optional[int] = None,
             improved: bool = False, add_self_loops: bool = True, flow: str = "source_to_target",
             dtype: Optional[torch.dtype] = None):
    """PyG's ``gcn_norm`` with the in-degrees of halo vertices completed (see the module docstring)."""
    hit = _site("deg")
    if hit is None or type(edge_index).__name__ == "SparseTensor":
        return _ORIGINAL["gcn_norm"](edge_index, edge_weight, num_nodes, improved, add_self_loops, flow, dtype)
    from torch_geometric.utils import add_remaining_self_loops, add_self_loops as add_loops, is_torch_sparse_tensor, \
        scatter, to_edge_index
    from torch_geometric.utils.sparse import set_sparse_value
    ctx, inv, site = hit
    fill = 2.0 if improved else 1.0
    cg, lg = inv.chunking(edge_index, "gcn_norm")
    if is_torch_sparse_tensor(edge_index):
        whole = ctx.edge_input(edge_index) if inv.handed(edge_index) and num_nodes in (None, _width(inv)) \
            else None
        key = None
        if whole is not None:  # the input adjacency, unchanged: a pure function of it, computed once per chunk
            key = ("gcn_norm", id(edge_index), id(whole), whole._version, fill, add_self_loops, dtype, num_nodes)
            hit = ctx.cache.get(key)
            if hit is not None and hit[0] is edge_index and hit[1] is whole:
                inv.derive(hit[2][0], edge_index)
                return hit[2]
        adj_t = edge_index
        if add_self_loops:
            adj_t, _ = add_loops(adj_t, None, fill, num_nodes)
        index, value = to_edge_index(adj_t)
        col, row = index[0], index[1]
        deg = scatter(value, col, 0, dim_size=adj_t.size(0) if num_nodes is None else num_nodes, reduce="sum")
        if whole is None:  # values computed in the model: exchanged
            deg = _complete(ctx, inv, site, deg, cg, lg)
        else:  # the halo's degrees are the whole graph's (self loops added to every vertex)
            known = cg.in_degree(whole, False, 0.0, value.dtype)[lg.halo]
            deg = torch.cat([deg[:lg.rows], known + (fill if add_self_loops else 0.0)])
        dis = _inv_sqrt(deg)
        out = (set_sparse_value(adj_t, dis[row] * value * dis[col]), None)
        if key is not None:
            ctx.cache[key] = (edge_index, whole, out)
        inv.derive(out[0], edge_index)
        return out
    if (flow == "target_to_source") != inv.reverse:
        raise UnsupportedModelError(
            f"Layer '{inv.name}' normalises its graph with gcn_norm(flow='{flow}'), which sums degrees at the "
            f"other end of its edges than the layer aggregates at (its flow is "
            f"'{'target_to_source' if inv.reverse else 'source_to_target'}'); a chunk holds the edges of the "
            f"vertices it aggregates at, so pyg_pipe completes degrees at that end only. Pass the layer's own flow "
            f"to gcn_norm (flow=self.flow, as PyG's layers do), or train with one chunk and no graph-parallel ways.")
    known = _known_degrees(ctx, inv, cg, edge_index, edge_weight, num_nodes)
    # a pure function of inputs that do not change: computed once per chunk (not a graph DropEdge draws every step)
    key = None
    if known is not None and getattr(cg, "_base", None) is None:
        whole = known[0]
        key = ("gcn_norm", id(edge_index), id(whole), None if whole is None else whole._version, fill,
               add_self_loops, flow, dtype, num_nodes)
        hit = ctx.cache.get(key)
        if hit is not None and hit[0] is edge_index and hit[1] is whole:
            inv.derive(hit[2][0], edge_index)
            return hit[2]
        graph = edge_index
    source = edge_index
    if add_self_loops:
        edge_index, edge_weight = add_remaining_self_loops(edge_index, edge_weight, fill, num_nodes)
    inv.derive(edge_index, source)
    if edge_weight is None:
        edge_weight = torch.ones((edge_index.size(1),), dtype=dtype, device=edge_index.device)
    row, col = edge_index[0], edge_index[1]
    idx = col if flow == "source_to_target" else row
    deg = scatter(edge_weight, idx, dim=0, dim_size=num_nodes, reduce="sum")
    if known is None:
        deg = _complete(ctx, inv, site, deg, cg, lg)
        dis = _inv_sqrt(deg)
        return edge_index, dis[row] * edge_weight * dis[col]
    halo = cg.in_degree(known[0], add_self_loops, fill, deg.dtype)[lg.halo]  # the whole graph's degrees
    deg = torch.cat([deg[:lg.rows], halo])
    dis = _inv_sqrt(deg)
    out = (edge_index, dis[row] * edge_weight * dis[col])
    if key is not None:
        ctx.cache[key] = (graph, known[0], out)
    return out


def _known_degrees(ctx, inv, cg, edge_index, edge_weight, num_nodes) -> Optional[Tuple[Optional[Tensor]]]:
    """``(whole,)`` when the halo vertices' degrees can be taken from the whole graph: the layer normalises
    the local graph it was handed, with weights that are a forward argument (``whole``, cut from the
    input's edge weights) or none, so no exchange is needed. ``None`` otherwise (weights computed in the
    model, an edge list the layer changed): the degrees are then exchanged."""
    if not inv.handed(edge_index) or num_nodes != _width(inv) or cg.repeated_loops:
        return None
    whole = None
    if edge_weight is not None:
        whole = ctx.edge_input(edge_weight)
        if whole is None:
            return None
    return (whole,)


def _complete(ctx, inv, site: str, deg: Tensor, cg, lg) -> Tensor:
    if ctx.halo is None or deg.size(0) != _width(inv):
        return deg
    return ctx.halo.join(f"{site}:deg", cg, lg, deg.unsqueeze(-1), 0).squeeze(-1)


def _inv_sqrt(deg: Tensor) -> Tensor:
    out = deg.pow(-0.5)
    return out.masked_fill(out == float("inf"), 0)


@_engine_side
def get_laplacian(edge_index: Tensor, edge_weight: Optional[Tensor] = None, normalization: Optional[str] = None,
                  dtype: Optional[torch.dtype] = None, num_nodes: Optional[int] = None):
    """PyG's ``get_laplacian`` with out-degrees taken from the whole graph (see the module docstring)."""
    hit = _site("lap")
    if hit is None:
        return _ORIGINAL["get_laplacian"](edge_index, edge_weight, normalization, dtype, num_nodes)
    from torch_geometric.utils import add_self_loops, remove_self_loops
    ctx, inv, _ = hit
    if normalization is not None:
        assert normalization in ["sym", "rw"]  # 'Invalid normalization'
    whole = None
    if edge_weight is not None:
        whole = ctx.edge_input(edge_weight)
        if whole is None:
            raise UnsupportedModelError(
                f"Layer '{inv.name}' computes a graph Laplacian from edge weights computed inside forward; the "
                f"out-degrees of a chunk's vertices need the weights of edges in other chunks, which pyg_pipe knows "
                f"only for weights given as forward arguments. Pass the weights to forward, or use num_chunks=1 on "
                f"one device.")
    cg, lg = inv.chunking(edge_index, "get_laplacian")
    source = edge_index
    edge_index, edge_weight = remove_self_loops(edge_index, edge_weight)
    if edge_weight is None:
        edge_weight = torch.ones(edge_index.size(1), dtype=dtype, device=edge_index.device)
    if num_nodes is None or num_nodes != _width(inv):
        raise UnsupportedModelError(f"Layer '{inv.name}' asked for a Laplacian of {num_nodes} vertices on a chunk of "
                                    f"{_width(inv)} vertices; pyg_pipe cannot complete its degrees.")
    # every local vertex (sources of the edges; with flow="target_to_source" the chunking is the transpose's)
    deg = cg.out_degree(whole, edge_weight.dtype, inv.reverse)[lg.nodes]
    row, col = edge_index[0], edge_index[1]
    if normalization is None:
        edge_index, _ = add_self_loops(edge_index, num_nodes=num_nodes)
        edge_weight = torch.cat([-edge_weight, deg[:num_nodes]], dim=0)
    elif normalization == "sym":
        dis = _inv_sqrt(deg)
        edge_weight = dis[row] * edge_weight * dis[col]
        edge_index, edge_weight = add_self_loops(edge_index, -edge_weight, fill_value=1., num_nodes=num_nodes)
    else:
        deg_inv = 1.0 / deg
        deg_inv = deg_inv.masked_fill(deg_inv == float("inf"), 0)
        edge_weight = deg_inv[row] * edge_weight
        edge_index, edge_weight = add_self_loops(edge_index, -edge_weight, fill_value=1., num_nodes=num_nodes)
    inv.derive(edge_index, source)
    return edge_index, edge_weight


def degree(index: Tensor, num_nodes: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> Tensor:
    """PyG's ``degree``; inside a layer given its whole local graph, a count at the end of the layer's edges it
    aggregates at (``degree(col, x.size(0))``, PyG's tutorial GCN) has its halo vertices' entries exchanged, computed
    by the chunks that own them, as :func:`gcn_norm`'s degrees of weights computed in the model are. A chunk's rows
    count all their edges; the halo's would count the local ones only. Any other count is PyG's own (the row check
    of :mod:`.rows` judges how it is used)."""
    original = _ORIGINAL["degree"]
    ctx = current()
    if ctx is None or not ctx.stack or ctx.stack[-1].rows_only or num_nodes != ctx.stack[-1].lg.num_local:
        return original(index, num_nodes, dtype)
    inv = ctx.stack[-1]
    graph = _graph_of(inv, index)
    if graph is None:
        return original(index, num_nodes, dtype)
    _, _, site = _site("sum")
    cg, lg = inv.chunking(graph, "degree")
    with ctx.engine_work():
        deg = original(index, num_nodes, dtype)
        exact = deg if deg.is_floating_point() else deg.to(torch.get_default_dtype())
        return _complete(ctx, inv, site, exact, cg, lg).to(deg.dtype)


def counts_degrees(module: torch.nn.Module) -> bool:
    """Whether the layer's ``forward`` counts degrees itself (calls PyG's ``degree``, under any name, as PyG's tutorial
    GCN does: ``deg = degree(col, x.size(0))``, read at both ends of the edges). Such a layer runs on its whole local
    graph, where :func:`degree` completes the halo vertices' counts (computed on the chunk's rows only, the
    count would have no entries for the sources it reads). Decided from the layer's code, once per class."""
    cls = type(module)
    hit = _COUNTS_DEGREES.get(cls)
    if hit is None:
        fn = cls.forward
        code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
        cells = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if _filled(c)]
        found = [names.get(n) for n in code.co_names] + cells if code is not None else []
        hit = _COUNTS_DEGREES[cls] = code is not None and ("degree" in code.co_names or any(
            f is _ORIGINAL["degree"] or f is degree for f in found))
    return hit


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


_COUNTS_DEGREES: Dict[type, bool] = {}


def _graph_of(inv, index: Tensor) -> Optional[Tensor]:
    """The graph (a ``[2, E]`` edge list of the layer's) whose aggregating end ``index`` is (``edge_index[1]``, or
    ``[0]`` for ``flow="target_to_source"``; a row of the graph handed to the layer, or of one built from it in the
    layer, self loops added), else ``None``. Decided from the tensors' memory, never from their values."""
    if not isinstance(index, Tensor) or index.dim() != 1 or index.is_floating_point():
        return None
    end = 0 if inv.reverse else 1
    for g in (index._base, *(h[0] for h in inv.graphs.values())):
        if isinstance(g, Tensor) and g.layout == torch.strided and g.dim() == 2 and g.size(0) == 2 \
                and g.size(1) == index.numel() and g.dtype == index.dtype and g.device == index.device \
                and g[end].data_ptr() == index.data_ptr() and (index.numel() < 2 or g.stride(1) == index.stride(0)):
            return g
    return None


def add_self_loops(edge_index, edge_attr=None, fill_value=None, num_nodes=None):
    """PyG's ``add_self_loops``; inside a layer on a chunk, the whole graph's loops (:func:`_with_loops`)."""
    return _with_loops("add_self_loops", edge_index, edge_attr, fill_value, num_nodes)


def add_remaining_self_loops(edge_index, edge_attr=None, fill_value=None, num_nodes=None):
    """PyG's ``add_remaining_self_loops``; inside a layer on a chunk, the whole graph's (:func:`_with_loops`)."""
    return _with_loops("add_remaining_self_loops", edge_index, edge_attr, fill_value, num_nodes)


def _with_loops(name: str, edge_index, edge_attr, fill_value, num_nodes):
    """Self loops on a chunk's local graph, as on the whole graph. PyG infers the vertex count from the graph
    when ``num_nodes`` is not given (EGConv's ``add_remaining_self_loops(edge_index)``): the largest vertex
    id + 1, so a trailing isolated vertex gets no loop. On a chunk the inference would see other ids: a row
    graph's sources reach into the halo (loops for halo vertices, destinations the layer has no output row
    for), and a chunk's last row may be such an isolated vertex. So the loops go to every vertex of the
    layer's tensors (the rows, or rows and halo), minus the rows the whole graph's inference leaves without
    one (:meth:`~pyg_pipe.graph.chunks.ChunkedGraph.inferred_loops`). Anything else is PyG's own."""
    original = _ORIGINAL[name]
    ctx = current()
    if num_nodes is not None or ctx is None or not ctx.stack or not isinstance(edge_index, Tensor) \
            or edge_index.layout != torch.strided:
        return original(edge_index, edge_attr, fill_value, num_nodes)
    inv = ctx.stack[-1]
    cg, lg = inv.chunking(edge_index, name)
    width = lg.rows if inv.rows_only else lg.num_local
    out_index, out_attr = original(edge_index, edge_attr, fill_value, width)
    keep = cg.inferred_loops(lg)
    if keep is not None:  # PyG appends one loop per vertex, in order, after the other edges
        dev = keep.device
        keep = torch.cat([torch.ones(out_index.size(1) - width, dtype=torch.bool, device=dev), keep,
                          torch.ones(width - lg.rows, dtype=torch.bool, device=dev)])
        out_index, out_attr = out_index[:, keep], None if out_attr is None else out_attr[keep]
    inv.derive(out_index, edge_index)
    return out_index, out_attr


_REPLACEMENT = {"gcn_norm": gcn_norm, "get_laplacian": get_laplacian, "add_self_loops": add_self_loops,
                "add_remaining_self_loops": add_remaining_self_loops, "degree": degree}
