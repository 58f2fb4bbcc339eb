"""Fused Gather for PyG layers given an ``edge_index``: ``fuse_messages(model)``.

PyG's ``MessagePassing`` with an ``edge_index`` lifts every ``x_j`` to the edges (``x[src]``, an
``[E, d]`` tensor), calls ``message`` and scatters the result into the destinations. Most layers' message
is the source row itself or the source row times a per-edge weight::

    GCNConv, GCN2Conv, GraphConv   edge_weight.view(-1, 1) * x_j        (x_j without weights)
    SAGEConv, GINConv              x_j
    GATConv                        alpha.unsqueeze(-1) * x_j            (a weight per edge and head)

For those, the lift, the message and the aggregation are one :func:`~pyg_pipe.ops.csr_aggregate` over
the CSR of the graph the layer sees (built once per graph, cached by the index tensors' identity): no
``[E, d]`` tensor, forward or backward. Which layers qualify is read off ``message`` itself, traced with
``torch.fx`` once per layer and per pattern of ``None`` arguments (:func:`pyg_pipe.ops.rewrite.compile_message`):
the message must be a ``*_j`` argument, optionally times a weight computed from arguments that are not
vertex data. The aggregation must be PyG's own ``sum``/``add``, ``mean`` or ``max``, and the layer must not
override ``aggregate``. Anything else, or a call whose tensors do not fit (dtype, shapes), runs PyG's
path unchanged; so does every call while PyG explains a model or decomposes a layer.

How: per layer, instance attributes (bound methods, so ``copy.deepcopy`` rebinds them to the copy) of
``_index_select`` (lifts become lazy :class:`Lifted` views during ``propagate``'s collect step),
``message`` (returns the :class:`Deferred` Gather instead of messages) and ``aggregate`` (runs it); a
propagate pre-hook switches the lazy lifts on for one call. ``fuse_messages`` returns a handle whose
``remove()`` takes all of it away. The same objects serve :class:`pyg_pipe.saga.SAGALayer`.

    handle = pyg_pipe.ops.fuse_messages(model)    # every qualifying MessagePassing layer of model
    ...
    handle.remove()
"""
from __future__ import annotations

import types
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .aggregate import csr_aggregate

__all__ = ["Deferred", "Lifted", "csr_of", "fuse_messages", "per_head"]

_REDUCE = {"sum": "sum", "add": "sum", "mean": "mean", "max": "max"}
_DTYPES = (torch.float32, torch.float64)


class Lifted:
    """A vertex tensor standing for its rows at one end of every edge (``t[index]``), not gathered."""

    __slots__ = ("t", "index")

    def __init__(self, t: Tensor, index: Tensor):
        self.t, self.index = t, index

    def lift(self) -> Tensor:
        return self.t.index_select(0, self.index)


class Deferred:
    """What a fused ``message`` hands to ``aggregate``: the gathered vertex tensor, its edge weights, and
    how to build the messages after all (``fallback``) when this call cannot be fused."""

    __slots__ = ("value", "weight", "fallback")

    def __init__(self, value: Lifted, weight: Optional[Tensor], fallback: Callable[[], Tensor]):
        self.value, self.weight, self.fallback = value, weight, fallback


# ---- the CSR of the graph a layer sees, cached ------------------------------------------------------
_CSR_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_CSR_CACHE_SIZE = 64


