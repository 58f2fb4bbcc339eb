"""A layer call's arguments on a chunk: which are graphs, node tensors and edge tensors, and what each
becomes (:mod:`.layers` calls these from its hooks).

* **graphs** (``edge_index`` / ``adj_t``) are resolved to the chunk's local graph of the input graph they
  are (:meth:`pyg_pipe.model.resolve.GraphResolver.resolve`); a layer may be given several, each with a
  halo of its own;
* **node tensors** have one row per chunk vertex along the layer's ``node_dim``; in a call on the whole
  local graph they are extended to ``[rows | halo]`` (:func:`extend`);
* **edge tensors** have one row per local edge of the graph they belong to (:func:`edge_chunking`),
  re-cut when the layer runs on another graph with as many edges (:func:`relocalise_edges`).
"""
from __future__ import annotations

import inspect
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch_geometric.nn import MessagePassing

from ...graph.chunks import ChunkedGraph, LocalGraph
from ...model.errors import UnsupportedModelError
from ...model.inputs import is_graph_tensor
from ..context import ChunkContext, leading_rows


def row_graph(ctx: ChunkContext, cg: ChunkedGraph, lg: LocalGraph, local):
    """The row graph of ``local`` (registered as an edge input when ``local`` carries the input's values)."""
    rows = ctx.graphs.row_graph(cg, lg, local)
    whole = ctx.edge_input(local) if isinstance(local, Tensor) and local.layout != torch.strided else None
    if whole is not None and ctx.edge_input(rows) is None:
        ctx.add_edge_input(rows, whole, cg)
    return rows


def each(value, fn, param: str = ""):
    """``fn(tensor, param)`` for ``value`` or each element of a tuple / list ``value`` (a module-level
    recursion: closures that call themselves would keep every chunk's tensors alive in a reference cycle)."""
    if isinstance(value, (tuple, list)):
        return type(value)(each(v, fn, param) for v in value)
    return fn(value, param)


def argument_kind(ctx: ChunkContext, module: MessagePassing, value: Tensor, param: str) -> Tuple[Optional[str], int]:
    """``("node", vertex dim)``, ``("edge", 0)`` or ``(None, 0)`` for one tensor argument of a layer."""
    lg = ctx.lg
    if ctx.edge_input(value) is not None:
        return "edge", 0
    vdim = vertex_dim(module, value, lg.rows)
    if ctx.is_clean(value) and vdim is not None:
        return "node", vdim
    edge = value.size(0) == lg.num_edges or (value.size(0) == ctx.cg.num_edges and "edge" in param)  # (or the
    #                                                 whole graph's per-edge tensor computed in the model: relocalise)
    if vdim is not None and edge:  # as many chunk rows as local edges: PyG's names say which
        return ("edge", 0) if "edge" in param else ("node", vdim)
    if edge:
        return "edge", 0
    return ("node", vdim) if vdim is not None else (None, 0)


def narrow(module: MessagePassing, value, lg: LocalGraph):
    if isinstance(value, (tuple, list)):
        return type(value)(narrow(module, v, lg) for v in value)
    if isinstance(value, Tensor) and value.dim() > 0:
        vdim = vertex_dim(module, value, lg.num_local)
        if vdim is not None:
            return leading_rows(value, vdim, lg.rows)
    return value


def vertex_dim(module: MessagePassing, t: Tensor, size: int) -> Optional[int]:
    """The dimension of ``t`` that indexes vertices (``size`` of them): the layer's ``node_dim``,
    else dimension 0; ``None`` when neither has that size."""
    nd = module.node_dim if module.node_dim >= 0 else t.dim() + module.node_dim
    if 0 <= nd < t.dim() and t.size(nd) == size:
        return nd
    return 0 if t.size(0) == size else None


_NAMES: Dict[Tuple[type, int], Tuple[str, ...]] = {}


