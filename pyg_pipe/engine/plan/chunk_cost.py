"""``num_chunks="auto"``: the chunk count from a cost model of the pipelined step, measured once.

More chunks a way shrink the pipeline bubble but cost a fixed overhead per chunk (every layer runs once
more, on fewer rows) and read more neighbours from history (staleness: docs/convergence.md). With ``S``
stages and ``W`` ways, ``k`` chunks a way and ``N`` vertices, a chunk has ``r = N / (W k)`` rows and::

    t(r)     = a + b r                  one training pass (forward and backward) of the whole model over
                                        one chunk (seconds)
    step(k)  = (t(r) / S) (k + S - 1)   one stage's share of it, over the k + S - 1 ticks of fill and drain

That takes a stage waiting in the bubble as idle. When the processes of a machine share its cores (CPU
devices: ``p`` processes of ``T`` threads each on ``c`` cores, ``p T > c``), a waiting stage gives its core
to another, and the step is at least the machine's share of all the work over its cores::

    step(k)  = max((t(r) / S) (k + S - 1),  u W k t(r)),   u = (p / P) T / c

(``W k t(r)``: every chunk of every way through the whole model; ``p / P`` of it on this machine; the
probe's seconds with ``T`` threads, ``T`` cores busy.) With ``p T <= c``, or on GPUs, ``u = 0``. Measured
on 2 cores with 4 single-thread processes (docs/gnnpipe.md): without this term the choice on a random
graph was 8 chunks, 1.45x the fastest (4).

``a`` (the per-chunk cost: launches, Python, halo bookkeeping, autograd's recording) and ``b`` (the cost
per row) come from timing a training pass of the model on the first chunk of two contiguous chunkings
(``k = 2 S`` and ``k = 8 S`` a way; :func:`~..profile.training_pass_seconds`: the forward with autograd through the
layer hooks, as the pipeline runs a chunk, and the backward to the parameters). Until 2026-11-27 a no-grad
forward was timed (the measurement of ``balance="time"``) and taken three times: the step it predicted was
1.3 - 1.5x below the measured one on 2 processes (docs/gnnpipe.md). A pass of every layer over ``N / (2 S W)``
rows holds half the activations a stage holds over its ``N / W`` rows, so the probe fits where the pipeline
does. The other ranks wait while the rank that measures runs it (:func:`~.decide.root_decides`): the probe
times the model on a machine that is otherwise idle. The choice is the fewest
chunks a way, among 1, 2, 4, ... (at most ``N / W``), whose predicted step is within ``SLACK`` of the
fastest: the least stale history for nearly the best time.

One chunk a way (``k = 1``, exact: no history) is not predicted from the line but timed itself, ``t(N / W)``
(:func:`measure_whole`): a training pass over the way's whole share, one layer group at a time so that it holds
one group's activations, not a stage's (:func:`~..profile.grouped_pass_seconds`). The line through two small
chunks counts their halo rows (neighbours outside the chunk, which a small chunk reads for up to several times
its own rows on a graph without locality) as the cost of their own rows, and one chunk of a way's whole share
reads none: on a 2-layer GCN over a random 20k-vertex graph it put one chunk at 2x its pass and chose 4 chunks,
1.5 - 1.9x slower than one (docs/gnnpipe.md). Under a memory budget that scales the probes down it is not run.
Transfers are left out (the stage link sends every row once a step whatever ``k``; the halo exchange between ways
does not depend on ``k`` either).

Under a memory budget (``memory_budget``; on an accelerator the least free memory of the ranks) the count is
then doubled until the first step's peak, estimated before it, fits (:mod:`.memory_fit`; docs/memory.md).

It is decided once, on one rank, broadcast (:func:`choose_chunks`), and saved in checkpoints with
the plan (a resume reuses the saved count); an integer ``num_chunks`` overrides it. One stage has no
bubble: ``k = 1`` (exact). Streaming (one device) keeps its own rule (:func:`~.plan.stream_chunks`, from memory).
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from .decide import root_decides

log = logging.getLogger(__name__)

#: a plan within this share of the fastest predicted step counts as fast
SLACK = 0.10
#: chunks a way the two measurements use, per stage
PROBES = (2, 8)
#: chunks a way considered: 1, 2, 4, ... up to this
MAX_PER_WAY = 64


@dataclass(frozen=True)
class ChunkChoice:
    """What :func:`choose` decided, and the model it decided from (for the log line and the benchmark)."""

    per_way: int
    per_chunk_s: float          # a
    per_row_s: float            # b
    predicted: dict             # chunks a way -> predicted step seconds
    shared: float = 0.0         # u: the share of all the work a core of this machine does (0: not shared)
    whole: Optional[float] = None   # t(N / W): one chunk a way's pass, measured (None: from a and b)
    whole_failed: Optional[str] = None  # why that pass could not be timed, when it was tried and failed

    def line(self, stages: int, ways: int) -> str:
        fastest = min(self.predicted, key=self.predicted.get)
        n = self.per_way * ways
        failed = "" if self.whole_failed is None else f"; one chunk a way could not be timed ({self.whole_failed})"
        return (f"pyg_pipe: num_chunks='auto': {n} chunk{'s' * (n > 1)} ({self.per_way} a way over {stages} "
                f"stages); predicted step {self.predicted[self.per_way]:.3g} s, the fastest "
                f"{self.predicted[fastest]:.3g} s at {fastest * ways}; the fewest chunks within {SLACK:.0%} of it "
                f"read the least stale history (a chunk {self.per_chunk_s * 1e3:.3g} ms + "
                f"{self.per_row_s * 1e6:.3g} us a row, measured"
                f"{'' if self.whole is None else f'; one chunk a way {self.whole * 1e3:.3g} ms, measured'}"
                f"{failed}"
                f"{'; the processes share the cores' if self.shared else ''}; num_chunks=<int> overrides).")


def predicted_step(a: float, b: float, num_nodes: int, stages: int, ways: int, per_way: int,
                   shared: float = 0.0, whole: Optional[float] = None) -> float:
    """``step(k)`` of the module docstring (``shared``: ``u``; ``whole``: ``t(N / W)`` measured, for ``k = 1``)."""
    t = whole if per_way == 1 and whole is not None else a + b * num_nodes / (ways * per_way)
    return max(t / stages * (per_way + stages - 1), shared * ways * per_way * t)


def shared_cores(local: int, world: int, threads: int, cores: int) -> float:
    """``u`` of the module docstring: ``local`` of the ``world`` processes on this machine, ``threads`` each,
    ``cores`` usable; 0 when they do not outnumber the cores."""
    if local * threads <= cores:
        return 0.0
    return local / world * threads / max(cores, 1)


def choose(a: float, b: float, num_nodes: int, stages: int, ways: int, shared: float = 0.0,
           whole: Optional[float] = None, whole_failed: Optional[str] = None) -> ChunkChoice:
    """The fewest chunks a way whose predicted step is within :data:`SLACK` of the fastest (``whole``: the
    pass over one chunk a way, measured)."""
    cap = max(1, min(MAX_PER_WAY, num_nodes // ways))
    ks, k = [], 1
    while k <= cap:
        ks.append(k)
        k *= 2
    if stages == 1:
        ks = [1]
    predicted = {k: predicted_step(a, b, num_nodes, stages, ways, k, shared, whole) for k in ks}
    best = min(predicted.values())
    per_way = next(k for k in ks if predicted[k] <= (1.0 + SLACK) * best)
    return ChunkChoice(per_way, a, b, predicted, shared, whole, whole_failed)


def fit(samples: List[tuple]) -> tuple:
    """``(a, b)`` of ``t(r) = a + b r`` through two ``(rows, seconds)`` samples, neither below 0 (a
    smaller chunk timed slower, which is noise, makes all of it the fixed cost: their mean)."""
    (r1, t1), (r2, t2) = samples
    b = (t1 - t2) / (r1 - r2) if r1 != r2 else 0.0
    if b <= 0.0:
        return (t1 + t2) / 2, 0.0
    return max(0.0, t1 - b * r1), b


def measure(seconds_of: Callable[[Tensor, Tensor], float], num_nodes: int, stages: int, ways: int,
            scale: int = 1) -> tuple:
    """``(a, b)`` from a training pass timed on the first chunk of contiguous chunkings with :data:`PROBES`
    times ``stages`` chunks a way (``seconds_of(perm, ptr)``); ``scale`` times more chunks where a memory budget
    leaves no room for the larger probe (:func:`~.memory_fit.probe_scale`)."""
    samples = []
    for k in PROBES:
        C = min(num_nodes, ways * k * stages * scale)
        ptr = torch.linspace(0, num_nodes, C + 1).round().long()
        seconds = float(seconds_of(torch.arange(num_nodes), ptr))
        samples.append((int(ptr[1] - ptr[0]), seconds))
    return fit(samples)


def measure_whole(whole_of: Optional[Callable[[Tensor, Tensor], float]], num_nodes: int, ways: int,
                  failed: Optional[List[str]] = None) -> Optional[float]:
    """``t(N / W)``, one chunk a way's training pass over the first of ``W`` contiguous chunks, measured
    (:func:`~..profile.grouped_pass_seconds`; why: the module docstring), or ``None`` (not measured, or it failed:
    then ``a + b N / W`` stands, and why it failed is appended to ``failed``)."""
    if whole_of is None:
        return None
    ptr = torch.linspace(0, num_nodes, ways + 1).round().long()
    try:
        return float(whole_of(torch.arange(num_nodes), ptr))
    except Exception as exc:  # noqa: BLE001 - the probes' line stands (a failure the run would meet shows in the run)
        if failed is not None:
            failed.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
        return None


def auto_chunks(seconds_of: Callable[[Tensor, Tensor], float], num_nodes: int, stages: int, ways: int,
                fallback: int, shared: float = 0.0, scale: int = 1,
                whole_of: Optional[Callable[[Tensor, Tensor], float]] = None) -> Tuple[int, str, Optional[float]]:
    """``num_chunks="auto"`` on the rank that measures: ``(chunks, the line that says why, the predicted step
    in seconds)``; ``fallback`` chunks (the rule of ``num_chunks=None``, no prediction) where the layers cannot
    be timed; ``shared``: ``u`` (:func:`shared_cores`); ``whole_of``: the pass over one chunk a way, layer group
    by layer group (:func:`measure_whole`). (The plan broadcasts it.)"""
    if stages == 1:
        return ways, "", None
    try:
        a, b = measure(seconds_of, num_nodes, stages, ways, scale)
    except Exception as exc:  # noqa: BLE001 - a model the timing pass cannot run still trains, with the fixed rule
        return fallback, (f"pyg_pipe: num_chunks='auto' could not time a training pass of the model "
                          f"({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]}); using {fallback} chunks (the rule of num_chunks=None: 4 "
                          f"per stage a way). Pass num_chunks=<int> to choose."), None
    failed: List[str] = []
    whole = measure_whole(whole_of, num_nodes, ways, failed) if scale == 1 else None
    choice = choose(a, b, num_nodes, stages, ways, shared, whole, failed[0] if failed else None)
    return choice.per_way * ways, choice.line(stages, ways), choice.predicted[choice.per_way]


def choose_chunks(pass_seconds: Optional[Callable[[Tensor, Tensor], float]], num_nodes: int, stages: int, ways: int,
                  fixed: int, comm, root: int, notes: Optional[List[str]] = None, scale: int = 1,
                  whole_seconds: Optional[Callable[[Tensor, Tensor], float]] = None) -> Tuple[int, Optional[float]]:
    """``num_chunks="auto"`` (:mod:`.chunk_cost`): measured and chosen on ``root``, broadcast, said in one line.
    Returns the count and the step predicted for it (seconds; ``None`` when nothing was measured). ``scale``: of
    :func:`measure`."""
    if pass_seconds is None or stages == 1:
        return fixed, None
    said: List[str] = []
    shared = machine_share(comm, root)

    def decide() -> Tensor:
        chunks, line, predicted = auto_chunks(pass_seconds, num_nodes, stages, ways, fixed, shared, scale,
                                              whole_seconds)
        said.append(line)
        return torch.tensor([chunks, -1.0 if predicted is None else predicted], dtype=torch.float64)

    got = root_decides(decide, torch.zeros(2, dtype=torch.float64), comm, root, "choosing num_chunks").tolist()
    for line in said:
        log.info(line)
        if notes is not None:
            notes.append(line)
    return int(got[0]), (got[1] if got[1] >= 0 else None)


def machine_share(comm, root: int) -> float:
    """``u`` of :mod:`.chunk_cost` for ``root``'s machine: its processes (ranks with its host name), their
    threads and its usable cores; 0 on GPUs (each process has a device of its own)."""
    if comm.device.type != "cpu":
        return 0.0
    hosts = comm.all_gather_objects(socket.gethostname(), "finding the processes of each machine")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return shared_cores(hosts.count(hosts[root]), len(hosts), torch.get_num_threads(), cores)
