"""``num_chunks="auto"``: the chunk count from a cost model of the pipelined step, measured once.

More chunks a way shrink the pipeline bubble but cost a fixed overhead per chunk (every layer runs once
more, on fewer rows) and read more neighbours from history (staleness: docs/convergence.md). With ``S``
stages and ``W`` ways, ``k`` chunks a way and ``N`` vertices, a chunk has ``r = N / (W k)`` rows and::

    t(r)     = a + b r                  one training pass (forward and backward) of the whole model over
                                        one chunk (seconds)
    step(k)  = (t(r) / S) (k + S - 1)   one stage's share of it, over the k + S - 1 ticks of fill and drain

``a`` (the per-chunk cost: launches, Python, halo bookkeeping, autograd's recording) and ``b`` (the cost
per row) come from timing a training pass of the model on the first chunk of two contiguous chunkings
(``k = 2 S`` and ``k = 8 S`` a way; :func:`~..profile.training_pass_seconds`: the forward with autograd through the
layer hooks, as the pipeline runs a chunk, and the backward to the parameters). Until 2026-11-27 a no-grad
forward was timed (the measurement of ``balance="time"``) and taken three times: the step it predicted was
1.3 - 1.5x below the measured one on 2 processes (docs/gnnpipe.md). A pass of every layer over ``N / (2 S W)``
rows holds half the activations a stage holds over its ``N / W`` rows, so the probe fits where the pipeline
does. The other ranks wait while the rank that measures runs it (:func:`~.plan.root_decides`): the probe
times the model on a machine that is otherwise idle. The choice is the fewest
chunks a way, among 1, 2, 4, ... (at most ``N / W``), whose predicted step is within ``SLACK`` of the
fastest: the least stale history for nearly the best time. Transfers are left out (the stage link sends
every row once a step whatever ``k``; the halo exchange between ways does not depend on ``k`` either).

It is decided once, on one rank, broadcast (:func:`~.plan.choose_chunks`), and saved in checkpoints with
the plan (a resume reuses the saved count); an integer ``num_chunks`` overrides it. One stage has no
bubble: ``k = 1`` (exact). Streaming (one device) keeps its own rule (:func:`~.plan.stream_chunks`, from memory).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

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

    def line(self, stages: int, ways: int) -> str:
        fastest = min(self.predicted, key=self.predicted.get)
        n = self.per_way * ways
        return (f"pyg_pipe: num_chunks='auto': {n} chunk{'s' * (n > 1)} ({self.per_way} a way over {stages} "
                f"stages); predicted step {self.predicted[self.per_way]:.3g} s, the fastest "
                f"{self.predicted[fastest]:.3g} s at {fastest * ways}; the fewest chunks within {SLACK:.0%} of it read the least stale "
                f"history (a chunk {self.per_chunk_s * 1e3:.3g} ms + {self.per_row_s * 1e6:.3g} us a row, measured; "
                f"num_chunks=<int> overrides).")


def predicted_step(a: float, b: float, num_nodes: int, stages: int, ways: int, per_way: int) -> float:
    """``step(k)`` of the module docstring."""
    rows = num_nodes / (ways * per_way)
    return (a + b * rows) / stages * (per_way + stages - 1)


def choose(a: float, b: float, num_nodes: int, stages: int, ways: int) -> ChunkChoice:
    """The fewest chunks a way whose predicted step is within :data:`SLACK` of the fastest."""
    cap = max(1, min(MAX_PER_WAY, num_nodes // ways))
    ks, k = [], 1
    while k <= cap:
        ks.append(k)
        k *= 2
    if stages == 1:
        ks = [1]
    predicted = {k: predicted_step(a, b, num_nodes, stages, ways, k) for k in ks}
    best = min(predicted.values())
    per_way = next(k for k in ks if predicted[k] <= (1.0 + SLACK) * best)
    return ChunkChoice(per_way, a, b, predicted)


def fit(samples: List[tuple]) -> tuple:
    """``(a, b)`` of ``t(r) = a + b r`` through two ``(rows, seconds)`` samples, neither below 0 (a
    smaller chunk timed slower, which is noise, makes all of it the fixed cost: their mean)."""
    (r1, t1), (r2, t2) = samples
    b = (t1 - t2) / (r1 - r2) if r1 != r2 else 0.0
    if b <= 0.0:
        return (t1 + t2) / 2, 0.0
    return max(0.0, t1 - b * r1), b


def measure(seconds_of: Callable[[Tensor, Tensor], float], num_nodes: int, stages: int, ways: int) -> tuple:
    """``(a, b)`` from a training pass timed on the first chunk of contiguous chunkings with :data:`PROBES`
    times ``stages`` chunks a way (``seconds_of(perm, ptr)``)."""
    samples = []
    for k in PROBES:
        C = min(num_nodes, ways * k * stages)
        ptr = torch.linspace(0, num_nodes, C + 1).round().long()
        seconds = float(seconds_of(torch.arange(num_nodes), ptr))
        samples.append((int(ptr[1] - ptr[0]), seconds))
    return fit(samples)


def auto_chunks(seconds_of: Callable[[Tensor, Tensor], float], num_nodes: int, stages: int, ways: int,
                fallback: int) -> Tuple[int, str, Optional[float]]:
    """``num_chunks="auto"`` on the rank that measures: ``(chunks, the line that says why, the predicted step
    in seconds)``; ``fallback`` chunks (the rule of ``num_chunks=None``, no prediction) where the layers cannot
    be timed. (The plan broadcasts it.)"""
    if stages == 1:
        return ways, "", None
    try:
        a, b = measure(seconds_of, num_nodes, stages, ways)
    except Exception as exc:  # noqa: BLE001 - a model the timing pass cannot run still trains, with the fixed rule
        return fallback, (f"pyg_pipe: num_chunks='auto' could not time a training pass of the model "
                          f"({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]}); using {fallback} chunks (the rule of num_chunks=None: 4 "
                          f"per stage a way). Pass num_chunks=<int> to choose."), None
    choice = choose(a, b, num_nodes, stages, ways)
    return choice.per_way * ways, choice.line(stages, ways), choice.predicted[choice.per_way]
