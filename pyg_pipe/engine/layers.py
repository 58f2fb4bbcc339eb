"""Unchanged PyG layers on a chunk: the hooks around every ``MessagePassing`` call.

The user's forward runs as ordinary Python on a chunk's rows (tensors with one row per chunk vertex;
:mod:`pyg_pipe.model.inputs` hands them out). Neighbour access happens only inside
``MessagePassing`` layers, and these hooks adapt each call to the chunk's local graph
(:mod:`pyg_pipe.graph.chunks`):

1. **layer entry** (forward pre-hook): the graph argument is resolved to the chunk's local graph
   (a local ``edge_index`` or sparse ``adj_t`` handed out with the inputs, the whole-graph tensor
   itself, or its transpose ``edge_index.flip(0)``); every node tensor (one row per chunk vertex
   along the layer's ``node_dim``) is extended to the local graph's ``num_local`` rows (chunk rows,
   then halo). Degrees the layer computes are completed by :mod:`pyg_pipe.engine.degrees`.
2. **each propagate / edge_updater call** (pre-hook): the arguments the layer reads at edge sources
   (``x`` for ``x_j``; the matrix of ``message_and_aggregate`` for sparse adjacencies) get their
   true halo rows (:mod:`pyg_pipe.engine.halo`). That call is a *call site*, named
   ``module#invocation.call``; K-hop layers have K sites.
3. **layer exit** (forward hook): the outputs are cut back to the chunk's rows.

Which extended rows are already right is decided by structure, never by values: a node argument
is *clean* when it is one of the inputs handed out for this chunk, unchanged (its halo rows are then
the true input rows); a call site's sources are clean when every node argument of the layer call was
clean and no propagate of that call has returned yet. Clean sources need no exchange and no history
(the first layer of a model reads the input features). Everything else is exchanged.

Rows beyond the chunk are only ever *read* at a call site, after the exchange replaced them, so
their local values (copies of chunk rows, a numerically safe filler) never reach a chunk row.
Graph-wide statistics (BatchNorm and friends) are computed from the chunk's rows only
(:mod:`pyg_pipe.engine.statistics`).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch_geometric.nn import MessagePassing

from ..graph.chunks import ChunkedGraph, LocalGraph
from ..model.errors import UnsupportedModelError
from .halo import in_backward

_ACTIVE: List["ChunkContext"] = []


def active() -> Optional["ChunkContext"]:
    """The context of the chunk running now, or ``None`` outside the engine."""
    return _ACTIVE[-1] if _ACTIVE else None


@dataclass
class Invocation:
    """One call of one ``MessagePassing`` module on the current chunk."""

    name: str
    index: int
    cg: ChunkedGraph
    lg: LocalGraph
    clean: bool
    parent: Optional["Invocation"] = None
    graph: Any = None
    calls: int = 0
    norms: int = 0
    propagated: bool = False
    restore: Dict[str, Any] = field(default_factory=dict)

    def mark_propagated(self) -> None:
        inv = self
        while inv is not None:
            inv.propagated = True
            inv = inv.parent


@dataclass
class Site:
    """A call site as recorded by the plan: its key and the source arguments exchanged there."""

    key: str
    sources: Tuple[str, ...]
    clean: bool


class ChunkContext:
    """What the hooks need while one chunk (or one way's partition) runs.

    Args:
        cg: the chunked primary graph.
        lg: the chunk's local view of it.
        halo: source of halo rows (``None`` when the chunk is the whole graph: no halo).
        graphs: resolves graph arguments: ``resolve(tensor) -> (cg, lg, local graph) or None``.
        statistics: graph-wide statistics for this run (:mod:`pyg_pipe.engine.statistics`).
        cache: per-chunk store for layers with ``cached=True``.
        sites: the list the run appends its call sites to.
    """

    def __init__(self, cg: ChunkedGraph, lg: LocalGraph, halo, graphs, statistics, cache: Dict, sites: List[Site]):
        self.cg, self.lg = cg, lg
        self.halo, self.graphs, self.statistics = halo, graphs, statistics
        self.cache = cache
        self.sites = sites
        self.clean: Dict[int, Tuple[Tensor, int, Callable]] = {}
        self.edge_inputs: Dict[int, Tuple[Tensor, int, Tensor]] = {}
        self.stack: List[Invocation] = []
        self.counts: Dict[str, int] = {}
        self.clean_calls: Dict[Tuple[str, int], bool] = {}
        self.rows_check = None  # a RowCheck on a plan's first pass (:mod:`pyg_pipe.engine.rows`)

    def __enter__(self):
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.remove(self)

    # inputs registered by the localiser
    def add_clean(self, local: Tensor, extend: Callable[[ChunkedGraph, LocalGraph], Tensor]) -> None:
        """``local`` is an input's chunk rows; ``extend(cg, lg)`` gives its rows beyond them."""
        self.clean[id(local)] = (local, local._version, extend)

    def add_edge_input(self, local: Tensor, whole: Tensor) -> None:
        self.edge_inputs[id(local)] = (local, local._version, whole)

    def is_clean(self, t: Tensor) -> bool:
        hit = self.clean.get(id(t))
        return hit is not None and hit[0] is t and hit[1] == t._version

    def clean_rows(self, t: Tensor) -> Callable:
        """The halo-row provider of a clean input (found by storage for a recomputation's detached copy)."""
        hit = self.clean.get(id(t))
        if hit is None or hit[0] is not t:
            hit = next((h for h in self.clean.values() if h[0].data_ptr() == t.data_ptr()
                        and h[0].shape == t.shape), None)
            if hit is None:
                raise UnsupportedModelError("pyg_pipe: a layer recomputed during backward received an input it did "
                                            "not receive in the forward.")
        return hit[2]

    def edge_input(self, t: Tensor) -> Optional[Tensor]:
        hit = self.edge_inputs.get(id(t))
        return hit[2] if hit is not None and hit[0] is t and hit[1] == t._version else None


class Rerouted:
    """A module's ``forward`` while the engine is installed: calls ``route(*args)`` instead.

    Set as an instance attribute and removed at uninstall. A deep copy of the module (taken while
    installed) gets the module's own forward back, bound to the copy, so copies are plain modules.
    """

    def __init__(self, module: torch.nn.Module, route: Callable, plain: Callable):
        self.module, self.route, self.plain = module, route, plain

    def __call__(self, *args, **kwargs):
        return self.route(*args, **kwargs)

    def __deepcopy__(self, memo):
        import types
        copy = memo.get(id(self.module))
        return types.MethodType(self.plain, copy) if copy is not None else self.plain


# ---------------------------------------------------------------------------------------------
# hooks
# ---------------------------------------------------------------------------------------------


class LayerHooks:
    """Installs the hooks on every ``MessagePassing`` module of ``model`` (and removes them).

    Outside the engine (no active :class:`ChunkContext`) the hooks do nothing, so the model keeps
    working as a plain single-device model.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.handles: list = []
        self.patched: List[MessagePassing] = []

    def install(self) -> None:
        if self.handles:
            return
        from . import degrees
        degrees.install()
        self.handles.append(_Undo(degrees.uninstall))
        for name, m in self.model.named_modules():
            if isinstance(m, MessagePassing):
                # PyG's generated (jinja) edge_updater calls its pre-hooks after lifting the arguments to
                # the edges; its plain one, which PyG itself switches to for explanations, calls them before
                if hasattr(type(m), "_orig_edge_updater"):
                    m.edge_updater = type(m)._orig_edge_updater.__get__(m, type(m))
                    self.patched.append(m)
                self.handles += [
                    m.register_forward_pre_hook(_entry(name), with_kwargs=True),
                    m.register_forward_hook(_exit, with_kwargs=True, always_call=True),
                    m.register_propagate_forward_pre_hook(_sources(name, "_user_args")),
                    m.register_propagate_forward_hook(_propagated),
                    m.register_edge_update_forward_pre_hook(_sources(name, "_edge_user_args")),
                ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for m in self.patched:
            m.__dict__.pop("edge_updater", None)
        self.handles, self.patched = [], []


class _Undo:
    """A hook handle that runs ``fn`` when removed."""

    def __init__(self, fn):
        self.fn = fn

    def remove(self):
        self.fn()


def _entry(name: str):
    def hook(module: MessagePassing, args: tuple, kwargs: dict):
        ctx = active()
        if ctx is None:
            return None
        if in_backward():  # recomputed during backward (checkpointing, reversible blocks): the forward's call
            if ctx.counts.get(name, 0) > 1:
                raise UnsupportedModelError(
                    f"Layer '{name}' ({type(module).__name__}) runs again during backward (checkpointing or a "
                    f"reversible block) but was called {ctx.counts[name]} times in the forward, so pyg_pipe cannot "
                    f"tell which call is recomputed. Give each call its own module, or do not checkpoint it.")
            index = 0
        else:
            index = ctx.counts.get(name, 0)
            ctx.counts[name] = index + 1
        if ctx.stack:  # a layer called inside another layer: already on the local graph
            parent = ctx.stack[-1]
            ctx.stack.append(Invocation(name, index, parent.cg, parent.lg, parent.clean and not parent.propagated,
                                        parent=parent, graph=parent.graph))
            return None
        return _enter(ctx, name, index, module, args, kwargs)
    return hook


def _enter(ctx: ChunkContext, name: str, index: int, module: MessagePassing, args: tuple, kwargs: dict):
    if module.flow != "source_to_target":
        raise UnsupportedModelError(
            f"Layer '{name}' ({type(module).__name__}) uses flow='{module.flow}'; pyg_pipe cuts chunks by "
            f"destination vertex and supports flow='source_to_target' only. Reverse edge_index in the data "
            f"and use the default flow.")
    args, kwargs = list(args), dict(kwargs)
    cg, lg, graph = _resolve_graph(ctx, name, module, args, kwargs)
    rows = lg.rows
    node_args: List[Tuple[Any, Tensor]] = []

    def visit(value):
        """Extends one argument (or the tensors of a tuple/list argument) to the local graph."""
        if isinstance(value, (tuple, list)):
            return type(value)(visit(v) for v in value)
        if not isinstance(value, Tensor) or value.dim() == 0 or value.layout != torch.strided:
            return value
        if value.size(0) == ctx.lg.num_edges:
            return _relocalise_edges(ctx, name, cg, lg, value)
        vdim = _vertex_dim(module, value, rows)
        if vdim is None:
            return value
        node_args.append((value, vdim))
        return value

    args = [visit(a) for a in args]
    kwargs = {k: visit(v) for k, v in kwargs.items()}
    if in_backward():  # a recomputation decides as the forward did (its arguments are detached copies)
        clean = ctx.clean_calls.get((name, index), False)
    else:
        clean = all(ctx.is_clean(t) for t, _ in node_args)
        ctx.clean_calls[(name, index)] = clean
    extended = {id(t): _extend(ctx, cg, lg, t, vdim, clean) for t, vdim in node_args}

    def replace(value):
        if isinstance(value, (tuple, list)):
            return type(value)(replace(v) for v in value)
        return extended.get(id(value), value) if isinstance(value, Tensor) else value

    args = [replace(a) for a in args]
    kwargs = {k: replace(v) for k, v in kwargs.items()}
    inv = Invocation(name, index, cg, lg, clean, graph=graph)
    _swap_cache(ctx, inv, module)
    ctx.stack.append(inv)
    return tuple(args), kwargs


def _exit(module: MessagePassing, args, kwargs, output):
    ctx = active()
    if ctx is None or not ctx.stack:
        return None
    inv = ctx.stack.pop()
    if inv.parent is not None:
        return None
    _store_cache(ctx, inv, module)
    for attr, value in inv.restore.items():
        setattr(module, attr, value)
    out = _narrow(module, output, inv.lg)
    if ctx.rows_check is not None:  # what the layer returns has one row per vertex of the chunk
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, Tensor) and t.dim() > 0:
                ctx.rows_check.mark(t, _vertex_dim(module, t, inv.lg.rows))
    return out


def _narrow(module: MessagePassing, value, lg: LocalGraph):
    if isinstance(value, (tuple, list)):
        return type(value)(_narrow(module, v, lg) for v in value)
    if isinstance(value, Tensor) and value.dim() > 0:
        vdim = _vertex_dim(module, value, lg.num_local)
        if vdim is not None:
            return value.narrow(vdim, 0, lg.rows)
    return value


def _sources(name: str, args_attr: str):
    """Pre-hook of ``propagate`` / ``edge_updater``: the source arguments get their halo rows."""
    def hook(module: MessagePassing, inputs):
        ctx = active()
        if ctx is None or not ctx.stack:
            return None
        edge_index, size, kwargs = inputs
        inv = ctx.stack[-1]
        site = f"{inv.name}#{inv.index}.{inv.calls}"
        inv.calls += 1
        clean = inv.clean and not inv.propagated
        fused = args_attr == "_user_args" and module.fuse and _is_sparse(edge_index)
        if fused:
            names = [a for a in module._fused_user_args if a in kwargs]
        else:
            names = sorted({a[:-2] for a in getattr(module, args_attr) if a.endswith("_j") and a[:-2] in kwargs})
        kwargs = dict(kwargs)
        sources = []
        for arg in names:
            value = kwargs[arg]
            t = value[0] if isinstance(value, (tuple, list)) else value
            if not isinstance(t, Tensor) or t.dim() == 0:
                continue
            vdim = _vertex_dim(module, t, inv.lg.num_local)
            if vdim is None:
                if fused:
                    continue  # not a vertex tensor (an edge-level argument of message_and_aggregate)
                raise UnsupportedModelError(
                    f"Layer '{inv.name}' ({type(module).__name__}) reads '{arg}' at the sources of edges, but "
                    f"'{arg}' has shape {tuple(t.shape)} where pyg_pipe expects {inv.lg.num_local} rows along "
                    f"dimension {module.node_dim} (the chunk's local vertices). A tensor with one row per vertex of "
                    f"the whole graph (a vertex-indexed parameter, featureless input) cannot be split into chunks; "
                    f"pass per-vertex features as a forward argument instead, or train on one device.")
            sources.append(arg)
            if clean or ctx.halo is None:
                continue
            joined = ctx.halo.join(f"{site}:{arg}", inv.cg, inv.lg, t, vdim)
            kwargs[arg] = type(value)((joined, *value[1:])) if isinstance(value, (tuple, list)) else joined
        if not in_backward():
            ctx.sites.append(Site(site, tuple(sources), clean))
        return edge_index, size, kwargs
    return hook


def _propagated(module, inputs, output):
    ctx = active()
    if ctx is not None and ctx.stack:
        ctx.stack[-1].mark_propagated()
    return None


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _vertex_dim(module: MessagePassing, t: Tensor, size: int) -> Optional[int]:
    """The dimension of ``t`` that indexes vertices (``size`` of them): the layer's ``node_dim``,
    else dimension 0; ``None`` when neither has that size."""
    nd = module.node_dim if module.node_dim >= 0 else t.dim() + module.node_dim
    if 0 <= nd < t.dim() and t.size(nd) == size:
        return nd
    return 0 if t.size(0) == size else None


def _is_sparse(value) -> bool:
    return isinstance(value, Tensor) and value.layout != torch.strided or type(value).__name__ == "SparseTensor"


def _is_graph(value) -> bool:
    if not isinstance(value, Tensor):
        return type(value).__name__ == "SparseTensor"
    if value.layout != torch.strided:
        return True
    return value.dim() == 2 and value.size(0) == 2 and not value.is_floating_point() and value.dtype != torch.bool


def _resolve_graph(ctx: ChunkContext, name: str, module: MessagePassing, args: list, kwargs: dict):
    """Finds the layer's graph argument, swaps in the local graph, returns ``(cg, lg, local graph)``."""
    found = None
    for container, keys in ((args, range(len(args))), (kwargs, list(kwargs))):
        for k in keys:
            value = container[k]
            if not _is_graph(value):
                continue
            hit = ctx.graphs.resolve(value)
            if hit is None:
                raise UnsupportedModelError(
                    f"Layer '{name}' ({type(module).__name__}) receives a graph computed inside forward "
                    f"({tuple(value.shape)}), which pyg_pipe cannot cut into chunks. Compute it in the data "
                    f"pipeline and pass it to forward as an argument (e.g. data.edge_index2 = ...), or train on "
                    f"one device. Transposes (edge_index.flip(0)) and the input graph itself are understood.")
            cg, lg, local = hit
            container[k] = local
            if found is None:
                found = (cg, lg, local)
    if found is None:
        raise UnsupportedModelError(
            f"Layer '{name}' ({type(module).__name__}) was called without a graph argument (edge_index or adj_t) "
            f"that pyg_pipe handed to the model; pass the graph from the model's forward arguments.")
    return found


def _relocalise_edges(ctx: ChunkContext, name: str, cg: ChunkedGraph, lg: LocalGraph, value: Tensor):
    """Edge tensors are handed out for the primary graph; a layer on another graph (a transpose)
    gets the input edge tensors re-cut for it. Computed edge tensors cannot be re-cut."""
    if cg is ctx.cg or value.size(0) != ctx.lg.num_edges:
        return value
    whole = ctx.edge_input(value)
    if whole is None:
        raise UnsupportedModelError(
            f"Layer '{name}' runs on a transposed graph with an edge tensor computed inside forward "
            f"({tuple(value.shape)}); pyg_pipe can re-cut only edge tensors given as forward arguments.")
    return cg.local_edges(lg, whole)


def _extend(ctx: ChunkContext, cg: ChunkedGraph, lg: LocalGraph, t: Tensor, vdim: int, clean: bool) -> Tensor:
    """``t`` (chunk rows) extended to ``lg.num_local`` rows along ``vdim``."""
    if lg.halo.numel() == 0:
        return t
    if clean:
        rest = ctx.clean_rows(t)(cg, lg).to(t.dtype)
        if vdim != 0:
            rest = rest.movedim(0, vdim)
    else:
        rest = t.detach().index_select(vdim, _filler(lg, t.device))
    return torch.cat([t, rest], dim=vdim)


def _filler(lg: LocalGraph, device) -> Tensor:
    """Rows used for the local vertices beyond the chunk before the exchange fills them: copies of
    chunk rows (finite, realistic values; they never reach a chunk row)."""
    fill = getattr(lg, "_filler", None)
    if fill is None:
        fill = torch.arange(lg.halo.numel(), device=device) % lg.rows
        lg._filler = fill
    return fill


_SIGNATURES: Dict[type, inspect.Signature] = {}


def _signature(module) -> inspect.Signature:
    cls = type(module)
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(module.forward)
    return _SIGNATURES[cls]


def _swap_cache(ctx: ChunkContext, inv: Invocation, module) -> None:
    """``cached=True`` layers get one cache per chunk local graph (their own cache is put back after)."""
    if not getattr(module, "cached", False):
        return
    mine = ctx.cache.get((id(module), id(inv.cg), inv.lg.index), {})
    for attr in [k for k in vars(module) if k.startswith("_cached")]:
        inv.restore.setdefault(attr, getattr(module, attr))
        setattr(module, attr, mine.get(attr))


def _store_cache(ctx: ChunkContext, inv: Invocation, module) -> None:
    if getattr(module, "cached", False):
        ctx.cache[(id(module), id(inv.cg), inv.lg.index)] = {
            k: getattr(module, k) for k in vars(module) if k.startswith("_cached")}
