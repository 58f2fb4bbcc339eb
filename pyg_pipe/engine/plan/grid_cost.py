"""``grid="auto"``: the rank grid (stages x ways) from a cost model of the step, measured once.

With P devices cut into S pipeline stages x W graph-parallel ways (``S W = P``), k chunks a way and N
vertices, a chunk has ``r = N / (W k)`` rows. Measured once::

    t(r)    = a + b r        one training pass of the whole model over a chunk of r rows: the first chunk of
                             the plan's partition into 2P and into 8P chunks, timed on the planning rank while
                             the others wait (:func:`measure_pass`)
    t_W                      graph parallelism's step, W ways: every rank at once runs a training pass over its
                             way's part of the plan's partition with the halo rows exchanged at every propagate,
                             forward and backward, in the partition's counts, its output rows sent to the other
                             ways and the weight gradients exchanged as the step sends them; the slowest rank's
                             time, for each W > 1 (:mod:`.way_probe`; not timed where a way reads no halo)
    link(n) = α + n / β      one exchange of n bytes each way between ranks 0 and 1 (:func:`measure_link`)

Counted from one training pass over a chunk and from the graph, not timed::

    H_W   halo rows of the most loaded way when the plan's partitioner cuts the graph into W ways
    e_W   what one exchanging call cost in the timed t_W beyond its compute and bytes (the wait for the slowest
          way, the posting): (t_W - t(N / W) - 2 H_W h / β) / (2 n_h), at least α (:func:`exchange_call`)

A stage runs its share of a chunk per tick, ``k + S - 1`` ticks a step (fill and drain)::

    compute  t / S,   t = t_W with one chunk a way (its exchanges included), else t(r)
    halo     2 (n_h / S) e_W + 2 (H_W / k) (h / S) / β     rows from the other ways, gradients back (W > 1, k > 1)
    link     2 (α + r c / β)                               activations forward, gradients back (S > 1)
    tick     = max(compute + halo, link)   with overlap (the next chunk's receive is posted ahead),
               compute + halo + link       without
    step     = tick (k + S - 1) + (S - 1) link  (with overlap: a stage starts the first chunk once its values
                                                 crossed the cuts before it, forward and backward)
               + 2 (W - 1) / W · (p / S) / β    (the weight all-reduce over the ways; in t_W where that is timed)

and, with processes sharing cores, at least ``u W k t`` (:mod:`.chunk_cost`; not for a timed t_W, which ran
with every rank computing). Every way's halo is exchanged once a step whatever k (a chunk sends the rows other
ways read from it), so ``H_W / k`` a tick. Chunks are timed as the plan cuts them (with their halos: on a graph
without locality a chunk joins nearly as many halo rows as it has rows), and a way of graph parallelism is
timed whole, since its halo can make it cost nearly the whole graph's pass. Why the ways are timed at once
with their exchanges and a pipeline's chunk alone: measured in docs/gnnpipe.md (``grid="auto"``) and in
:mod:`.way_probe`'s docstring.

Left out: the output a pipeline's last stage sends to every rank (timed in t_W with the step's other exchanges,
whose waits were half of graph parallelism's step on a 2-layer GCN: docs/gnnpipe.md), the loss and the optimizer
(the same in every grid), the engine's own cost per chunk (history, links, hooks: pipelines with several chunks are
predicted at 0.34 - 0.8 of their step), and partial overlap of the halo exchange with compute (it is waited on
inside the layer).

**Memory.** Where a process's room is known (``memory_budget``, or on an accelerator the least free memory of the
ranks less 10 %: :func:`~.memory_fit.memory_room`), each candidate's first step is estimated before any step as
``num_chunks="auto"`` estimates it under a budget (:func:`~.memory_fit.first_step_estimate`: its partition's
structures and history rows counted, the rest from one training pass over a chunk), and the choice below is made
among the candidates that fit; where none does, the time alone chooses and the line says so. The plan then fits
the chunk count of the grid chosen to the room as ``num_chunks="auto"`` does (:mod:`.memory_fit`).

**The choice** among every ``S x W = P`` with at most one stage a layer group (and ``W = 1`` with
``late_gradients``), k in 1, 2, 4, ... (k = 1 with one stage; ``num_chunks=<int>`` fixes ``C = W k``): the
fewest chunks a way (the least stale history; one is exact) among the candidates whose predicted step is
within :data:`~.chunk_cost.SLACK` of the fastest, the fastest among those; its grid is taken. A slow link moves
the choice towards stages (one cut's rows a chunk), a fast one towards ways (every propagate's halo), a deep model
with few vertices a way towards ways (the bubble). The chunk count of that grid is then ``num_chunks``'s
(``"auto"``: :mod:`.chunk_cost`, measured within 10 % of the fastest count in 6 of 8 settings). This model's own
count leaves out the engine's cost per chunk (history, links: pipelines are predicted at 0.35 - 0.88 of their
measured step, lower the more chunks) and chose 16 chunks where 4 were faster (docs/gnnpipe.md); more chunks
also read more stale rows.

Decided once, on one rank, broadcast, said in one line, and saved with the plan (a checkpoint resumes on
its grid); the strategy hands it from fit to test. ``HybridStrategy(stages=, ways=)`` and
``GraphParallelStrategy`` fix the grid themselves.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ...model.inputs import graph_edges
from .chunk_cost import MAX_PER_WAY, PROBES, SLACK, fit, machine_share
from .decide import root_decides
from .memory_cost import MB
from .way_probe import halo_counts, time_ways

log = logging.getLogger("pyg_pipe")

#: bytes exchanged by the two timings of the link
LINK_SIZES = (1 << 12, 1 << 22)
#: timings of each size (the smallest kept)
LINK_REPEATS = 5


@dataclass(frozen=True)
class GridCosts:
    """What the step of every candidate grid is predicted from (the module docstring's symbols)."""

    num_nodes: int
    a: float                  # seconds of a training pass over a chunk, fixed
    b: float                  # ... and a row
    alpha: float              # seconds of an exchange, fixed
    beta: float               # bytes a second
    h: float                  # bytes a halo row, over every exchanging call of a pass
    sites: int                # n_h
    c: float                  # bytes a row across the widest cut
    p: float                  # the parameters' bytes
    halos: Dict[int, int]     # W -> H_W
    ways: Dict[int, float]    # W -> t_W (seconds)
    shared: float = 0.0       # u
    overlap: bool = True
    calls: Dict[int, float] = field(default_factory=dict)  # W -> e_W, seconds an exchanging call (else α)


def predicted_step(m: GridCosts, S: int, W: int, k: int) -> float:
    """The step of the module docstring for ``S`` stages x ``W`` ways and ``k`` chunks a way (seconds)."""
    r = m.num_nodes / (W * k)
    timed = W > 1 and k == 1 and W in m.ways  # the ways' pass, timed with its exchanges (:mod:`.way_probe`)
    t = m.ways[W] if timed else m.a + m.b * r
    compute = t / S
    halo = 0.0 if W == 1 or timed else (2 * (m.sites / S) * m.calls.get(W, m.alpha)
                                        + 2 * (m.halos[W] / k) * (m.h / S) / m.beta)
    link = 0.0 if S == 1 else 2 * (m.alpha + r * m.c / m.beta)
    tick = max(compute + halo, link) if m.overlap else compute + halo + link
    exposed = (S - 1) * link if m.overlap else 0.0  # (the first chunk's values crossing every cut, both ways)
    step = tick * (k + S - 1) + exposed + (2 * (W - 1) / W * (m.p / S) / m.beta if W > 1 and not timed else 0.0)
    return step if timed else max(step, m.shared * W * k * t)  # (a timed way's pass shared the machine already)


def exchange_call(timed: float, compute: float, transfer: float, sites: int, alpha: float) -> float:
    """e_W: what one exchanging call cost in the ways' timed pass (``timed``) beyond its compute (a chunk's pass
    over the way's rows, ``compute``) and its bytes at the link's speed (``transfer``, each way), shared over the
    pass's ``2 sites`` calls: the wait for the slowest way and the posting, which the link's speed leaves out.
    At least α."""
    return max(alpha, (timed - compute - 2 * transfer) / max(2 * sites, 1))


def candidates(P: int, layers: int, num_nodes: int, chunks: Optional[int], ways_allowed: bool) \
        -> List[Tuple[int, int, int]]:
    """``(S, W, k)`` for every grid of ``P`` devices with at most one stage a layer group, ``k`` chunks a way."""
    out = []
    for W in range(1, P + 1):
        S = P // W
        if P % W or S > max(layers, 1) or (W > 1 and not ways_allowed) or W > num_nodes:
            continue
        if chunks is not None:
            if chunks % W == 0 and chunks <= num_nodes:
                out.append((S, W, chunks // W))
            continue
        cap = 1 if S == 1 else max(1, min(MAX_PER_WAY, num_nodes // W))
        out += [(S, W, 2 ** i) for i in range(int(math.log2(cap)) + 1)]
    return out


@dataclass(frozen=True)
class GridChoice:
    stages: int
    ways: int
    per_way: int
    predicted: Dict[Tuple[int, int, int], float]
    costs: GridCosts
    room: Optional[int] = None                                   # bytes a process may hold, where known
    peaks: Optional[Dict[Tuple[int, int, int], int]] = None      # each candidate's first step, estimated

    def line(self) -> str:
        m = self.costs
        fastest = min(self.predicted, key=self.predicted.get)
        S, W, k = self.stages, self.ways, self.per_way
        by_grid = {}
        for (s, w, kk), v in self.predicted.items():
            by_grid[(s, w)] = min(by_grid.get((s, w), float("inf")), v)
        grids = ", ".join(f"{s}x{w} {v:.3g} s" for (s, w), v in sorted(by_grid.items()))
        return (f"pyg_pipe: grid='auto': {S} stage{'s' * (S > 1)} x {W} way{'s' * (W > 1)} (predicted step "
                f"{self.predicted[(S, W, k)]:.3g} s at {W * k} chunk{'s' * (W * k > 1)}; the fastest "
                f"{self.predicted[fastest]:.3g} s at {fastest[0]}x{fastest[1]}, {fastest[1] * fastest[2]} chunks; "
                f"each grid's best: {grids}); the fewest chunks a way within {SLACK:.0%} of the fastest (link "
                f"{m.alpha * 1e6:.3g} us + {m.beta / 1e9:.3g} GB/s, measured; the chunk count is num_chunks's; "
                f"stages=/ways= of HybridStrategy or grid='pipeline' override){self._memory()}.")

    def _memory(self) -> str:
        if self.room is None or not self.peaks:
            return ""
        fit = sum(1 for v in self.peaks.values() if v <= self.room)
        est = self.peaks[(self.stages, self.ways, self.per_way)] / MB
        if not fit:
            return (f"; memory: no candidate's first step is estimated to fit the room for {self.room / MB:.0f} MB "
                    f"a process (this one {est:.0f} MB), so the time alone chose")
        return (f"; memory: {fit} of {len(self.peaks)} candidates' first steps are estimated to fit the room for "
                f"{self.room / MB:.0f} MB a process, chosen among those (this one {est:.0f} MB)")


def choose(m: GridCosts, options: List[Tuple[int, int, int]], room: Optional[int] = None,
           peaks: Optional[Dict[Tuple[int, int, int], int]] = None) -> GridChoice:
    """The fewest chunks a way among the options within :data:`SLACK` of the fastest, the fastest of those; under a
    memory ``room`` (bytes a process may hold), among the options whose first step's estimated peak (``peaks``)
    fits it, where any does."""
    predicted = {o: predicted_step(m, *o) for o in options}
    pool = options
    if room is not None and peaks:
        pool = [o for o in options if peaks[o] <= room] or options
    best = min(predicted[o] for o in pool)
    near = [o for o in pool if predicted[o] <= (1.0 + SLACK) * best]
    S, W, k = min(near, key=lambda o: (o[2], predicted[o]))
    return GridChoice(S, W, k, predicted, m, room, peaks)


def measure_link(comm, root: int = 0) -> Tuple[float, float]:
    """``(α, β)`` on every rank: ranks 0 and 1 exchange :data:`LINK_SIZES` bytes each way through the
    transport (as a halo exchange does), :data:`LINK_REPEATS` times each, the smallest time kept; ``root``'s
    fit is broadcast. Every rank calls it (ranks above 1 wait)."""
    cuda = comm.device.type == "cuda"
    peer = 1 - comm.rank if comm.rank < 2 else None
    samples = []
    comm.barrier("measuring the link")
    for n in LINK_SIZES:
        buf, best = torch.zeros(n // 4, device=comm.device), float("inf")
        for _ in range(LINK_REPEATS):
            if cuda:
                torch.cuda.synchronize(comm.device)
            t0 = time.perf_counter()
            if peer is not None:
                comm.exchange([(buf, peer)], [((n // 4,), torch.float32, peer)])
            if cuda:
                torch.cuda.synchronize(comm.device)
            best = min(best, time.perf_counter() - t0)
        samples.append((n, best))
    (n1, t1), (n2, t2) = samples
    beta = (n2 - n1) / max(t2 - t1, 1e-9)
    alpha = max(0.0, t1 - n1 / beta)
    got = comm.broadcast(torch.tensor([alpha, beta], dtype=torch.float64), root, "sharing the link's speed")
    return float(got[0]), float(got[1])


def halo_rows(perm: Tensor, ptr: Tensor, edge_index: Tensor, num_nodes: int) -> int:
    """H_W: halo rows of the most loaded part of the partition ``(perm, ptr)`` (distinct sources in other
    parts with an edge into it)."""
    return int(halo_counts(perm, ptr, edge_index, num_nodes).sum(1).max())


def measure_pass(seconds_of: Callable[[Tensor, Tensor], float], partition, num_nodes: int,
                 devices: int) -> Tuple[float, float]:
    """``(a, b)`` of ``t(r) = a + b r``: a training pass timed (``seconds_of(perm, ptr)``) on the first chunk of
    the plan's partition (``partition(1, chunks)``) into ``PROBES`` x ``devices`` chunks."""
    samples = []
    for k in PROBES:
        perm, ptr = partition(1, min(num_nodes, devices * k))
        samples.append((int(ptr[1] - ptr[0]), float(seconds_of(perm, ptr))))
    return fit(samples)


def auto_grid(P: int, layers: int, inputs, config, seconds_of, memory_of, partition, comm, root: int,
              notes: Optional[List[str]] = None) -> Tuple[int, int, Optional[GridChoice]]:
    """``grid="auto"``: ``(S, W, the choice)`` measured and chosen on ``root``, broadcast, said
    in one line (the :class:`GridChoice`, with every candidate's prediction, on ``root`` only).
    ``seconds_of(perm, ptr)`` / ``memory_of(chunking, way_chunking)``: a training pass's seconds and
    :class:`~.first_step.PassMemory` over a chunk; ``partition(ways, chunks)``: the plan's ``(perm, ptr)``.
    Every rank calls it."""
    from .memory_fit import first_step_estimate, memory_room
    N = inputs.num_nodes
    alpha, beta = measure_link(comm, root)
    shared = machine_share(comm, root)
    room = memory_room(config, comm)
    chunks = config.num_chunks if isinstance(config.num_chunks, int) else None
    options = candidates(P, layers, N, chunks, not config.late_gradients)
    said: list = []
    src, dst, _ = graph_edges(inputs.primary)
    halos, ways, refused = time_ways(seconds_of, partition, torch.stack([src, dst]).cpu(), N,  # (every rank)
                                     sorted({o[1] for o in options} - {1}), comm, root)
    halos[1] = 0
    options = [o for o in options if o[1] not in refused] or options  # (none left: the failure shows in the run)
    for W, why in refused.items():
        line = f"pyg_pipe: grid='auto': {W} graph-parallel ways left out: the model failed on a way's part ({why})"
        log.info(line)
        if notes is not None:
            notes.append(line)

    def decide() -> Tensor:  # (the root alone: the other ranks idle while it times a chunk's pass)
        a, b = measure_pass(seconds_of, partition, N, P)
        one = torch.linspace(0, N, P + 1).round().long()
        pm = memory_of((torch.arange(N), torch.linspace(0, N, 2 * P + 1).round().long()), (torch.arange(N), one))
        sites = sum(1 for w in (pm.detail.widths if pm.detail is not None else []) if w > 0)
        calls = {W: exchange_call(t, a + b * N / W, halos[W] * pm.history / beta, sites, alpha)
                 for W, t in ways.items()}
        m = GridCosts(N, a, b, alpha, beta, pm.history, sites, pm.boundary, pm.params, halos, ways, shared,
                      config.overlap, calls)
        peaks = None
        if room is not None:  # each candidate's first step, estimated as num_chunks="auto" does (memory_fit)
            peaks = {(S, W, k): first_step_estimate(pm, config, inputs, S, W, k, *partition(W, W * k))[0].peak
                     for S, W, k in options}
        choice = choose(m, options, room, peaks)
        said.append(choice)
        return torch.tensor([choice.stages, choice.ways], dtype=torch.float64)

    got = root_decides(decide, torch.zeros(2, dtype=torch.float64), comm, root, "choosing the grid").tolist()
    for choice in said:
        log.info(choice.line())
        if notes is not None:
            notes.append(choice.line())
    return int(got[0]), int(got[1]), (said[0] if said else None)


def regrid(shape, module: torch.nn.Module, fn, config, inputs, comm, saved_plan: Optional[dict],
           chosen: Optional[Tuple[int, int]], notes: Optional[List[str]] = None):
    """The engine's ``grid="auto"``: ``(shape, (S, W), the GridChoice where measured here)``.
    ``shape``: the grid of one stage a device (:func:`~.shape.decide_shape`, traced); a checkpoint's plan
    (``saved_plan``) or an earlier engine's choice (``chosen``) is taken instead of measuring again. The chunk
    choice is left to ``num_chunks`` for the grid chosen (``None``; ``"auto"``: :mod:`.chunk_cost`, whose count was
    measured within 10 % of the fastest in 6 of 8 settings, where this model's, which leaves out the engine's cost per
    chunk, chose 16 chunks where 4 were faster: docs/gnnpipe.md). A shape that is not a traced pipeline stays as it
    is."""
    from ..pass_memory import training_pass_memory
    from ..profile import TRAINING_PASSES, training_pass_seconds
    from .shape import Shape
    P = comm.world_size
    if shape.program is None or shape.forced or shape.streaming or P == 1:
        return shape, None, None
    report = None
    if saved_plan is not None:
        S, W = int(saved_plan["stages"]), int(saved_plan["ways"])
    elif chosen is not None:
        S, W = chosen
    else:
        probe = (module, fn, shape.program, shape.groups, inputs, comm.device)
        try:  # (a failure on the measuring rank is raised on every rank: every rank falls back alike)
            S, W, report = auto_grid(P, len(shape.groups), inputs, config,
                                              lambda perm, ptr, halo=None, passes=TRAINING_PASSES:
                                              training_pass_seconds(*probe, passes, chunking=(perm, ptr), halo=halo),
                                              lambda *cuts: training_pass_memory(*probe, *cuts),
                                              lambda ways, chunks: way_partition(config, inputs, ways, chunks),
                                              comm, 0, notes)
        except Exception as exc:  # noqa: BLE001 - a model the timing pass cannot run still trains, on one stage a
            line = (f"pyg_pipe: grid='auto' could not time a training pass of the model ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:160] if str(exc) else ''}); one stage a device, as grid='pipeline' "
                    f"runs it.")  # device (whatever made the pass fail shows in the run, named)
            log.info(line)
            if notes is not None:
                notes.append(line)
            return shape, (shape.stages, shape.ways), None
    if (S, W) != (shape.stages, shape.ways):
        shape = Shape(S, W, shape.program if S > 1 else None, shape.groups if S > 1 else None, False, W > 1,
                      shape.notes)
    return shape, (S, W), report


def way_partition(config, inputs, ways: int, chunks: int) -> Tuple[Tensor, Tensor]:
    """``(perm, ptr)`` of the graph in ``chunks`` chunks for ``ways`` ways, as the plan partitions it."""
    from .plan import _partition
    src, dst, _ = graph_edges(inputs.primary)
    if callable(config.partition):
        perm, ptr = config.partition(torch.stack([src, dst]).cpu(), inputs.num_nodes, chunks)
        return torch.as_tensor(perm, dtype=torch.long), torch.as_tensor(ptr, dtype=torch.long)
    return _partition(config, src, dst, inputs.num_nodes, chunks, ways)
