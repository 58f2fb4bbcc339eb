"""Streaming: layers that propagate their inputs as they received them compute their chunk's rows only.

When streaming (:mod:`.stream`) every layer group receives its inputs *clean*: with their true halo rows, gathered
from the store. A clean call runs on the whole local graph (:mod:`.layers`): its node tensors are ``[rows | halo]``,
so everything the layer computes per vertex before, around and after its propagate is computed for the halo too,
and thrown away at the exit. On a graph with little locality the halo is several times the rows (a random graph in
16 chunks: 10x), so most of such a step is work for rows nobody keeps, on normalised graphs and transposes kept
twice (whole local graph and row graph).

A call whose every ``propagate`` / ``edge_updater`` reads at edge sources exactly the tensors it was handed (GCN2Conv,
SAGEConv, GINConv: a layer that aggregates before it transforms) needs nothing at the halo but those inputs' rows,
which the chunk has. Such a call can run *rows only*: node tensors ``[rows]``, the row graph, and the sources
joined with their true halo rows at the propagate, as a clean input's are (:func:`~.arguments.extend`): the same
edges into the same rows, summed in the same order. A call that reads at the sources something it computed first
(``lin(x)``, GATConv's attention terms) keeps the whole local graph: its halo rows are work it needs.

Which calls propagate their inputs is seen, not assumed: the first chunk a call runs on runs it on the whole local
graph, as before, and marks the call site ``(layer, call)`` by what its propagates read; every other chunk then runs
a marked call rows only. The first chunk keeps its whole local graph in every pass and replay of that step (each
chunk's forward is replayed as it ran), and goes rows only from the next step on, when the first step's backward is
over (:meth:`DirectCalls.settle`) and what the whole local graphs' runs cached is dropped once. Decided by structure
(which tensor objects reach the propagate), never by values, on the one process that runs every chunk: whichever
chunk runs first, the marks are the same. A marked call that later reads something else at its sources is still
exact: the source is then joined as any computed value is (a streaming barrier, :mod:`.barriers`), only slower.
"""
from __future__ import annotations

from typing import Dict, Tuple

from torch import Tensor

from ..context import Invocation


class DirectCalls:
    """Which call sites read only the tensors they were handed at their edge sources (module docstring)."""

    def __init__(self) -> None:
        self.seen: Dict[Tuple[str, int], bool] = {}   # (layer, call) -> every source read was a handed input
        self.first: Dict[Tuple[str, int], int] = {}   # (layer, call) -> the chunk that ran it first (and marked it)
        self.decided: Dict[Tuple[str, int, int], bool] = {}  # the first step's answers, kept for its passes, replays
        self.settled = False
        self.halos: Dict[Tuple[int, str], bool] = {}  # (group, value) -> some layer propagated it on some chunk

    def wants_halo(self, group: int, name: str) -> bool:
        """Whether a chunk of layer group ``group`` gets the halo rows of the value ``name`` with its rows (else its
        rows alone, the halo read only if a layer asks: :class:`~.barriers.StreamInput`): until a chunk of the group
        ran without propagating it, and unless any did. Seen, not assumed, as the marks of the calls are."""
        return self.halos.get((group, name), True)

    def saw(self, group: int, name: str, propagated: bool) -> None:
        """A chunk of group ``group`` ran, propagating the value ``name`` or not."""
        self.halos[(group, name)] = self.halos.get((group, name), False) or propagated

    def rows_only(self, name: str, index: int, chunk: int) -> bool:
        """Whether call ``index`` of layer ``name`` runs rows only on ``chunk`` although its inputs are clean. In the
        first step the answer for a chunk is given once and kept (its barrier passes and replays run as it did)."""
        key = (name, index)
        if self.settled:
            return self.seen.get(key, False)
        hit = self.decided.get((name, index, chunk))
        if hit is None:
            hit = self.decided[(name, index, chunk)] = self.seen.get(key, False) and self.first.get(key) != chunk
        return hit

    def observe(self, inv: Invocation, t: Tensor) -> None:
        """A propagate of ``inv`` (or of a layer called inside it) reads ``t`` at edge sources."""
        while inv.parent is not None:
            inv = inv.parent
        if self.settled or not inv.clean or inv.rows_only:
            return
        key = (inv.name, inv.index)
        if self.first.setdefault(key, inv.lg.index) == inv.lg.index:
            self.seen[key] = self.seen.get(key, True) and any(t is e for e in inv.extended)

    def unread(self, inv: Invocation) -> None:
        """``inv`` (a clean whole-local-graph call) returned: a call that propagated nothing is not marked."""
        if not self.settled and inv.clean and not inv.rows_only and inv.parent is None:
            key = (inv.name, inv.index)
            if self.first.setdefault(key, inv.lg.index) == inv.lg.index:
                self.seen.setdefault(key, False)

    def settle(self, layer_cache: dict) -> bool:
        """The first training step is over: the marked calls run rows only on every chunk from now on. The
        normalised graphs and ``cached=True`` entries the first chunks computed for their whole local graphs are
        dropped with ``layer_cache`` (all recomputed on the next step, for the row graphs), their kernels'
        transposes with them. Whether any call was marked."""
        if self.settled:
            return False
        self.settled = True
        self.decided.clear()
        self.halos.clear()  # (the first chunks' whole local graphs extended every node argument)
        if not any(self.seen.values()):
            return False
        from ...ops.transpose import forget
        forget(layer_cache)
        layer_cache.clear()
        return True
