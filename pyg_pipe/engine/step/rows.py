"""Operations that combine the rows of different vertices outside message passing: found, then refused.

A chunk (or a graph-parallel way) runs the user's forward on its own rows only. Inside ``propagate`` the engine
completes what a layer reads (halo rows, degrees: :mod:`.layers`, :mod:`.degrees`), and graph-wide modules
(BatchNorm, GraphNorm, ...) get the statistics of all rows (:mod:`.norms`). An operation anywhere else (in the
model's forward or a layer's, outside ``propagate``) that combines the rows of different vertices would see part
of the graph and differ from one device, silently:

=================== ======================================================================
reduces             ``x.mean(0)``, ``x.sum()``, ``global_mean_pool(x)``, ``x.abs().max()``, a
                    softmax / sort / cumulative sum / unique over the vertices
contracts           ``adj.to_dense() @ x``, ``x.t() @ x``, attention over all vertices
                    (``nn.MultiheadAttention`` as in ``GPSConv``, ``scaled_dot_product_attention``)
scatters            ``scatter_add_`` / ``index_add`` of vertex rows (pooling by a ``batch`` vector)
indexes by position ``x[edge_index[0]]``, ``x[:10]``, ``x[0]``, ``x.flip(0)``, ``nonzero``
=================== ======================================================================

So the first pass of every mode (training, inference) of a plan that cuts the graph runs under
:class:`RowCheck`, a ``TorchFunctionMode`` that follows which tensors have one row per vertex of the chunk, and
along which dimension, *by provenance*: the chunk's node inputs, what layers and graph-wide modules return, values
arriving from the previous stage, and whatever is computed from them keeping that dimension (elementwise operations,
linear maps, reshapes that keep it, transposes and stacks that move it, joins along it, whose whole pieces taken back
are vertex rows again: :mod:`.row_layout`; constants sized by a count: :mod:`.counts`). The first operation that
combines those rows (:mod:`.row_rules`) is recorded with the line of the model that called it; after the pass all
ranks share what they found and raise the same error, as the engine's own refusals found in the pass
(:meth:`RowCheck.refuse`). Nothing depends on values, on which chunk ran first or on one rank's view. The engine's
own operations and those inside graph-wide modules are not judged.
In a layer's forward, reads and writes at index tensors are not judged as positional; a read of rows at its edges'
sources outside ``propagate`` (``x[edge_index[0]]``) by a layer computing its chunk's rows only is refused; one at
their destinations (``x[edge_index[1]]``), the chunk's own rows, runs. Per-vertex sums over a layer's edges computed
by hand (``scatter(w, col)``) are followed: used beyond the chunk's rows, where they are partial (``deg[row]``), or
summed at the sources, they are refused (PyG's ``degree`` at the destinations is completed: :func:`.degrees.degree`);
inside ``propagate`` only sums grouped by the edges' sources are judged, and refused (:mod:`.row_layers`).

An operation on vertex rows no rule judges and not known to work row by row (:mod:`.rowwise`) is refused by name
(``pyg_pipe.declare_row_wise`` vouches for one). Sizes (``x.size(0)``), positions numbered from them (``arange``) and
edges' ids used as values are refused (:mod:`.counts`, :mod:`.id_rules`; sizes Python makes plain floats are found in
the code that read them: :mod:`.count_uses`). Not followed: Python loops over rows, Python numbers read from values.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ...model.errors import UnsupportedModelError
from ...model.inputs import is_graph_tensor
from ..context import current
from ..tree import flatten
from . import row_messages as texts
from .count_uses import float_use, made_float
from .counts import POSITIONAL, QUERIES, SIZED, as_value, count_of, counted_dim, has_count, uses_positions
from .id_rules import SAME, SPARSE, Ids, as_values, fitted, in_bounds, padded, reads_at_ids, scatter_index
from .row_layers import LayerRows
from .row_layout import GROUPS, RESHAPES, Followed
from .row_rules import caller, op_name, tensors, users
from .rowwise import UNKNOWN, judge


class RowCheck(LayerRows, TorchFunctionMode):
    """Follows the tensors with one row per vertex through one chunk's run of the forward and records
    the first operation that combines the rows of different vertices (see the module docstring).

    The chunk context's *observer*: the hooks tell it what layers and graph-wide modules return and run
    their own operations inside :meth:`paused`, so every operation it judges is the model's.

    Args:
        rows: the chunk's row count.
        names: module object id -> its name in the model (for the message).
        cut: how the graph is cut, for the message (``"num_chunks=4"``).
    """

    def __init__(self, rows: int, names: Dict[int, str], cut: str):
        super().__init__()
        self.rows, self.names, self.cut = rows, names, cut
        self.tracked = Followed()
        self.found: Optional[str] = None
        self.refusal: Optional[str] = None   # a refusal the engine found while the pass ran (:meth:`refuse`)
        self._paused = 0
        self._read_at: Dict[Any, set] = {}  # code object -> (line, dimension) where the user's code read a count
        self.ids = Ids()                  # tensors holding vertex ids at edge ends (:mod:`.id_rules`)
        self._graphs_of: Any = None       # the run whose handed graphs were marked as ids
        self._sums: Dict[int, Any] = {}  # sums over a layer's edges at their destinations: whole for its rows only

    def next_chunk(self, rows: int) -> None:
        """The pass goes on to a chunk of ``rows`` rows: every chunk is followed to its end (what one cannot run,
        another may not reach); the verdict comes after the pass."""
        self.rows = rows
        self.tracked, self.ids, self._sums, self._graphs_of = Followed(), Ids(), {}, None

    def refuse(self, message: str) -> None:
        """A refusal found in the pass on this rank: raised on every rank after it (:meth:`verdict`), none waiting."""
        if self.refusal is None:
            self.refusal = message

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Operations run inside are the engine's own: not judged."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # ------------------------------------------------------------------ sources
    def returned(self, value: Any, vdim: Optional[int] = None, local: bool = False) -> None:
        """``value`` (a tensor, or tuples / lists of them) has one row per vertex along ``vdim`` (by
        default: its first dimension of the chunk's row count; ``local``: a layer's input of all its local vertices)."""
        if isinstance(value, (tuple, list)):
            for v in value:
                self.returned(v, vdim, local)
            return
        if not isinstance(value, Tensor) or value.dim() == 0 or value.layout != torch.strided:
            return
        d = vdim
        if d is None:
            d = next((i for i, n in enumerate(value.shape) if n == self.rows), None)
        if d is not None and (local or value.size(d) == self.rows):
            self.tracked.add(value, d)

    def layer_returned(self, value: Any, vdim_of, reverse: bool) -> None:
        """A layer's outputs (:meth:`~..context.Observer.layer_returned`): an edge list it hands back (GATConv's
        ``return_attention_weights=True``: its graph, numbered locally) holds vertex ids, a tensor with a row per edge
        of it is followed per edge (``att.mean()`` ran off by 0.18 – 2.35 with the graph cut), the rest per vertex."""
        flat = [t for t in flatten(value)[0] if isinstance(t, Tensor) and t.dim() > 0]
        graphs = [t for t in flat if t.layout == torch.strided and is_graph_tensor(t)]
        for g in graphs:
            self.ids.edges(g, reverse)
        for t in flat:
            d = None if any(t is g for g in graphs) else vdim_of(t)
            if d is None and any(t.size(0) == g.size(1) for g in graphs) and t.is_floating_point():
                self.tracked.add(t, 0, edges=True)
            elif d is not None:
                self.returned(t, d)

    def vdim(self, t: Tensor, edges: bool = False) -> Optional[int]:
        """The dimension of ``t`` with one row per vertex of the chunk (``edges``: or per edge of its graph: the
        forward's edge inputs and what is computed from them, followed outside the layers only), else ``None``."""
        hit = self.tracked.get(t)
        if hit is not None:
            return hit[0] if edges or not hit[1] else None
        ctx = current()
        if ctx is not None and ctx.is_clean(t):
            return 0
        if edges and ctx is not None and ctx.edge_input(t) is not None:
            self.tracked.add(t, 0, edges=True)
            return 0
        return None

    # ------------------------------------------------------------------ the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ctx = current()
        if self._paused or ctx is None:
            return func(*args, **kwargs)  # the engine's own, or outside the model's run
        if ctx.stack:
            return self._in_layer(ctx.stack[-1], func, args, kwargs)
        if self._graphs_of is not ctx:  # the graphs this run handed the forward hold vertex ids at edge ends
            self._graphs_of = ctx
            for obj, _, _, local in list(getattr(ctx.graphs, "known", {}).values()):
                self.edges(obj)
                self.edges(local)
        if any(self.ids.has(t) for t in tensors(args, kwargs)):  # (followed after a finding too: kept in bounds)
            return self._at_edges(func, args, kwargs)
        if self.found is not None:
            return func(*args, **kwargs)
        name = op_name(func)
        made = self._counted(name, func, args, kwargs) if has_count(args, kwargs) else None
        if made is not None:
            return made
        aligned = [(t, d) for t in tensors(args, kwargs) for d in [self.vdim(t, edges=True)] if d is not None]
        if not aligned:
            return func(*args, **kwargs)
        if name in QUERIES and aligned[0][0] is args[0]:
            return self._count(caller(), name, args, func(*args, **kwargs), aligned[0][1])
        if name == "__len__" and aligned[0][1] == 0:  # (an int Python makes plain: not followed)
            self._refuse_count(name, "reads the number of vertex rows with len(), not followed (write x.size(0))")
        what = judge(name, args, kwargs, aligned)
        took = self.tracked.take(name, func, args, kwargs, *aligned[0]) if what is not None else None
        if took is not None:
            return took
        if what is not None:
            self.found = self._describe(caller(), name, what, aligned[0][1], self.tracked.per_edge(aligned[0][0]))
            try:
                return func(*args, **kwargs)
            except Exception as exc:  # on part of the rows it cannot even run: say why, on every rank alike
                raise UnsupportedModelError(self.refusal or self.message(self.found)) from exc
        try:
            out = func(*args, **kwargs)
        except RuntimeError as exc:  # a reshape into groups of rows this chunk's row count does not divide
            if name not in RESHAPES:
                raise
            raise UnsupportedModelError(self.message(self._describe(caller(), name, GROUPS, aligned[0][1]))) from exc
        self._follow(name, args, kwargs, aligned, out, 3)
        return out

    # ------------------------------------------------------------------ the graph's edges, outside layers
    def _at_edges(self, func, args, kwargs):
        """An operation of the forward, outside the layers, on the vertex ids of the graph's edges (``edge_index[1]``,
        and what selects, joins or reshapes them). A chunk's edge list holds the edges into its rows, its halo's
        vertices numbered after them (with their self loops), so a sum over the edges at either end
        (``degree(edge_index[1], x.size(0))``) counts part of them, and a read of vertex rows at the edges' ends
        (``x[edge_index[0]]``) reads rows the chunk does not hold; one device sees the whole graph. Both are refused
        on every rank after the pass (the pass goes on, the indices kept in bounds), whatever the chunk holds."""
        name = op_name(func)
        if name in QUERIES and self.ids.has(args[0]):  # the number of edges (or positions): a count
            return self._count(caller(3), name, args, func(*args, **kwargs), args[0].dim() - 1)
        if name in SPARSE:  # a graph built from the edges: refused; meanwhile kept inside its memory
            self._refuse_edges(name, "builds a graph (a sparse tensor) from the graph's edges", text=texts.built_graph)
            return func(*(fit := fitted(name, args, kwargs))[0], **fit[1])
        at = scatter_index(name, args, kwargs)
        if at is not None and self.ids.has(at):
            if self.ids.kind(at) == "own":
                self._refuse_count(name, "scatters values at positions numbered from x.size(0)")
            self._refuse_edges(name, "sums over the graph's edges per vertex (a degree, a count or sum at the edges' "
                                     "ends)")
            return func(*in_bounds(name, args, kwargs), **kwargs)
        rows = [(t, 0 if d is None else d) for t in tensors(args, kwargs) if t.dim() > 0 and not self.ids.has(t)
                for d in [self.vdim(t)]]  # (a tensor indexed by vertex ids holds vertex rows, tracked or not)
        read = reads_at_ids(name, args, kwargs, rows, self.ids.has) if rows else None
        if read is not None:
            if self.ids.kind(read[2]) == "own":
                self._refuse_count(name, "reads rows at positions numbered from x.size(0)")
            self._refuse_edges(name, "reads {rows} at the ends of the graph's edges", read[1])
            return func(*padded(args, *read), **kwargs)
        out = func(*args, **kwargs)
        if not self.ids.follow(name, args, kwargs, out):
            if uses_positions(name) and any(self.ids.kind(t) == "own" for t in tensors(args, kwargs)):
                self._refuse_count(name, "uses positions numbered from x.size(0) (torch.arange) as values")
            elif as_values(name):
                self._refuse_edges(name, "uses the vertex ids of the graph's edges as values")
            elif name in SAME and isinstance(out, Tensor) and out.dim() > 0:  # (ends compared: a row per edge)
                self.tracked.add(out, out.dim() - 1, edges=True)
        return out

    def _counted(self, name: str, func, args, kwargs) -> Optional[Tensor]:
        """An operation given a count read from a size (:mod:`.counts`): positions made from it (``arange``), returned
        and followed as ids of the chunk's own rows; constants sized by it, followed as vertex rows; the count used as
        a value, refused; else ``None``."""
        if name in POSITIONAL:
            out = func(*args, **kwargs)
            self.ids.mark(out, "own")
            return out
        if as_value(name, args, kwargs):
            self._refuse_count(name, "uses a number read from a size (x.size(0), edge_index.size(1)) as a value")
        elif name in SIZED:  # (torch.ones(x.size(0), d): a row per vertex, followed)
            out = func(*args, **kwargs)
            self.tracked.add(out, counted_dim(args, kwargs, out))
            return out
        return None

    def _count(self, frame, name: str, args, out, v: int):
        """What a size query returns (:func:`.counts.count_of`), the user's line that asked noted for
        :mod:`.count_uses` (PyG's and the engine's own code is not the user's)."""
        if frame is not None and users(frame) and not frame.f_globals.get("__name__", "").startswith("pyg_pipe"):
            self._read_at.setdefault(frame.f_code, set()).add((frame.f_lineno, v))
        return count_of(name, args, out, v)

    def python_op(self, name: str, args: tuple, kwargs: dict, out) -> None:
        """A traced step's Python arithmetic made a plain float of a count (``1.0 / x.size(0)``)."""
        if has_count(args, kwargs):
            self.refuse(texts.counted(made_float(f"traced step '{name}'"), self.cut))

    def _refuse_count(self, name: str, what: str) -> None:
        if self.refusal is None:
            self.refuse(texts.counted(self._describe(caller(), name, what, None), self.cut))

    def _refuse_edges(self, name: str, what: str, v: Optional[int] = None, text=texts.at_edges) -> None:
        if self.refusal is None:
            self.refuse(text(self._describe(caller(4), name, what, v), self.cut))

    def _follow(self, name: str, args, kwargs, aligned, out, depth: int) -> None:
        """The operation's outputs followed (:meth:`.row_layout.Followed.follow`); a reshape grouping the rows of
        several vertices is a finding (``depth``: the frames from here to the model's line)."""
        what = self.tracked.follow(name, args, kwargs, *aligned[0], out, lambda p: self.vdim(p, edges=True))
        if what is not None and self.found is None:
            self.found = self._describe(caller(depth), name, what, aligned[0][1])

    def _describe(self, frame, name: str, what: str, v: Optional[int], edges: bool = False) -> str:
        return texts.describe(frame, self.names, name, what, v, edges)

    def message(self, found: str) -> str:
        """The refusal for a finding (the same text on every rank)."""
        return (texts.unknown if UNKNOWN in found else texts.combines)(found, self.cut)

    def verdict(self, comm) -> None:
        """After the pass: shares what this rank found with all (a collective over ``comm``'s world)
        and raises the same error everywhere if any rank found an operation or a refusal."""
        found = float_use(self._read_at)  # counts made plain floats where the user's code read them
        if found is not None:
            self.refuse(texts.counted(found, self.cut))
        every = comm.all_gather_objects((self.refusal, self.found), "the row check")
        refusal = next((r for r, _ in every if r is not None), None)
        if refusal is not None:
            raise UnsupportedModelError(refusal)
        first = next((f for _, f in every if f is not None), None)
        if first is not None:
            raise UnsupportedModelError(self.message(first))

