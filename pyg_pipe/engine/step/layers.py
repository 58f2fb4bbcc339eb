"""Unchanged PyG layers on a chunk: the hooks around every ``MessagePassing`` call.

The user's forward runs as ordinary Python on a chunk's rows (tensors with one row per chunk vertex;
:mod:`pyg_pipe.model.inputs` hands them out). Neighbour access happens only inside ``MessagePassing`` layers, and
these hooks adapt each call to the chunk's local graph (:mod:`pyg_pipe.graph.chunks`):

1. **layer entry** (forward pre-hook): the graph argument is resolved to the chunk's local graph
   (a local ``edge_index`` or sparse ``adj_t`` handed out with the inputs, the whole-graph tensor
   itself, or its transpose ``edge_index.flip(0)``). Then one of two:

   * *clean* call (every node argument is an input handed out for the chunk, unchanged): node tensors are extended to
     the local graph's ``num_local`` rows with their **true** halo rows (from the whole input), the layer runs on
     the whole local graph, and its sources need no exchange (the first layer of a model reads the input features;
     streaming, a call whose propagates read exactly those inputs computes its rows only after its first chunk:
     :mod:`.direct`);
   * otherwise the layer computes **the chunk's rows only**: node tensors stay ``[rows]``, the graph is the *row graph*
     (the local edges into the chunk's rows, a ``[rows, num_local]`` adjacency), and edge tensors are cut to those
     edges. Nothing is computed for halo vertices.

   Degrees the layer computes are completed by :mod:`.degrees` (whole local graph if it counts them itself). A layer
   with ``flow="target_to_source"`` (aggregating at ``edge_index[0]``) is the transposed graph's layer: it gets the
   transpose's chunk, in its own orientation, and always the whole local graph (:func:`~.arguments.reversed_graphs`).
2. **each propagate / edge_updater call** (pre-hook): the arguments the layer reads at edge sources (``x`` for
   ``x_j``; the matrix of ``message_and_aggregate`` for sparse adjacencies) get their true halo rows
   (:mod:`..runtime.halo`): ``[rows | halo]``. In a rows-only call a source read at both ends (``x_i`` and ``x_j``)
   is passed as the pair ``(rows | halo, rows)`` with ``size=(num_local, rows)``, as PyG passes bipartite inputs, so
   messages and aggregation produce the chunk's rows. That call is a *call site*, named ``module#invocation.call``;
   K-hop layers have K sites.
3. **layer exit** (forward hook): the outputs are cut back to the chunk's rows (clean calls).

Which argument is a node tensor and which an edge tensor is decided by what it is: an edge input handed out for the
chunk, else its row count; with as many chunk rows as local edges, by the parameter's name (PyG's per-edge: ``edge_*``).

Which extended rows are already right is decided by structure, never by values: a node argument is *clean* when it
is one of the inputs handed out for this chunk, unchanged (its halo rows are then the true input rows); a call
site's sources are clean when every node argument of the layer call was clean and no propagate of that call has
returned yet. Clean sources need no exchange and no history (the first layer of a model reads the input features).
Everything else is exchanged.

Layers holding graph-wide statistics (a BatchNorm in a message MLP) get hooks around ``message`` / ``edge_update``
(:mod:`.norms`), aggregations that depend on the whole graph see it (:mod:`.aggregations`); :mod:`.arguments`: what
each argument of a call is, and what it becomes."""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch_geometric.nn import MessagePassing

from ...model.errors import UnsupportedModelError
from ...model.norms import needs_statistics
from ..context import ChunkContext, Invocation, Site, current
from . import aggregations, degrees, update
from .arguments import (argument_kind, clean_input, each, edge_chunking, extend, is_sparse, narrow, parameter_names,
                        reads_edge_ids, relocalise_edges, resolve_graphs, reversed_graphs, reversed_pairs, row_graph,
                        source_names, vertex_dim, vertex_ids)
from .layer_cache import store_cache, swap_cache