def csr_of(index_i: Tensor, index_j: Tensor, size_i: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(rowptr, col, perm)``: the edges sorted by destination (stable), ``perm[k]`` the edge at CSR
    position ``k``. Cached by the index tensors' memory (address, length, strides, version counter); the
    entry keeps them alive, so their addresses cannot be reused by another graph while it is cached."""
    key = (index_i.device, index_i.data_ptr(), index_i.numel(), index_i._version, index_i.stride(0),
           index_j.data_ptr(), index_j._version, index_j.stride(0), size_i)
    hit = _CSR_CACHE.get(key)
    if hit is not None:
        _CSR_CACHE.move_to_end(key)
        return hit[2:]
    perm = torch.argsort(index_i, stable=True)
    col = index_j.index_select(0, perm)
    rowptr = torch.zeros(size_i + 1, dtype=torch.long, device=index_i.device)
    rowptr[1:] = torch.cumsum(torch.bincount(index_i, minlength=size_i), 0)
    _CSR_CACHE[key] = (index_i, index_j, rowptr, col, perm)
    while len(_CSR_CACHE) > _CSR_CACHE_SIZE:
        _CSR_CACHE.popitem(last=False)
    return rowptr, col, perm


_ORDERED: "OrderedDict[tuple, tuple]" = OrderedDict()
_ORDERED_BYTES = 256 * 2**20   # (weights kept in CSR order, beside the layers' own: at most this many bytes)


def clear_cache() -> None:
    """Forget the cached CSRs of the graphs layers saw and the weights put in their order."""
    _CSR_CACHE.clear()
    _ORDERED.clear()


def held() -> list:
    """Every tensor these caches hold now (as :func:`.transpose.held`: for a CUDA graph captured now to keep)."""
    return [t for cache in (_CSR_CACHE, _ORDERED) for entry in cache.values() for t in entry]


def in_csr_order(w: Tensor, perm: Tensor) -> Tensor:
    """``w[perm]``: per-edge weights in the CSR's order, kept for the same ``w`` and ``perm`` (the entry holds
    both, so the same address, shape, strides and version counter mean the same weights): a layer's constant
    weights (GCN's normalisation, cached, or the engine's per chunk) are permuted once, not at every call, and the
    kernel's backward then finds its own weights' cache for them (:mod:`.transpose`). At most 64 entries and 256 MiB,
    least recently used out first. Weights that require a gradient are permuted at every call (a result kept would
    carry an old autograd graph)."""
    if w.requires_grad and torch.is_grad_enabled():
        return w.index_select(0, perm)
    key = (w.device, w.data_ptr(), w.shape, w.stride(), w.dtype, w._version, perm.data_ptr(), perm.numel())
    hit = _ORDERED.get(key)
    if hit is not None:
        _ORDERED.move_to_end(key)
        return hit[2]
    out = w.detach().index_select(0, perm)
    _ORDERED[key] = (w, perm, out)
    total = sum(e[2].numel() * e[2].element_size() for e in _ORDERED.values())
    while len(_ORDERED) > 1 and (len(_ORDERED) > _CSR_CACHE_SIZE or total > _ORDERED_BYTES):
        old = _ORDERED.popitem(last=False)[1][2]
        total -= old.numel() * old.element_size()
    return out


def per_head(fn: Callable[[Tensor, Optional[Tensor]], Tensor], s: Tensor, w: Optional[Tensor]) -> Tensor:
    """``fn(values [N, C], weights [E] or None)`` for 2-D ``s``, or once per head of ``s [N, H, C]``
    (``w``: ``[E, H]``)."""
    if s.dim() == 2:
        return fn(s, None if w is None else w[:, 0].contiguous())
    return torch.stack([fn(s[:, h].contiguous(), None if w is None else w[:, h].contiguous())
                        for h in range(s.size(1))], dim=1)


def gather(s: Tensor, w: Optional[Tensor], index_i: Tensor, index_j: Tensor, size_i: int,
           reduce: str) -> Optional[Tensor]:
    """``REDUCE_{edges j -> i} w_e · s[j]`` through the fused kernel, or ``None`` when the tensors do not fit
    (``s``: ``[N, C]`` or ``[N, H, C]`` float32/float64; ``w``: one number per edge, or per edge and head)."""
    if s.dtype not in _DTYPES or s.dim() not in (2, 3):
        return None
    heads = s.size(1) if s.dim() == 3 else 1
    if w is not None:
        if not isinstance(w, Tensor) or w.dim() == 0 or w.size(0) != index_i.numel() \
                or w.numel() != w.size(0) * heads or not w.dtype.is_floating_point:
            return None
    rowptr, col, perm = csr_of(index_i, index_j, size_i)
    if w is not None:
        w = in_csr_order(w.reshape(w.size(0), heads), perm)
    return per_head(lambda t, wh: csr_aggregate(rowptr, col, t, value=wh, reduce=reduce), s, w)


# ---- PyG layers -----------------------------------------------------------------------------------

class _Fused:
    """The fused Gather of one layer (module docstring)."""

    def __init__(self, module):
        self.module = module
        # where each message argument comes from in propagate's kwargs (x for x_j), read once
        self.sources = [(p, p[:-2] if p[-2:] in ("_i", "_j") else p)
                        for p in module.inspector.get_param_names("message")]
        self.routes: Dict[tuple, Any] = {}
        self.route = None      # the route of the call in progress
        self.lazy = False
        self.calls = 0         # calls fused (tests and curious users)

    def route_for(self, kwargs: dict):
        from .rewrite import compile_message
        none = tuple(p for p, source in self.sources if kwargs.get(source, 0) is None)
        if none not in self.routes:
            self.routes[none] = compile_message(self.module, none)
        return self.routes[none]


def _eligible(m) -> bool:
    from torch_geometric.nn import MessagePassing
    from torch_geometric.nn.aggr import MaxAggregation, MeanAggregation, SumAggregation
    return (isinstance(m, MessagePassing) and isinstance(m.aggr, str) and m.aggr in _REDUCE
            and type(m.aggr_module) in (SumAggregation, MeanAggregation, MaxAggregation)
            and type(m).aggregate is MessagePassing.aggregate and getattr(m, "decomposed_layers", 1) == 1
            and not m._message_forward_hooks and not m._aggregate_forward_pre_hooks)


def _pre_propagate(module, inputs):
    """Before a ``propagate``: this call's route, and lazy lifts when it has one (the state is read from
    the module, so a deep copy's hook serves the copy)."""
    state = module.__dict__.get("_pyg_pipe_fused")
    if state is not None:
        edge_index = inputs[0]
        # a sparse adjacency with message_and_aggregate never calls message: PyG's (or ops.install's) path
        sparse = not isinstance(edge_index, Tensor) or edge_index.layout != torch.strided
        explaining = bool(getattr(module, "explain", False))
        state.route = None if explaining or (sparse and module.fuse) else state.route_for(inputs[2])
        state.lazy = state.route is not None
    return None