def parameter_names(module: torch.nn.Module, count: int) -> Tuple[str, ...]:
    """The names of the first ``count`` positional parameters of the layer's ``forward`` (cached)."""
    key = (type(module), count)
    names = _NAMES.get(key)
    if names is None:
        params = inspect.signature(key[0].forward).parameters.values()
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
        names = _NAMES[key] = tuple((names + [""] * count)[:count])
    return names


def is_sparse(value) -> bool:
    return isinstance(value, Tensor) and value.layout != torch.strided or type(value).__name__ == "SparseTensor"


def resolve_graphs(ctx: ChunkContext, name: str, module: MessagePassing, args: list, kwargs: dict):
    """Finds the layer's graph arguments: ``(cg, lg, {id(graph): (cg, lg, local graph)})`` (``cg, lg``: the
    first one's chunking; the caller swaps in the local graphs)."""
    found: Dict = {}
    for container, keys in ((args, range(len(args))), (kwargs, list(kwargs))):
        for k in keys:
            value = container[k]
            if not is_graph_tensor(value):
                continue
            hit = ctx.graphs.resolve(value)
            if hit is None:
                raise UnsupportedModelError(
                    f"Layer '{name}' ({type(module).__name__}) receives a graph computed inside forward "
                    f"({tuple(value.shape)}), which pyg_pipe cannot cut into chunks. A graph computed from the "
                    f"input graph (add_self_loops, to_undirected, coalesce, ...): compute it in the data pipeline, "
                    f"as a transform (T.AddSelfLoops(), T.ToUndirected()) or as another graph passed to forward "
                    f"(data.edge_index2 = ...; every graph passed is cut into chunks). Understood as they are: the "
                    f"input graphs, their transposes (edge_index.flip(0)), PyG's dropout_edge and dropout_node on "
                    f"them, and what a layer computes from its graph inside its own forward (self loops, "
                    f"normalisations); any other graph drawn at random in forward is not supported: train without "
                    f"it, or on one device.")
            found.setdefault(id(value), hit)
    if not found:
        raise UnsupportedModelError(
            f"Layer '{name}' ({type(module).__name__}) was called without a graph argument (edge_index or adj_t) "
            f"that pyg_pipe handed to the model; pass the graph from the model's forward arguments.")
    cg, lg, _ = next(iter(found.values()))
    return cg, lg, found


def reversed_graphs(ctx: ChunkContext, name: str, module: MessagePassing, graphs: Dict):
    """:func:`resolve_graphs`'s result for a layer with ``flow="target_to_source"``, which aggregates at
    ``edge_index[0]`` and reads its neighbours at ``edge_index[1]``: it is the transposed graph's layer, so each
    edge list it is given becomes a chunk of the transposed graph (whose chunk rows are the vertices it
    aggregates at, and whose halo the vertices it reads), handed over in the layer's own orientation
    (:attr:`~pyg_pipe.graph.chunks.LocalGraph.reversed_edges`). Whatever the layer computes from its edges then
    sees what it sees on one device, up to the order of the vertices."""
    out = {}
    for key, (cg, lg, local) in graphs.items():
        if not isinstance(local, Tensor) or local.layout != torch.strided:  # (PyG refuses these itself)
            raise UnsupportedModelError(
                f"Layer '{name}' ({type(module).__name__}) uses flow='target_to_source' with a sparse adjacency; "
                f"PyG runs that flow on an edge_index only. Pass edge_index, or transpose the adjacency and use "
                f"the default flow.")
        if getattr(cg, "_base", None) is not None:
            raise UnsupportedModelError(
                f"Layer '{name}' ({type(module).__name__}) uses flow='target_to_source' on a graph DropEdge draws in "
                f"forward; pyg_pipe transposes only the graphs handed to the model. Draw the edges in the data "
                f"pipeline, or use the default flow.")
        tcg = ctx.graphs.derived(cg, "flip")
        tlg = tcg.chunks[lg.index]
        out[key] = (tcg, tlg, tlg.reversed_edges)
    tcg, tlg, _ = next(iter(out.values()))
    return tcg, tlg, out