class LayerHooks:
    """Installs the hooks on every ``MessagePassing`` module of ``model`` (and removes them).

    Outside the engine (no current :class:`~..context.ChunkContext`) the hooks do
    nothing, so the model keeps working as a plain single-device model; ``outside(name, module)``, when
    given, is told of every such call first (the engine refuses one inside a training step: a layer run
    outside the routed forward would train undistributed).
    """

    def __init__(self, model: torch.nn.Module, outside: Optional[Callable[[str, MessagePassing], None]] = None,
                 plan: Optional[Callable[[], object]] = None):
        self.model = model
        self.outside = outside
        self.plan = plan  # the engine's plan once it has one (``None``: no engine runs the model)
        self.handles: list = []
        self.patched: List[MessagePassing] = []

    def install(self) -> None:
        if self.handles:
            return
        degrees.install(type(m).forward for m in self.model.modules() if isinstance(m, MessagePassing))
        self.handles.append(_DegreesInstalled())
        for name, m in self.model.named_modules():
            if not isinstance(m, MessagePassing):
                continue
            # PyG's generated (jinja) edge_updater calls its pre-hooks after lifting the arguments to
            # the edges; its plain one, which PyG itself switches to for explanations, calls them before
            if hasattr(type(m), "_orig_edge_updater"):
                m.edge_updater = type(m)._orig_edge_updater.__get__(m, type(m))
                self.patched.append(m)
            if hasattr(type(m), "get_attention_loss") and _whole_local_graph(type(m)):
                m.get_attention_loss = _attention_loss(name, m, self.plan)
                self.patched.append(m)
            self.patched += aggregations.install(name, m) + update.install(m)
            stats = any(needs_statistics(s) for s in m.modules())
            self.handles += [
                m.register_forward_pre_hook(_entry(name, self.outside), with_kwargs=True),
                m.register_forward_hook(_exit, with_kwargs=True, always_call=True),
                m.register_propagate_forward_pre_hook(_sources(name, "_user_args", False)),
                m.register_propagate_forward_hook(_propagated),
                m.register_edge_update_forward_pre_hook(_sources(name, "_edge_user_args", stats)),
            ]
            if stats:  # statistics inside the layer may run over its edges
                self.handles += [m.register_message_forward_pre_hook(_edges(True)),
                                 m.register_message_forward_hook(_edges(False)),
                                 m.register_edge_update_forward_hook(_edges(False))]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for m in self.patched:  # (layers' edge_updater, get_attention_loss, update; aggregations' own)
            for attr in ("edge_updater", "get_attention_loss", "update") if isinstance(m, MessagePassing) \
                    else aggregations.ATTRS:
                m.__dict__.pop(attr, None)
        self.handles, self.patched = [], []


class _DegreesInstalled:
    """The handle of :func:`degrees.install`: removing it uninstalls."""

    def remove(self):
        degrees.uninstall()


# ---------------------------------------------------------------------------------------------
# hooks
# ---------------------------------------------------------------------------------------------


def _entry(name: str, outside=None):
    def hook(module: MessagePassing, args: tuple, kwargs: dict):
        ctx = current()
        if ctx is None:
            if outside is not None:
                outside(name, module)
            return None
        if ctx.recomputing():  # recomputed during backward (checkpointing, reversible blocks): the forward's call
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
            if (module.flow == "target_to_source") != parent.reverse:
                raise UnsupportedModelError(
                    f"Layer '{name}' ({type(module).__name__}, flow='{module.flow}') runs inside layer "
                    f"'{parent.name}', which aggregates the other way; pyg_pipe hands an inner layer its outer "
                    f"layer's local graph. Give both the same flow, or call the inner layer from the model's forward.")
            ctx.stack.append(Invocation(name, index, parent.cg, parent.lg, parent.clean and not parent.propagated,
                                        parent=parent, graphs=parent.graphs, rows_only=parent.rows_only,
                                        reverse=parent.reverse))
            return None
        with ctx.engine_work():
            return _enter(ctx, name, index, module, args, kwargs)
    return hook


