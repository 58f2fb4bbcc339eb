"""``SAGALayer``: a GNN layer written as NGra's four SAGA stages, run as an ordinary PyG ``MessagePassing``.

::

    Scatter       vertex data to the edges:        src = x[j], dst = x[i] for every edge j -> i
    ApplyEdge     a network per edge:              m = apply_edge(src, dst, edge_attr, index, size_i)
    Gather        aggregate at the destination:    g[i] = gather_{j -> i} m            (sum / mean / max, ...)
    ApplyVertex   a network per vertex:            out = apply_vertex(x, g)

A subclass defines ``apply_edge`` (any of the parameters above) and ``apply_vertex``, and chooses
``gather``. At its first call the layer compiles ``apply_edge`` (:mod:`pyg_pipe.ops.rewrite`): the
parts that read one end through row-wise operations move before Scatter (NGra's rewrite; computed
per vertex), the rest runs per edge; then Gather takes one of four routes, read off the program::

    copy      m = s_j                        csr_aggregate(s)                        fused kernel
    weighted  m = w_e * s_j                  csr_aggregate(s, value=w)               fused kernel
    gated     m = sigmoid(d_i + s_j) * v_j   csr_gated_aggregate(d, s, v)            fused kernel
    edges     anything else                  PyG: messages per edge, then aggregate

(``s``, ``v``: values computed per source vertex; ``d``: per destination vertex; ``w``: a per-edge
scalar, per head for ``[E, H]``). The fused routes never build the ``[E, d]`` message tensor; they
serve ``sum``/``mean``/``max`` (``gated``: ``sum``/``mean``) and float32/float64, and build the CSR of
the graph they see once (cached by the index tensors' identity). Every route computes the same
function, so a SAGA layer is exact wherever PyG is: in plain PyG and in every pyg_pipe mode, where
the engine's hooks give the per-vertex values that travel (``vs``) their halo rows like any source.

Inside ``propagate`` the per-source values travel as one tensor ``vs`` (read as ``vs_j``) and the
per-destination ones as ``vd`` (``vd_i``). ``message`` receives them unlifted and lifts each value to
the edges on its own (one ``index_select`` per value), or not at all on a fused route.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor
from torch_geometric.nn import MessagePassing

from ..ops import csr_aggregate, csr_gated_aggregate
from ..ops.messages import Lifted, csr_of, per_head
from ..ops.rewrite import SAGAProgram, compile_apply_edge, run_graph

_FUSED_AGGR = {"sum": "sum", "add": "sum", "mean": "mean", "max": "max"}
_FUSED_DTYPES = (torch.float32, torch.float64)


def _columns(packed: Lifted, offset: int, shape: Tuple[int, ...]) -> Tensor:
    """The vertex value at ``offset`` in a packed tensor, one row per vertex, in its own shape."""
    return _unpack(packed.t, offset, shape)


class _Gathered:
    """What ``message`` hands to ``aggregate`` when a fused route aggregated already."""

    __slots__ = ("out",)

    def __init__(self, out: Tensor):
        self.out = out


def _unpack(packed: Tensor, offset: int, shape: Tuple[int, ...]) -> Tensor:
    width = math.prod(shape)
    if packed.dim() == 1 + len(shape) and offset == 0 and tuple(packed.shape[1:]) == shape:
        return packed
    return packed.narrow(1, offset, width).reshape(packed.size(0), *shape)


class SAGALayer(MessagePassing):
    """Base class of SAGA-NN layers (module docstring).

    Args:
        gather: the Gather, any PyG aggregation (``"sum"``, ``"mean"`` and ``"max"`` have fused routes).
        rewrite: move the per-vertex parts of ``apply_edge`` before Scatter (on by default; off runs
            ``apply_edge`` on every edge, as written).
        fused: aggregate through the fused kernels where the route allows it (off: PyG's aggregation).
        **kwargs: as for :class:`torch_geometric.nn.MessagePassing` (``node_dim`` is 0).
    """

    #: the layer routes its own Gather to the fused kernels (:func:`pyg_pipe.ops.fuse_messages` leaves it be)
    gathers_fused = True

    def __init__(self, gather: str = "sum", rewrite: bool = True, fused: bool = True, **kwargs: Any):
        kwargs.setdefault("node_dim", 0)
        super().__init__(aggr=gather, **kwargs)
        self.gather, self.rewrite, self.fused = gather, rewrite, fused
        self._saga: Optional[Tuple[SAGAProgram, Dict[str, Any]]] = None
        self._lazy = False
        self.last_route: Optional[str] = None   # the route the last call took (a call may leave a fused one)

    # -- the user's stages --------------------------------------------------------------------
    def apply_edge(self, src: Tensor, dst: Tensor) -> Tensor:  # noqa: D401 - overridden
        """The message of one edge from its source's and destination's data (override)."""
        raise NotImplementedError(f"{type(self).__name__} must define apply_edge(src, dst, ...).")

    def apply_vertex(self, x: Tensor, gathered: Tensor) -> Tensor:
        """The new vertex data from the old and the gathered messages (default: the gathered messages)."""
        return gathered

    # -- compiled -------------------------------------------------------------------------------
    @property
    def saga_program(self) -> SAGAProgram:
        """The compiled ``apply_edge`` (compiled at first use)."""
        if self._saga is None:
            self._saga = (compile_apply_edge(self, self.rewrite), {})
        return self._saga[0]

    @property
    def route(self) -> str:
        """The Gather route this layer takes (``"copy"``, ``"weighted"``, ``"gated"`` or ``"edges"``)."""
        program = self.saga_program
        if not self.fused or program.route == "edges" or _FUSED_AGGR.get(self.gather) is None:
            return "edges"
        if program.route == "gated" and _FUSED_AGGR[self.gather] == "max":
            return "edges"
        return program.route

    def __getstate__(self):  # the compiled program is rebuilt after pickling / copying
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["_saga"] = None
        return state

    def forward(self, x: Tensor, edge_index, edge_attr: Optional[Tensor] = None) -> Tensor:
        program = self.saga_program
        layout = self._saga[1]
        vs, vd = self._vertex(program, "src", x, layout), self._vertex(program, "dst", x, layout)
        self._lazy = True   # Scatter happens in message: per value, or not at all on a fused route
        try:
            out = self.propagate(edge_index, vs=vs, vd=vd, edge_attr=edge_attr)
        finally:
            self._lazy = False
        return self.apply_vertex(x, out)

    def _vertex(self, program: SAGAProgram, end: str, x: Tensor, layout: Dict[str, Any]) -> Optional[Tensor]:
        """Scatter's input for one end: the per-vertex values, packed into one ``[N, width]`` tensor."""
        if program.edge is None:   # not rewritten: the vertex data itself
            layout[end] = [(end, 0, tuple(x.shape[1:]))]
            return x
        names = program.hoisted(end)
        if not names:
            layout[end] = []
            return None
        values = run_graph(program.vertex[end].graph, self, {"x": x})
        entries, parts, offset = [], [], 0
        for name, v in zip(names, values):
            entries.append((name, offset, tuple(v.shape[1:])))
            offset += math.prod(v.shape[1:])
            parts.append(v.reshape(v.size(0), -1))
        layout[end] = entries
        if len(values) == 1:
            return values[0]
        dtypes = {v.dtype for v in values}
        if len(dtypes) > 1:
            parts = [p.to(torch.promote_types(*dtypes)) if p.dtype != values[0].dtype else p for p in parts]
        return torch.cat(parts, dim=1)

    # -- Scatter / ApplyEdge / Gather inside propagate -------------------------------------------
    def _index_select(self, src: Tensor, index: Tensor):
        if self._lazy:
            return Lifted(src, index)
        return super()._index_select(src, index)

    def message(self, vs_j, vd_i, edge_attr: Optional[Tensor], index: Tensor, size_i: Optional[int],
                edge_index_i: Tensor, edge_index_j: Tensor):
        program, layout = self._saga
        values: Dict[str, Any] = {}
        for end, packed in (("src", vs_j), ("dst", vd_i)):
            for name, offset, shape in layout.get(end, []):
                values[name] = (packed, offset, shape)
        edge_inputs = {"edge_attr": edge_attr, "index": index, "size_i": size_i}
        if self.route != "edges":
            fused = self._fused(program, values, edge_inputs, edge_index_i, edge_index_j, size_i)
            if fused is not None:
                self.last_route = self.route
                return _Gathered(fused)
        self.last_route = "edges"
        inputs = {k: _lift(p, o, s) for k, (p, o, s) in values.items()}
        inputs.update(edge_inputs)
        if program.edge is None:
            return self.apply_edge(**{p: inputs[p] for p in program.parameters})
        return run_graph(program.edge, self, inputs)

    def aggregate(self, inputs, index: Tensor, ptr: Optional[Tensor] = None, dim_size: Optional[int] = None):
        if isinstance(inputs, _Gathered):
            return inputs.out
        return super().aggregate(inputs, index, ptr=ptr, dim_size=dim_size)

    def _fused(self, program: SAGAProgram, values: Dict[str, Any], edge_inputs: Dict[str, Any],
               index_i: Tensor, index_j: Tensor, size_i: int) -> Optional[Tensor]:
        """The Gather of a fused route, or ``None`` when this call's tensors do not fit it (then the
        messages are built per edge)."""
        reduce = _FUSED_AGGR[self.gather]
        vertex = {k: _columns(p, o, s) if isinstance(p, Lifted) else None for k, (p, o, s) in values.items()}
        args = [vertex[a] for a in program.route_args]
        if any(a is None or a.dtype not in _FUSED_DTYPES for a in args):
            return None
        rowptr, col, perm = csr_of(index_i, index_j, size_i)
        route = self.route
        if route == "copy":
            (s,) = args
            return per_head(lambda t, w: csr_aggregate(rowptr, col, t, reduce=reduce), s, None)
        if route == "gated":
            d, s, v = args
            if not (d.dim() == s.dim() == v.dim() == 2 and d.shape[1] == s.shape[1] == v.shape[1]):
                return None
            return csr_gated_aggregate(rowptr, col, d, s, v, reduce)
        (s,) = args   # weighted
        inputs = {k: _lift(p, o, sh) for k, (p, o, sh) in values.items() if k in program.weight_inputs}
        inputs.update(edge_inputs)
        w = run_graph(program.weight, self, inputs)
        heads = s.shape[1] if s.dim() == 3 else 1
        if not isinstance(w, Tensor) or w.size(0) != index_i.numel() or w.numel() != w.size(0) * heads \
                or s.dim() not in (2, 3):
            return None
        w = w.reshape(w.size(0), heads).index_select(0, perm)
        return per_head(lambda t, wh: csr_aggregate(rowptr, col, t, value=wh, reduce=reduce), s, w)


def _lift(packed, offset: int, shape) -> Tensor:
    """One value of a packed tensor at the edges (lifted now if ``packed`` is a lazy :class:`Lifted`)."""
    if isinstance(packed, Lifted):
        return _columns(packed, offset, shape).index_select(0, packed.index)
    return _unpack(packed, offset, shape)


def _placeholders(graph) -> set:
    return {n.target for n in graph.nodes if n.op == "placeholder"}