def edge_chunking(ctx: ChunkContext, name: str, graphs: Dict, value: Tensor):
    """``(cg, lg)`` of the graph an edge tensor of a layer given several graphs belongs to: the graph whose
    chunking cut it (an input), else the only one with as many local edges."""
    cut = ctx.edge_chunking(value)
    hits = [(cg, lg) for cg, lg, _ in graphs.values() if (cut is cg if cut is not None else lg.num_edges ==
                                                         value.size(0))]
    if len({id(cg) for cg, _ in hits}) != 1:
        raise UnsupportedModelError(
            f"Layer '{name}' is given several graphs and an edge tensor of shape {tuple(value.shape)} that "
            f"pyg_pipe cannot assign to one of them. Pass per-edge inputs of each graph as forward arguments "
            f"(they are cut with their graph), or give each graph a layer of its own.")
    return hits[0]


def clean_input(ctx: ChunkContext, t: Tensor) -> bool:
    """``t`` is an input handed out for the chunk, unchanged (or a recomputation's detached copy of one)."""
    if ctx.is_clean(t):
        return True
    return ctx.recomputing() and any(h[0].data_ptr() == t.data_ptr() and h[0].shape == t.shape
                                     and h[1] == h[0]._version for h in ctx.clean.values())


def relocalise_edges(ctx: ChunkContext, name: str, cg: ChunkedGraph, lg: LocalGraph, value: Tensor):
    """Edge inputs are handed out cut for the graph whose edge count they have (the primary graph's when
    several have it); a layer on another graph with as many edges (a transpose) gets them re-cut for it.
    A tensor with one row per edge of the whole graph computed in the model (an ``edge_*`` argument: a per-edge
    parameter) is cut for the chunk here. Other computed edge tensors cannot be re-cut."""
    cut = ctx.edge_chunking(value)
    if cut is None and value.size(0) == cg.num_edges != lg.num_edges and ctx.edge_input(value) is None:
        return cg.local_edges(lg, value)  # one value per edge of the whole graph, computed in the model (a per-edge
        #                                   parameter): its chunk's edges, through which its gradient flows back; the
        #                                   degrees it weighs are exchanged as for weights computed on the chunk
    if cut is cg or (cut is None and (cg is ctx.cg or value.size(0) != ctx.lg.num_edges)):
        return value
    whole = ctx.edge_input(value)
    if whole is None or whole.size(0) != cg.num_edges:
        raise UnsupportedModelError(
            f"Layer '{name}' runs on another graph than the one its edge tensor {tuple(value.shape)} was cut for "
            f"(a transpose, or a second graph); pyg_pipe can re-cut only edge tensors given as forward arguments "
            f"with as many rows as that graph has edges.")
    out = cg.local_edges(lg, whole)
    ctx.add_edge_input(out, whole, cg)
    return out


def extend(ctx: ChunkContext, cg: ChunkedGraph, lg: LocalGraph, t: Tensor, vdim: int, clean: bool) -> Tensor:
    """``t`` (chunk rows) extended to ``lg.num_local`` rows along ``vdim``: a clean input with its true halo
    rows, anything else with fillers (copies of chunk rows, replaced at the propagate)."""
    out = _extend(ctx, cg, lg, t, vdim, clean)
    if ctx.observer is not None:  # the row check follows what the layer computes from all its local rows
        ctx.observer.returned(out, vdim, local=True)
    return out


def _extend(ctx: ChunkContext, cg: ChunkedGraph, lg: LocalGraph, t: Tensor, vdim: int, clean: bool) -> Tensor:
    if lg.halo.numel() == 0:
        return t
    if clean:
        whole = ctx.clean_extended(t, lg) if vdim == 0 else None
        if whole is not None:  # [rows | halo] gathered as one tensor already (streaming)
            return whole
        if not t.requires_grad:  # an input's rows: the same tensor every call (localize.Localizer keeps them)
            kept = t.__dict__.setdefault("_pyg_pipe_extended", {})
            hit = kept.get((id(cg), lg.index, vdim))
            if hit is not None and hit[0] is cg and hit[1] == t._version and hit[2]._version == hit[3]:
                return hit[2]
        rest = ctx.clean_rows(t)(cg, lg).to(t.dtype)
        if vdim != 0:
            rest = rest.movedim(0, vdim)
        out = torch.cat([t, rest], dim=vdim)
        if not t.requires_grad:
            kept[(id(cg), lg.index, vdim)] = (cg, t._version, out, out._version)
        return out
    rest = t.detach().index_select(vdim, filler(lg, t.device))
    return torch.cat([t, rest], dim=vdim)