def _enter(ctx: ChunkContext, name: str, index: int, module: MessagePassing, args: tuple, kwargs: dict):
    args, kwargs = list(args), dict(kwargs)
    cg, lg, graphs = resolve_graphs(ctx, name, module, args, kwargs)
    reverse = module.flow == "target_to_source"
    if reverse:
        cg, lg, graphs = reversed_graphs(ctx, name, module, graphs)
    several = len(graphs) > 1 and len({id(h[0]) for h in graphs.values()}) > 1   # graphs with halos of their own
    node_args: List[Tuple[Tensor, int]] = []
    edge_args: Dict[int, Tensor] = {}
    names = parameter_names(module, len(args))
    if type(module).__name__ in IDS_WHEN_NONE:  # featureless: x=None stands for the vertex ids (a chunk has its own)
        if "x" in names and args[names.index("x")] is None:
            args[names.index("x")] = vertex_ids(ctx, cg, lg)
        elif kwargs.get("x", 0) is None:
            kwargs["x"] = vertex_ids(ctx, cg, lg)

    def visit(value, param: str):
        """Classifies one tensor argument (edge tensors re-cut for a transposed graph)."""
        if not isinstance(value, Tensor) or id(value) in graphs or value.dim() == 0 or value.layout != torch.strided:
            return value
        kind, vdim = argument_kind(ctx, module, value, param)
        if kind == "edge":
            ecg, elg = edge_chunking(ctx, name, graphs, value) if several else (cg, lg)
            value = relocalise_edges(ctx, name, ecg, elg, value)
            edge_args[id(value)] = (value, elg)
        if kind == "node":
            node_args.append((value, vdim))
        return value

    args = [each(a, visit, n) for a, n in zip(args, names)]
    kwargs = {k: each(v, visit, k) for k, v in kwargs.items()}
    if ctx.recomputing():  # a recomputation decides as the forward did (its arguments are detached copies)
        clean = ctx.clean_calls.get((name, index), False)
    else:
        clean = all(ctx.is_clean(t) for t, _ in node_args)
        ctx.clean_calls[(name, index)] = clean
    if several and _whole_local_graph(type(module)):
        raise UnsupportedModelError(
            f"Layer '{name}' ({type(module).__name__}) is given several graphs and reads vertex rows outside "
            f"propagate; pyg_pipe runs such a layer on one local graph only. Give it one graph.")
    if several and reverse:
        raise UnsupportedModelError(
            f"Layer '{name}' ({type(module).__name__}) uses flow='target_to_source' and is given several graphs; "
            f"pyg_pipe runs such a layer on one graph only. Give it one graph, or use the default flow.")
    # several graphs: each propagate joins its own graph's halo to the chunk's rows; flow="target_to_source": the whole
    # local graph (PyG reads its pairs differently in its two propagates); direct: a streamed clean call (.direct)
    direct = clean and not several and ctx.direct is not None and ctx.direct.rows_only(name, index, lg.index)
    whole = _whole_local_graph(type(module)) or reverse or (degrees.counts_degrees(module) and not several)
    rows_only = (not clean or several or direct) and not whole
    if not rows_only:  # the whole local graph: true halo rows (clean), or fillers the propagate replaces
        swap = {id(t): extend(ctx, cg, lg, t, vdim, clean) for t, vdim in node_args}
        used = {i: local for i, (_, _, local) in graphs.items()}
    else:  # the chunk's rows only: the row graph, and edge tensors cut to its edges
        swap = {}
        for i, (t, elg) in edge_args.items():
            swap[i] = t.narrow(0, 0, elg.row_edges)
            whole = ctx.edge_input(t)
            if whole is not None:  # still the input's edges (degrees, transposes re-cut them from it)
                ctx.add_edge_input(swap[i], whole, ctx.edge_chunking(t))
        used = {i: row_graph(ctx, cg2, lg2, local) for i, (cg2, lg2, local) in graphs.items()}
    node_args.clear()
    edge_args.clear()

    def replace(value, _):
        if not isinstance(value, Tensor):
            return value
        hit = used.get(id(value))
        if hit is not None:
            return hit
        return swap.get(id(value), value)

    args = [each(a, replace) for a in args]
    kwargs = {k: each(v, replace) for k, v in kwargs.items()}
    inv = Invocation(name, index, cg, lg, clean, rows_only=rows_only, reverse=reverse,
                     graphs={id(g): (g, cg2, lg2, True) for g, (cg2, lg2, _) in
                             ((used[i], graphs[i]) for i in graphs)},
                     extended=tuple(swap.values()) if clean and not rows_only else ())
    swap_cache(ctx, inv, module)
    ctx.stack.append(inv)
    return tuple(args), kwargs


