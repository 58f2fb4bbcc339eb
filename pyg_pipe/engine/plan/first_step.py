"""The first training step's peak per process, estimated before any step, for ``num_chunks="auto"`` under a memory
budget (:mod:`.memory_fit`). :mod:`.memory_cost` predicts later steps from what the first one measured; here
nothing has run yet, so the parts come from where they are known before a step:

* counted from the candidate partition (built on the host as the runtime builds it): the chunked graphs with their
  one-chunk-a-way chunking and a way's local edges (:func:`chunking_bytes`), the rows its history holds
  (:func:`history_rows`);
* measured in one training pass of the whole model over a small chunk (:func:`~..pass_memory.training_pass_memory`):
  per layer group, what its steps saved for the backward, the widths of its halo joins, and what crosses each cut
  between groups (:class:`PassMemory`).

A process runs one stage, so its share of the pass is its stage's groups (:func:`stage_shares`)::

    a = saved by the stage's steps, with what it receives (the cut before it), what it sends (the cut after it;
        the last stage: the output), each storage once                                      bytes a row
    b = what it receives                                                                    bytes a row
    h = its halo joins' widths                                                              bytes a history row

and with ``R = N / W`` rows a way in ``k`` chunks of ``r = R / k``, ``H`` history rows in ``copies`` buffers
(the buffer, T2's snapshot, ...) and once more as the pending gradients ``G = H h``::

    resident    = structures + (cache + way_cache) E + copies G     (a chunk's caches: one per stage)
    state       = 3 params                                          (gradients and Adam's two moments)
    activations = b R + a r + G    replaying  (a R + G keeping: no chunk count changes it)
    transient   = w r               (w: the stage's widest layer group's saved bytes a row; a where not known)

The widest stage (the largest sum) is the estimate. Where the split is not known, every stage is taken as the
mean one: ``a = saved / S + the widest cut``, ``b`` that cut, ``h = history / S``, ``params / S``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .memory_cost import reachable


def chunking_bytes(graphs, perm: Tensor, ptr: Tensor, ways: int) -> Tuple[int, int]:
    """``(structures, local edges)`` of the chunking ``(perm, ptr)`` a way, built as the runtime builds it (here on
    the host): the bytes of the chunked graphs of ``graphs`` with their one-chunk-per-way chunking
    (:mod:`..runtime.runtime`), and the local edges of a way's chunks (the largest way's)."""
    from ...graph.chunks import ChunkedGraph, way_ptr
    from ...model.inputs import graph_edges
    cgs = [ChunkedGraph(*graph_edges(g)[:2], perm.numel(), perm.cpu(), ptr.cpu(), ways) for g in graphs]
    way = [cg.rechunked(way_ptr(ptr.cpu(), ways), ways) for cg in cgs] if ptr.numel() - 1 > ways else []
    k = (ptr.numel() - 1) // ways
    edges = max(sum(lg.num_edges for cg in cgs for lg in cg.chunks[w * k:(w + 1) * k]) for w in range(ways))
    return sum(reachable([cgs, way]).values()) // ways, int(edges)


def _cross_edges(graphs, perm: Tensor, ptr: Tensor) -> Tuple[Tensor, List[Tuple[Tensor, Tensor]]]:
    """``(chunk of every vertex, [(src, dst) of the edges between chunks, per graph])`` for the chunking ``(perm,
    ptr)`` (the user's ids, on the CPU)."""
    from ...model.inputs import graph_edges
    N = perm.numel()
    chunk = torch.empty(N, dtype=torch.long)
    chunk[perm.cpu()] = torch.bucketize(torch.arange(N), ptr.cpu()[1:], right=True)
    cross = []
    for g in graphs:
        src, dst, _ = graph_edges(g)
        src, dst = src.cpu(), dst.cpu()
        between = chunk[src] != chunk[dst]
        cross.append((src[between], dst[between]))
    return chunk, cross


def history_rows(graphs, perm: Tensor, ptr: Tensor, ways: int) -> int:
    """The rows a way's history holds for the chunking ``(perm, ptr)`` (:mod:`..runtime.history`): both ends of
    every edge between chunks (over ``graphs``, in the user's ids) with an end in the way's rows; the largest
    way's count."""
    N, C = perm.numel(), ptr.numel() - 1
    chunk, cross = _cross_edges(graphs, perm, ptr)
    way_of = chunk // max(C // ways, 1)
    pairs = []
    for src, dst in cross:
        for w in (way_of[src], way_of[dst]):
            pairs += [w * N + src, w * N + dst]
    if not pairs:
        return 0
    held = torch.unique(torch.cat(pairs)) // N
    return int(torch.bincount(held, minlength=ways).max())


def fresh_reads(graphs, perm: Tensor, ptr: Tensor) -> int:
    """One way's pending gradient rows at their peak for the chunking ``(perm, ptr)``, the chunks filled in their
    order and drained in reverse (:mod:`..runtime.pending`): after chunk ``j`` drained,
    every owner ``o < j`` waits for the rows its drained readers ``j' >= j`` read, at most the rows it holds::

        pending = max_j  sum_{o < j}  min(held_o, sum_{j' >= j} reads[j', o])

    ``reads[j', o]``: the distinct rows of chunk ``o`` that chunk ``j'`` reads (over ``graphs``, both edge
    directions); ``held_o``: the rows of ``o`` with an edge to another chunk."""
    N, C = perm.numel(), ptr.numel() - 1
    chunk, cross = _cross_edges(graphs, perm, ptr)
    pairs = [p for src, dst in cross for p in (chunk[dst] * N + src, chunk[src] * N + dst)]
    if not pairs:
        return 0
    read = torch.unique(torch.cat(pairs))
    reader, v = read // N, read % N
    reads = torch.bincount(reader * C + chunk[v], minlength=C * C).view(C, C)     # [reader, owner]
    held = torch.bincount(chunk[torch.unique(v)], minlength=C)
    later = reads.flip(0).cumsum(0).flip(0)                                           # [j, o]: readers j' >= j
    waiting = torch.minimum(later, held.view(1, C)).tril(-1)                          # owners o < j
    return int(waiting.sum(1).max())


@dataclass(frozen=True)
class PassDetail:
    """Where a training pass's bytes were, layer group by layer group: kept on the rank that measured (the estimate is
    made there) so that a stage's share can be taken once the split is known (:func:`stage_shares`)."""

    rows: int                       # the chunk's rows
    saved: List[Dict[int, int]]     # per group: every storage its steps saved for the backward (data pointer -> bytes)
    widths: List[float]             # per group: its halo joins' widths, bytes a row
    crossing: List[Dict[int, int]]  # per cut between consecutive groups: the storages of what crosses it
    out: Dict[int, int]             # the pass's output


@dataclass(frozen=True)
class PassMemory:
    """What a training pass of the whole model holds over a chunk (:func:`~..pass_memory.training_pass_memory`), for
    the estimate of the first step (:func:`first_step_peak`). Bytes a row of the chunk, but the caches' (a local
    edge) and ``params``."""

    saved: float       # what autograd saves for the backward, with the output (the parameters, the inputs left out)
    boundary: float    # the widest set of values that crosses a cut between layer groups: what a stage receives
    history: float     # a row at every call site's halo join: a history row of each site, summed over the sites
    cache: float       # what the chunk keeps across steps: its local adjacencies, what the layers cache on it
    #                    (normalisations, decisions; one entry a chunk, shared by the layers), a local edge
    way_cache: float   # ... and a way's one chunk, as the exact passes run it, a local edge
    params: float      # the parameters' bytes
    detail: Optional[PassDetail] = field(default=None, compare=False)  # (on the rank that measured)

    def as_list(self) -> List[float]:
        return [self.saved, self.boundary, self.history, self.cache, self.way_cache, self.params]


@dataclass(frozen=True)
class StageShare:
    """One stage's share of a training pass (the module docstring's ``a``, ``b``, ``h``; bytes a row) and of the
    parameters (bytes)."""

    a: float
    b: float
    h: float
    params: float
    w: float = -1.0    # the widest layer group's saved bytes a row, the drain's working set (< 0: not known, a)

    @property
    def working(self) -> float:
        return self.a if self.w < 0 else self.w


def stage_shares(m: PassMemory, sizes: Optional[Sequence[int]], params: Optional[Sequence[float]]) \
        -> List[StageShare]:
    """Each stage's :class:`StageShare` for the split ``sizes`` (layer groups a stage) with ``params`` bytes of
    parameters a stage; without the split or ``m``'s detail, one share: the mean stage of ``len(params)`` (or 1)."""
    d = m.detail
    if d is None or sizes is None or params is None or sum(sizes) != len(d.saved):
        S = len(params) if params else max(len(sizes or ()), 1)
        widest = max((sum(g.values()) for g in d.saved), default=0) / d.rows if d is not None else -1.0
        return [StageShare(m.saved / S + m.boundary, m.boundary, m.history / S, m.params / S, widest)]
    shares, g = [], 0
    for s, n in enumerate(sizes):
        held: Dict[int, int] = {}
        for j in range(g, g + n):
            held.update(d.saved[j])
        received = d.crossing[g - 1] if s > 0 else {}
        held.update(received)
        held.update(d.crossing[g + n - 1] if s < len(sizes) - 1 else d.out)
        widest = max(sum(d.saved[j].values()) for j in range(g, g + n)) if n else 0
        shares.append(StageShare(sum(held.values()) / d.rows, sum(received.values()) / d.rows,
                                 sum(d.widths[g:g + n]), float(params[s]), widest / d.rows))
        g += n
    return shares


@dataclass(frozen=True)
class FirstStep:
    """The counted peak of the first training step (it replays, ``recompute="auto"``) per process for a candidate
    chunk count, estimated before any step from one training pass over a chunk (:func:`first_step_peak`)."""

    per_way: int
    resident: int      # structures, layer caches, history and snapshots
    state: int         # gradients and an Adam-sized optimizer state
    activations: int   # what every replayed chunk keeps, one chunk's activations, the pending gradients
    transient: int     # the drain's working set
    stage: int = 0     # the stage it is of (the widest)

    @property
    def peak(self) -> int:
        return self.resident + self.state + self.activations + self.transient


def first_step_peak(m, num_nodes: int, stages: int, ways: int, per_way: int, structures: int, edges: int,
                    hist_rows: int, copies: int, replay: bool = True, offloaded: bool = False,
                    shares: Optional[Sequence[StageShare]] = None, pending_rows: Optional[int] = None) -> FirstStep:
    """The module docstring's counted peak (``resident + state + activations + transient``) of the first step of the
    widest stage, before it: the chunking's ``structures`` and ``edges`` a way and its ``hist_rows`` counted
    (:func:`chunking_bytes`, :func:`history_rows`), the rest from ``m`` (:class:`PassMemory`) as each stage's
    ``shares`` (:func:`stage_shares`; ``None``: the mean stage of ``stages``). ``offloaded``: the history, its
    copies and the pending gradients are in the offload tier (``G`` off the device too). ``pending_rows``: the rows
    of ``G`` where they are not every held row (one way: :func:`fresh_reads`)."""
    if shares is None:
        shares = stage_shares(m, None, [m.params / stages] * stages)[:1]
    R = -(-num_nodes // ways)
    r = -(-R // per_way)
    best = None
    for s, share in enumerate(shares):
        G = 0.0 if offloaded else hist_rows * share.h
        resident = structures + (m.cache + m.way_cache) * edges + copies * G
        if pending_rows is not None and not offloaded:
            G = min(hist_rows, pending_rows) * share.h
        acts = (share.b * R + share.a * r if replay else share.a * R) + G
        got = FirstStep(per_way, int(resident), int(3 * share.params), int(acts), int(share.working * r), s)
        if best is None or got.peak > best.peak:
            best = got
    return best