def _index_select(self, src: Tensor, index: Tensor):
    state = self._pyg_pipe_fused
    if state.lazy and (self.node_dim == 0 or self.node_dim == -src.dim()):   # vertices along dimension 0
        return Lifted(src, index)
    return type(self)._index_select(self, src, index)


def _message(self, **kwargs):
    state = self._pyg_pipe_fused
    state.lazy = False
    route, original = state.route, type(self).message

    def fallback():
        return original(self, **{k: v.lift() if isinstance(v, Lifted) else v for k, v in kwargs.items()})

    value = kwargs.get(route.value) if route is not None else None
    if not isinstance(value, Lifted):
        return fallback()
    weight = None
    if route.weight is not None:
        from .rewrite import run_graph
        names = {n.target for n in route.weight.nodes if n.op == "placeholder"}
        weight = run_graph(route.weight, self, {k: kwargs[k] for k in names})
    return Deferred(value, weight, fallback)


def _aggregate(self, inputs, index: Tensor, ptr: Optional[Tensor] = None, dim_size: Optional[int] = None):
    original = type(self).aggregate
    if isinstance(inputs, Deferred):
        out = gather(inputs.value.t, inputs.weight, index, inputs.value.index, dim_size, _REDUCE[self.aggr]) \
            if dim_size is not None else None
        if out is not None:
            self._pyg_pipe_fused.calls += 1
            return out
        inputs = inputs.fallback()
    return original(self, inputs, index, ptr=ptr, dim_size=dim_size)


class FusedMessages:
    """The handle :func:`fuse_messages` returns; ``remove()`` restores every layer."""

    def __init__(self):
        self.modules: List[Any] = []
        self.handles: list = []

    @property
    def fused_calls(self) -> int:
        return sum(m._pyg_pipe_fused.calls for m in self.modules if hasattr(m, "_pyg_pipe_fused"))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for m in self.modules:
            for attr in ("_index_select", "message", "aggregate", "_pyg_pipe_fused"):
                m.__dict__.pop(attr, None)
        self.modules, self.handles = [], []


def fuse_messages(model: torch.nn.Module) -> FusedMessages:
    """Routes the Gather of every qualifying ``MessagePassing`` layer of ``model`` through the fused kernel
    (module docstring); layers that do not qualify, and layers already fused, are left as they are."""
    handle = FusedMessages()
    for m in model.modules():
        if not _eligible(m) or getattr(m, "gathers_fused", False) or "_pyg_pipe_fused" in m.__dict__:
            continue
        m.__dict__["_pyg_pipe_fused"] = _Fused(m)
        for name, fn in (("_index_select", _index_select), ("message", _message), ("aggregate", _aggregate)):
            m.__dict__[name] = types.MethodType(fn, m)
        handle.handles.append(m.register_propagate_forward_pre_hook(_pre_propagate))
        handle.modules.append(m)
    return handle