#: layers that take ``x=None`` for "no features: the vertex ids" (PyG's R-GCN layers build ``arange(N)`` then):
#: on a chunk they are handed the chunk's vertex ids instead (:func:`~.arguments.vertex_ids`)
IDS_WHEN_NONE = ("RGCNConv", "FastRGCNConv")


#: layers whose forward reads node rows at the ends of edges outside ``propagate`` (SuperGATConv's attention
#: loss indexes ``x`` by sampled edges): they run on the whole local graph, their halo rows filled with copies
#: of chunk rows that only those reads see (the propagate replaces them with the true rows)
WHOLE_LOCAL_GRAPH = ("SuperGATConv",)


@functools.lru_cache(maxsize=None)
def _whole_local_graph(cls: type) -> bool:
    return any(c.__name__ in WHOLE_LOCAL_GRAPH for c in cls.__mro__)


def _attention_loss(name: str, module: MessagePassing, plan: Optional[Callable[[], object]]) -> Callable[[], Tensor]:
    """``SuperGATConv.get_attention_loss`` under the engine. The loss reads the attention logits the layer
    computed last (``att_x``): inside the engine's run of the model, where with chunks they are the last chunk's
    or way's edges read from filler halo rows, on a pipeline only the layer's stage has them, and the engine has
    run its own backward through them already (a loss built on them would fail or be wrong, even with one chunk).
    So in training it is refused by name, on every rank (each rank's training step makes the call), before the
    loss is used; in eval mode PyG's answer (0) stands."""
    own = type(module).get_attention_loss.__get__(module, type(module))

    def get_attention_loss() -> Tensor:
        p = plan() if plan is not None else None
        if module.training and p is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} '{name}': get_attention_loss() reads the attention logits the layer "
                f"computed inside pyg_pipe's run of the model ({p.stages} stage(s), {p.num_chunks} chunk(s)), "
                f"which are the last chunk's, read from filler halo rows, and which pyg_pipe has already run its "
                f"backward through: an auxiliary loss built on them would be wrong or fail. Leave the attention "
                f"loss out of the training loss under pyg_pipe (the layer itself runs exactly), or train with it "
                f"without pyg_pipe, on one device.")
        return own()
    return get_attention_loss


def _exit(module: MessagePassing, args, kwargs, output):
    ctx = current()
    if ctx is None or not ctx.stack:
        return None
    inv = ctx.stack.pop()
    if inv.parent is not None:
        return None
    if ctx.direct is not None:
        ctx.direct.unread(inv)
    with ctx.engine_work():
        store_cache(ctx, inv, module)
        for attr, value in inv.restore.items():
            setattr(module, attr, value)
        out = narrow(module, output, inv.lg)
    if ctx.observer is not None:  # what the layer returns: rows of the chunk's vertices, or of its edges
        ctx.observer.layer_returned(out, lambda t: vertex_dim(module, t, inv.lg.rows), inv.reverse)
    return out


