"""Graph-wide statistics: how one run computes them, and the historical sums of every chunk.

The hooks that run graph-wide modules on a chunk are :mod:`..step.norms`; this module holds
the state they read.

**Historical statistics** (``per_chunk_statistics="history"``; BatchNorm on vertex rows, and on one graph PyG's
GraphNorm, InstanceNorm, graph-mode LayerNorm, PairNorm, MeanSubtractionNorm, GraphSizeNorm): statistics are
sums, so the whole graph's can be assembled the way history assembles a layer's input. For a norm's call site
and chunk ``c`` of a way running several chunks::

    s_c = Σ_{v in c} x_v,   q_c = Σ_{v in c} x_v²           (this run)
    S   = s_c + Σ_{c' ≠ c, seen} s_{c'}^{hist}               (the other chunks' latest sums, constants)
    Q   = q_c + Σ_{c' ≠ c, seen} q_{c'}^{hist},   n = rows of c and of the seen chunks
    mean = S / n,   var = Q / n − mean²                      (S, Q, n all-reduced over the ways, if several)
    GraphNorm: out = x − α·mean,   var = Q / n − (2α − α²)·mean²
    (the other norms: their formulas over S, Q, n in :func:`..step.norms._historical_norm`)

then ``s_c, q_c`` replace chunk ``c``'s entry. Chunks earlier in the step's order contribute this step's
sums, later ones the previous step's, and the exact pass that fills history fills these sums too: at
lr = 0 every chunk normalises with exactly the whole graph's statistics (as one process does) from the
first step. The backward goes through the whole graph's sums too: the loss's gradient with respect to
``S`` and ``Q`` collects every chunk's outputs, so each chunk adds the other chunks' parts from their
latest backward (:class:`_Shared`; without them training drifts apart, measured in
docs/convergence.md). A replay (recompute in the drain) reads what its fill read. The running
statistics move once per step, in the chunk that runs last in the way's order, whose sums are all from
this step (one process's update whenever the model's inputs to the norm are exact, as at lr = 0). A chain
of k such norms with nothing between them has one process's gradient from step k (each needs the next one's
exact backward sums first). The variance is taken as ``E[x²] − mean²``: fine for normalised activations, less
accurate than the two-pass form where a feature's mean is far larger than its spread. Not covered: BatchNorm inside a
layer's ``message`` (statistics over edges), norms given a batch vector (refused when they run), NGra
streaming (refused); the sums are not checkpointed (after a resume the exact pass assembles the forward's
again; the backward's start over).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..context import current


class Statistics:
    """How graph-wide modules compute their statistics in one run.

    Args:
        comm: the transport (:class:`..comm.Comm`) for the all-reduces among ways.
        group: the process group of the ways of this stage (``None``: one way, nothing exchanged).
        way_rows: rows of every way in this pass (``None``: one way).
        rows: rows this chunk owns (statistics over vertex tensors take the first ``rows`` rows).
        update_running: whether running statistics are updated (not in the history pass).
        replay: the run is a replay of a chunk's fill (:mod:`..step.pipeline`), whose forward moved them already;
            a layer recomputed inside it during backward (checkpointing) moves them, as in one process.
    """

    def __init__(self, comm, group, way_rows: Optional[List[int]], rows: int, update_running: bool = True,
                 replay: bool = False, history: Optional["StatisticsHistory"] = None, chunk: int = -1,
                 last: bool = False, prime: Optional["StatisticsHistory"] = None):
        self.comm, self.group, self.way_rows, self.rows = comm, group, way_rows, rows
        self.update_running, self.replay = update_running, replay
        self.history, self.chunk, self.last = history, chunk, last  # historical statistics (module docstring)
        self.prime = prime  # an exact pass of the whole way fills these historical sums of every chunk
        self.calls: Dict[int, int] = {}
        self.inside_gather = False

    def site(self, module: torch.nn.Module) -> Tuple[int, int]:
        """``(id(module), k)`` for the module's ``k``-th call in this chunk's run."""
        k = self.calls.get(id(module), 0)
        self.calls[id(module)] = k + 1
        return id(module), k

    def moves_running(self) -> bool:
        """Whether a norm run now updates its running statistics."""
        if not self.update_running:
            return False
        ctx = current()
        return not (self.replay and ctx is not None and not ctx.recomputing())


class StatisticsHistory:
    """The latest sums ``(s_c, q_c)`` of every chunk of this way at every BatchNorm call site, and what each
    chunk's fill read (for its replay); see the module docstring. ``chunk_rows[c]``: rows of chunk ``c``
    (global chunk ids; only this way's are used); ``way_chunks``: this way's chunks, in row order, and
    ``offsets``: where each starts in the way's rows (and where the last ends)."""

    def __init__(self, chunk_rows: List[int], way_chunks: List[int], offsets: List[int], group=None, comm=None):
        self.chunk_rows, self.way_chunks, self.offsets = chunk_rows, way_chunks, offsets
        self.group, self.comm = group, comm
        self.sums: Dict[Tuple[int, int], Tensor] = {}       # site -> [C, 2, d], zeros where not seen
        self.seen: Dict[Tuple[int, int], List[bool]] = {}   # site -> [C] (host: no device read)
        self.read: Dict[Tuple[Tuple[int, int], int], Tuple[Tensor, float]] = {}  # (site, chunk) -> others, n
        self.grad_sums: Dict[Tuple[int, int], Tensor] = {}     # site -> [C, 2, d] of the backward (Σ g, Σ g·u)
        self.grad_seen: Dict[Tuple[int, int], List[bool]] = {}

    def _slot(self, store: Dict, flags: Dict, site: Tuple[int, int], like: Tensor) -> Tuple[Tensor, List[bool]]:
        """The site's [C, 2, d] buffer in ``store`` (zeros, nothing seen, when new) and its seen flags."""
        buf = store.get(site)
        if buf is None or buf.shape[1:] != like.shape:
            buf = like.new_zeros((len(self.chunk_rows), *like.shape))
            store[site], flags[site] = buf, [False] * len(self.chunk_rows)
        return buf, flags[site]

    @staticmethod
    def _exchange(buf: Tensor, seen: List[bool], chunk: int, own: Tensor) -> Tensor:
        """The sum of the other chunks' seen entries; then ``own`` becomes ``chunk``'s entry."""
        others = buf.sum(0) - buf[chunk] if seen[chunk] else buf.sum(0)
        buf[chunk] = own.detach()
        seen[chunk] = True
        return others

    def record(self, site: Tuple[int, int], rows: Tensor, dims) -> None:
        """An exact pass's rows of the whole way: every chunk's sums, so the first training step starts from
        exact statistics, as history starts from exact embeddings."""
        with torch.no_grad():
            own = [torch.stack([rows[a:b].sum(dims), (rows[a:b] * rows[a:b]).sum(dims)])
                   for a, b in zip(self.offsets[:-1], self.offsets[1:])]
            buf, seen = self._slot(self.sums, self.seen, site, own[0])
            for c, o in zip(self.way_chunks, own):
                self._exchange(buf, seen, c, o)

    def measure(self, meter, names: Dict[int, str]) -> None:
        """After a fill: for every site, the other chunks' sums each chunk read against their values now
        (all of this step), into the staleness meter as ``statistics:<module name>#<call>``."""
        for site, buf in self.sums.items():
            total = buf.sum(0)
            diff = fresh = None
            for (key, c), (others, _) in self.read.items():
                if key != site:
                    continue
                d = (others - (total - buf[c])).pow(2).sum()
                diff = d if diff is None else diff + d
                f = total.pow(2).sum()
                fresh = f if fresh is None else fresh + f
            if diff is not None:
                meter.add(f"statistics:{names.get(site[0], '?')}#{site[1]}", diff, fresh)

    def others(self, site: Tuple[int, int], chunk: int, own: Tensor, own_n: float, replay: bool,
               per_row: int) -> Tuple[Tensor, float]:
        """The other chunks' latest sums (constants) and all rows counted: ``(others, n)``; ``own`` [2, d]
        (``s_c``, ``q_c``) becomes the chunk's entry. A replay gets what its fill got."""
        key = (site, chunk)
        if replay and key in self.read:
            others, n_others = self.read[key]
        else:
            buf, seen = self._slot(self.sums, self.seen, site, own)
            n_others = float(sum(r for c, (r, s) in enumerate(zip(self.chunk_rows, seen)) if s and c != chunk)
                             * per_row)
            others = self._exchange(buf, seen, chunk, own)
            self.read[key] = (others, n_others)
        return others, own_n + n_others