def filler(lg: LocalGraph, device) -> Tensor:
    fill = getattr(lg, "filler", None)
    if fill is None:
        fill = lg.filler = torch.arange(lg.halo.numel(), device=device) % lg.rows
    return fill


def vertex_ids(ctx: ChunkContext, cg: ChunkedGraph, lg: LocalGraph) -> Tensor:
    """The chunk's rows' vertex ids (the user's numbering), as a clean input whose halo rows are the halo
    vertices' ids: what a featureless layer indexes its per-vertex weights with."""
    hit = getattr(lg, "_vertex_ids", None)
    if hit is None:  # new id i holds the user's vertex perm[i]
        hit = lg._vertex_ids = (cg.perm[lg.start:lg.end], lambda cg2, lg2: cg2.perm[lg2.halo])
    ctx.add_clean(hit[0], hit[1])
    return hit[0]


def reversed_pairs(module: MessagePassing, args_attr: str, kwargs: dict) -> Tuple[int, dict]:
    """``(j, kwargs)`` for a layer with ``flow="target_to_source"``: PyG's generated ``propagate`` /
    ``edge_updater`` reads ``x_j`` from the first tensor of a pair ``x = (a, b)`` (j = 0), its generic one the
    second (j = 1), and ``x_i`` from the other. Where the engine runs the generic ``edge_updater`` in place of a
    generated one (:meth:`.layers.LayerHooks.install`), the pairs are turned around, so the layer reads what it reads
    on one device."""
    generic = "propagate" if args_attr == "_user_args" else "edge_updater"
    fn = getattr(module, generic)
    prefix = f"{type(module).__module__}_{type(module).__name__}"
    if getattr(fn, "__module__", "").startswith(prefix):
        return 0, kwargs
    own = getattr(type(module), "_jinja_edge_updater", None)
    if generic == "edge_updater" and own is not None and getattr(own, "__module__", "").startswith(prefix):
        pairs = {a[:-2] for a in getattr(module, args_attr) if a.endswith(("_i", "_j"))}
        kwargs = {k: type(v)((v[1], v[0])) if k in pairs and isinstance(v, (tuple, list)) and len(v) == 2 else v
                  for k, v in kwargs.items()}
    return 1, kwargs


_SOURCES: Dict[tuple, List[str]] = {}


def source_names(module: MessagePassing, args_attr: str, fused: bool, kwargs: dict) -> List[str]:
    """The arguments of a propagate / edge_updater call read at edge sources (``x`` for ``x_j``; the
    matrix of a fused ``message_and_aggregate``): decided once per layer class and call signature."""
    key = (type(module), getattr(module, "_explain", None), args_attr, fused, tuple(kwargs))  # (explain mode
    #                                                                   changes the arguments of PyG's message)
    hit = _SOURCES.get(key)
    if hit is None:
        if fused:
            hit = [a for a in module._fused_user_args if a in kwargs]
        else:
            hit = sorted({a[:-2] for a in getattr(module, args_attr) if a.endswith("_j") and a[:-2] in kwargs})
        hit = _SOURCES[key] = hit
    return hit


_EDGE_IDS: Dict[type, bool] = {}


def reads_edge_ids(module: MessagePassing) -> bool:
    """Whether the layer's ``message`` takes the edge_index's own entries (``edge_index_i`` / ``edge_index_j``)."""
    cls = type(module)
    hit = _EDGE_IDS.get(cls)
    if hit is None:
        params = inspect.signature(cls.message).parameters
        hit = _EDGE_IDS[cls] = "edge_index_j" in params or "edge_index_i" in params
    return hit