def _sources(name: str, args_attr: str, stats: bool):
    """Pre-hook of ``propagate`` / ``edge_updater``: the source arguments get their halo rows."""
    def hook(module: MessagePassing, inputs):
        ctx = current()
        if ctx is None or not ctx.stack:
            return None
        edge_index, size, kwargs = inputs
        inv = ctx.stack[-1]
        inv.edge_graph = edge_index
        cg, lg = inv.chunking(edge_index)
        site = f"{inv.name}#{inv.index}.{inv.calls}"
        inv.calls += 1
        clean = inv.clean and not inv.propagated
        fused = args_attr == "_user_args" and module.fuse and is_sparse(edge_index)
        names = source_names(module, args_attr, fused, kwargs)
        kwargs = dict(kwargs)
        sources = []
        width = lg.rows if inv.rows_only else lg.num_local   # rows of a source before its halo is joined
        j = 0  # which tensor of a pair x_j is read from
        if inv.reverse:
            j, kwargs = reversed_pairs(module, args_attr, kwargs)
        for arg in names:
            value = kwargs[arg]
            t = value[j] if isinstance(value, (tuple, list)) else value
            if not isinstance(t, Tensor) or t.dim() == 0:
                continue
            vdim = vertex_dim(module, t, width)
            if vdim is None and not inv.rows_only and lg.rows != width and clean_input(ctx, t):
                vdim = vertex_dim(module, t, lg.rows)  # a vertex table read inside the layer (SparseLinear's
                if vdim is not None:                   # weight): its chunk's rows, joined with their true halo rows
                    joined = extend(ctx, cg, lg, t, vdim, True)
                    kwargs[arg] = type(value)((*value[:j], joined, *value[j + 1:])) \
                        if isinstance(value, (tuple, list)) else joined
                    sources.append(arg)
                    continue
            if vdim is None:
                if fused:
                    continue  # not a vertex tensor (an edge-level argument of message_and_aggregate)
                raise UnsupportedModelError(
                    f"Layer '{inv.name}' ({type(module).__name__}) reads '{arg}' at the sources of edges, but '{arg}' "
                    f"has shape {tuple(t.shape)} where pyg_pipe expects {width} rows along dimension {module.node_dim} "
                    f"(the chunk's {'rows' if inv.rows_only else 'local vertices'}). A tensor with one row per vertex "
                    f"of the whole graph (a vertex-indexed parameter, featureless input) cannot be split into chunks; "
                    f"pass per-vertex features as a forward argument instead, or train on one device.")
            sources.append(arg)
            if ctx.direct is not None:
                ctx.direct.observe(inv, t)
            if not t.is_floating_point() and cg.num_chunks > 1 and reads_edge_ids(module):
                raise UnsupportedModelError(
                    f"Layer '{inv.name}' ({type(module).__name__}) is given integer vertex features ('{arg}', node "
                    f"indices) and its message reads the edge_index itself (edge_index_i / edge_index_j) to "
                    f"look them up; on a cut graph those are positions in the chunk's local graph, not vertex ids. "
                    f"Use a layer that reads the indices through '{arg}' (RGCNConv instead of FastRGCNConv), or give "
                    f"float features.")
            if inv.rows_only and clean and clean_input(ctx, t):  # the model's input: its true halo rows
                joined = extend(ctx, cg, lg, t, vdim, True)
            elif ctx.halo is None or (clean and not inv.rows_only):  # no halo, or true halo rows already
                if ctx.observer is not None:  # (not for values computed from sums over the edges: refused)
                    ctx.observer.partial_sources(inv, inv.name, [t])
                continue
            else:
                joined = ctx.halo.join(f"{site}:{arg}", cg, lg, t, vdim)
            if isinstance(value, (tuple, list)):
                kwargs[arg] = type(value)((*value[:j], joined, *value[j + 1:]))
            elif inv.rows_only and not fused and module.decomposed_layers == 1:  # sources [rows | halo], dest. [rows]
                #                                          (decomposed layers split x, not a pair: x_j read only)
                kwargs[arg] = pair = (joined, t)
                update.keep(inv, module, pair, t)  # (what an update() reading it gets: the chunk's rows)
            else:
                kwargs[arg] = joined
        if inv.rows_only and not fused and lg.rows != lg.num_local:
            size = (lg.num_local, lg.rows)
        elif size is not None and not fused:  # given as on one device (x.size(0), the vertex count): the local graph's
            size = tuple(lg.num_local if s in (lg.rows, cg.num_nodes) else s for s in size)
        if not ctx.recomputing():
            ctx.sites.append(Site(site, tuple(sources), clean))
        if stats:  # edge_updater: edge_update computes per-edge values next
            inv.in_edges = True
        return edge_index, size, kwargs
    return hook


def _propagated(module, inputs, output):
    ctx = current()
    if ctx is not None and ctx.stack:
        ctx.stack[-1].mark_propagated()
    return None


def _edges(inside: bool):
    """Hooks around ``message`` / ``edge_update``: statistics computed in between run over edges."""
    def hook(module, *_):
        ctx = current()
        if ctx is not None and ctx.stack:
            ctx.stack[-1].in_edges = inside
        return None
    return hook
