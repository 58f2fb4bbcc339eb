"""The row check inside message-passing layers (:class:`LayerRows`, a part of :class:`~.rows.RowCheck`): what a
layer's own code does with the rows and the edges of its chunk, around ``propagate`` and inside it."""
from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor

from ...model.errors import UnsupportedModelError
from . import row_messages as texts
from .counts import QUERIES, has_count, uses_positions
from .id_rules import in_bounds, padded, reads_at_ids, scatter_index
from .row_rules import _arg, by_index, caller, in_propagate, op_name, tensors, users
from .rowwise import judge


class LayerRows:
    """:class:`~.rows.RowCheck`'s handling of the operations a message-passing layer runs (its ``ids``, ``tracked``,
    ``_sums``, ``vdim`` and refusals are the check's)."""

    def _in_layer(self, inv, func, args, kwargs):
        """An operation inside a message-passing layer, outside ``propagate`` (inside it: :meth:`_in_propagate`).

        A layer that computes its chunk's rows only (its input was computed on this chunk) is given them and its own
        edges, whose sources' rows join only inside ``propagate``: a read at its graph's sources (``x[edge_index[0]]``)
        would miss those rows (or fail). Reads at its destinations (``x[edge_index[1]]``, the chunk's own rows,
        numbered from 0 in its row graph) run as they are; ids whose end is not known count as sources.

        In every call, rows-only or given its whole local graph: a sum over the layer's edges at their
        destinations (``scatter(w, col)``; ``degree(col)`` is completed by :mod:`.degrees`) is complete for the
        chunk's rows only (a chunk holds the edges into its rows), so reading it at the sources (``w[row]``), or handing
        what is computed from it to ``propagate`` where its halo rows are read, would use the halo's partial
        sums; and a sum at the sources (out-degrees) is partial everywhere. Any other operation on the layer's vertex
        rows is judged as in the model's forward (:meth:`__torch_function__`), but for reads and writes at an index
        tensor. Each is refused on every rank after the pass; a read meanwhile runs on rows padded with zeros."""
        tens = tensors(args, kwargs)
        if has_count(args, kwargs) and not in_propagate() and users(caller(3)):  # sizes read in the layer's forward
            made = self._counted(op_name(func), func, args, kwargs)
            if made is not None:
                return made
        if not tens:
            return func(*args, **kwargs)
        for g in (h[0] for h in inv.graphs.values()):  # the layer's graphs: their entries are vertex ids
            self.edges(g, inv.reverse)
        held = [(t, d) for t in tens for d in [self.vdim(t)] if d is not None]  # (all its rows in a whole-graph call)
        rows = held if inv.rows_only else []
        sums = [(t, 0) for t in tens if self._partial(t)]
        ids = any(self.ids.has(t) for t in tens)
        if in_propagate():  # (message, aggregate: rows joined by the engine; only groupings at the sources judged)
            return self._in_propagate(inv, func, args, kwargs)
        if not held and not sums and not ids:
            return func(*args, **kwargs)
        name = op_name(func)
        if name in QUERIES and held and held[0][0] is args[0]:
            return self._count(caller(3), name, args, func(*args, **kwargs), held[0][1])
        what = judge(name, args, kwargs, held) if held and self.found is None and not ids and \
            not by_index(name, args) else None
        took = self.tracked.take(name, func, args, kwargs, *held[0]) if what is not None else None
        if took is not None:
            return took
        if what is not None:
            self.found = self._describe(caller(3), name, what, held[0][1])
        read = reads_at_ids(name, args, kwargs, rows + sums, self.ids.has) if rows or sums else None
        if read is not None and self.ids.kind(read[2]) not in ("dst", "own"):  # (destinations are the chunk's own rows)
            if any(t is read[0] for t, _ in rows):
                return self._neighbour_read(inv, name, func, args, kwargs, *read)
            self._refuse_sum(inv, name, "reads at the sources of the layer's edges a value summed over each "
                                        "vertex's in-edges" + texts.ENDS[inv.reverse])
            return self._neighbour_read(inv, name, func, args, kwargs, *read)
        at = scatter_index(name, args, kwargs)
        if at is not None and self.ids.has(at) and self.ids.kind(at) not in ("dst", "own"):
            self._refuse_sum(inv, name, "sums over the layer's edges at their sources (out-degrees)"
                             + texts.ENDS[inv.reverse])
            args = in_bounds(name, args, kwargs)  # (sources past the chunk's rows: the pass goes on to its end)
        out = func(*args, **kwargs)
        if self.ids.follow(name, args, kwargs, out):
            return out
        if ids and uses_positions(name) and any(self.ids.kind(t) == "own" for t in tens) and users(caller(3)):
            self._refuse_count(name, "uses positions numbered from x.size(0) (torch.arange) as values")
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if (at is not None and self.ids.kind(at) in ("dst", "own")) or sums:  # per-vertex sums at the destinations, and
            into = [args[0]] if at is not None and name.endswith("_") else []  # what is computed from them
            n = sums[0][0].size(0) if sums and at is None else None
            for o in outs + into:
                if isinstance(o, Tensor) and o.dim() > 0 and (n is None or o.size(0) == n):
                    self._sums[id(o)] = weakref.ref(o)
        if held:
            self._follow(name, args, kwargs, held, out, 4)
        return out

    def _in_propagate(self, inv, func, args, kwargs):
        """An operation inside ``propagate`` (``message``, ``aggregate``, ``update``), where the engine has joined the
        sources' rows. The layer's vertex ids are followed (PyG hands ``message`` ``edge_index_j`` and
        ``edge_index_i``), and so are the rows read at them (``x_j``, ``x_i``: a row per edge) and what a scatter at
        the destinations makes (the aggregation: a row per vertex of the chunk), through what is computed from them.
        Refused: a sum, maximum or softmax over the edges grouped by their sources (``degree(edge_index_j)``,
        ``softmax(a, edge_index_j)``; a chunk holds the edges into its rows only, so each source's out-edges are
        partial everywhere), and an operation of the user's code combining those rows (``x_j.mean(0)`` in ``message``,
        ``F.normalize(aggr_out, dim=0)`` in ``update``): the chunk's edges and rows only (both silently wrong until
        2026-11-29), or a count of them used as a value (``inputs.size(0)`` in ``aggregate``; :mod:`.counts`).
        Grouped by the destinations (PyG's aggregations, its softmax over in-edges) it runs as it is;
        PyG's own code inside ``propagate`` (its layers', its aggregations' dense batches) is followed, not judged."""
        name, tens, frame = op_name(func), tensors(args, kwargs), caller(4)
        if not tens or (frame is not None and frame.f_globals.get("__name__", "").startswith("pyg_pipe")):
            return func(*args, **kwargs)  # (or the engine's own: the halo join in propagate's hook, fused kernels)
        at = scatter_index(name, args, kwargs)
        ids = any(self.ids.has(t) for t in tens)
        if at is not None and self.ids.has(at) and self.ids.kind(at) not in ("dst", "own"):
            self._refuse_sum(inv, name, "groups the layer's edges by their sources inside propagate (a sum, maximum "
                                        "or softmax over each vertex's out-edges)" + texts.ENDS[inv.reverse], 6)
            args = in_bounds(name, args, kwargs)
        held = [(t, d) for t in tens if not self.ids.has(t) for d in [self.vdim(t, edges=True)] if d is not None]
        user = users(frame)  # (PyG's own code there, its layers' and aggregations', is followed, not judged)
        if user and has_count(args, kwargs):  # a count of those rows (inputs.size(0)): the chunk's, as in forward
            made = self._counted(name, func, args, kwargs)
            if made is not None:
                return made
        if user and name in QUERIES and held and held[0][0] is args[0]:
            return self._count(frame, name, args, func(*args, **kwargs), held[0][1])
        if user and held and self.found is None and not ids and not by_index(name, args):
            what = judge(name, args, kwargs, held)
            if what is not None:
                self.found = self._describe(frame, name, what, held[0][1], self.tracked.per_edge(held[0][0]))
        out = func(*args, **kwargs)
        if ids and self.ids.follow(name, args, kwargs, out):
            return out
        dim = _arg(args, kwargs, 1, "dim")
        if at is not None and self.ids.kind(at) in ("dst", "own") and isinstance(dim, int) and isinstance(out, Tensor):
            self.tracked.add(out, dim % out.dim())           # per-vertex results of a scatter at the destinations
        elif ids and name in ("index_select", "__getitem__") and isinstance(out, Tensor):
            self.tracked.add(out, (dim if name == "index_select" else 0) % out.dim(), edges=True)  # rows read at ids
        elif held and user:
            self._follow(name, args, kwargs, held, out, 5)
        elif held:
            self.tracked.follow(name, args, kwargs, *held[0], out, lambda p: self.vdim(p, edges=True))
        return out

    def edges(self, g: Any, reverse: bool = False) -> None:
        """``g`` (a ``[2, E]`` edge list of the running layer) holds vertex ids (:meth:`.id_rules.Ids.edges`)."""
        self.ids.edges(g, reverse)

    def _partial(self, t: Tensor) -> bool:
        """Whether ``t`` was summed over the layer's edges at their destinations (or computed from such sums)."""
        hit = self._sums.get(id(t))
        return hit is not None and hit() is t

    def partial_sources(self, inv, name: str, values) -> None:
        """Before a ``propagate`` of a call given its whole local graph: a node argument computed from sums over
        the edges has partial halo rows, which the propagate would read (``values``: its tensor arguments)."""
        if not inv.rows_only and any(isinstance(t, Tensor) and self._partial(t) for t in values):
            self._refuse_sum(inv, "propagate", "is handed a value computed from sums over the layer's edges at "
                                        "their destinations, whose halo rows it reads")

    def _refuse_sum(self, inv, name: str, what: str, depth: int = 5) -> None:
        if self.refusal is None:
            found = self._describe(caller(depth), name, what, 0)
            self.refuse(texts.partial_sums(found, self.cut, inv.name))

    def _neighbour_read(self, inv, name: str, func, args, kwargs, t: Tensor, v: int, index: Tensor):
        if self.refusal is None:
            found = self._describe(caller(4), name, "reads {rows} at the ends of the layer's edges", v)
            self.refuse(texts.neighbour_read(found, self.cut, inv.name))
        try:
            return func(*padded(args, t, v, index), **kwargs)
        except Exception as exc:  # noqa: BLE001 - it cannot run even so: refuse on this rank now
            raise UnsupportedModelError(self.refusal) from exc
