"""Where a stage's time goes in a training step: computing chunks, waiting for transfers, the bubble.

Every chunk of the fill and of the drain is one span on this rank's host clock, and the time the rank
spent blocked in a receive, an exchange or a collective meanwhile (:attr:`Comm.waited <.comm.Comm>`)
is taken out of it. A stage waits for the first chunk of a phase until the stages before it (fill)
or after it (drain) have worked through theirs: that wait is the pipeline's bubble::

    stage 1 of 2, 4 chunks     fill   [b|c0 ][w|c1 ][c2 ][c3 ][b|out]  drain  [b|c3 ][c2 ][w|c1 ][c0 ]
                               b: waiting for the first chunk of a phase, or for
                                  the last stage's output at the end of the fill  -> time/bubble
                               w: waiting for a later chunk's values or gradients -> time/wait
                               c: computing (posting sends included)              -> time/compute

A GPipe-style fill and drain with ``S`` stages and ``C`` chunks of equal cost idles ``(S-1)/(C+S-1)``
of each phase on every stage (:func:`bubble_share`); ``bubble / (bubble + wait + compute)`` is the
measured counterpart. The metrics are logged per training epoch as ``time/compute``, ``time/wait``,
``time/bubble`` (seconds per step, the largest over the ranks) and ``time/bubble_share``; with
``timeline_trace=path`` every rank's spans are written as one Chrome trace (``chrome://tracing``,
Perfetto) when training ends.

Host clocks measure a GPU's kernel launches, not the kernels, so the timeline is recorded on CPU
devices only (a CUDA version needs CUDA events; not built yet).
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List


@dataclass
class Span:
    """One chunk of one phase (``"fill"`` / ``"drain"``) on this rank: host seconds, and those spent waiting."""

    step: int
    phase: str
    chunk: int
    start: float
    end: float
    waited: float
    first: bool
    name: str = ""


def bubble_share(stages: int, chunks: int) -> float:
    """``(S-1)/(C+S-1)``: the share of a fill (or drain) phase a stage idles with ``C`` equal chunks."""
    return (stages - 1) / (chunks + stages - 1)


class Timeline:
    """Spans of this rank's chunks, summed per training step (module docstring).

    Args:
        comm: the transport whose ``waited`` seconds are taken out of the chunks' time.
        on: record at all (CPU devices).
        keep: keep every span for :meth:`chrome_events` (``timeline_trace``).
    """

    def __init__(self, comm, on: bool, keep: bool = False):
        self.comm, self.on, self.keep = comm, on, keep
        self.step = 0
        self.spans: List[Span] = []
        self.kept: List[Span] = []
        self.totals: List[Dict[str, float]] = []     # one entry per step, until read by the logger

    @contextmanager
    def chunk(self, phase: str, chunk: int, first: bool, name: str = ""):
        """A span of ``phase``: chunk ``chunk``'s work, or (``name``) other work of the phase whose waits
        are the bubble too when ``first`` (the fill's end: every rank waits for the last stage's output)."""
        if not self.on:
            yield
            return
        w0, t0 = self.comm.waited, time.time()
        try:
            yield
        finally:
            self.spans.append(Span(self.step, phase, chunk, t0, time.time(), self.comm.waited - w0, first, name))

    def end_step(self) -> None:
        """The step is over: its spans become one entry of :attr:`totals`."""
        if self.spans:
            bubble = sum(s.waited for s in self.spans if s.first)
            wait = sum(s.waited for s in self.spans if not s.first)
            compute = sum(s.end - s.start - s.waited for s in self.spans)
            self.totals.append({"compute": compute, "wait": wait, "bubble": bubble})
            if self.keep:
                self.kept.extend(self.spans)
        self.spans = []
        self.step += 1

    def take(self) -> List[Dict[str, float]]:
        """The totals of the steps since the last call."""
        out, self.totals = self.totals, []
        return out

    def chrome_events(self, rank: int) -> List[dict]:
        """The kept spans as Chrome trace events: one process per rank, the chunks on one row and their
        waits on another (drawn at the chunk's start, where its receive waits); wall-clock microseconds,
        so ranks on one machine line up."""
        events = []
        for s in self.kept:
            args = {"step": s.step, "chunk": s.chunk}
            if s.waited > 0:
                kind = "bubble" if s.first else "wait"
                events.append({"name": kind, "cat": s.phase, "ph": "X", "pid": rank, "tid": 1,
                               "ts": s.start * 1e6, "dur": s.waited * 1e6, "args": args})
            events.append({"name": s.name or f"{s.phase} c{s.chunk}", "cat": s.phase, "ph": "X", "pid": rank, "tid": 0,
                           "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6, "args": args})
        return events


def write_trace(path: str, events: List[dict]) -> None:
    """Writes ``events`` as a Chrome trace file (``{"traceEvents": [...]}``), creating its directory."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
