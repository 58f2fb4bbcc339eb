"""Historical embeddings: one buffer per (propagate call site, source argument), per call of the model.

A *call site* is one neighbour access of the model: the k-th ``propagate`` (or ``edge_updater``)
call of one ``MessagePassing`` module within one run of a stage (so K-hop layers such as APPNP
have K sites, each with its own history). Its *source arguments* are the tensors the layer reads
at the sources of edges (``x`` for ``x_j``). Rows are stored vertex-first, in new (chunk) ids.

A model called several times in one training step (an encoder run on the graph and on a corrupted
copy, as contrastive methods do) keeps one :class:`CallHistory` per call, so each call reads the
rows its own earlier chunks and steps wrote, never another call's.

Within a step the buffer of a site holds, for every vertex, the row last written: rows of chunks
already run this step are fresh, the others historical (:mod:`..plan.schedule`). The
drain accumulates, per site, the gradients of fresh cross-chunk reads (``G``), added to the
owner chunk's rows when its backward runs.

Buffers hold only the rows another chunk can read: the endpoints of edges between chunks (over every
graph of the call, both edge directions), and with graph-parallel ways (hybrid) only those with an
end in the way's rows: its own boundary rows and the rows it reads from other ways, not |V|. A
|V|-entry map turns vertex ids into buffer rows; a chunk's rows that nobody else reads are never
written. Per-process history then falls with the ways, and with the locality of the chunks.

With ``late_gradients`` the gradients of stale reads are kept too, in a second buffer per site, and
the owners take them in the next step's drain, with that step's fresh ones (PipeGCN's stale feature
gradients: nothing is dropped, so T3's scaling is off; :mod:`..plan.schedule`).

Snapshots (T2, ``period = R``): at the start of step ``t`` the buffers are copied to a snapshot
when ``t % R == 0`` (or when a buffer has none yet) and restored from it otherwise, so historical
rows are an anchor refreshed every R steps instead of whatever the last step left.

Smoothing (``smoothing = γ``, PipeGCN's momentum on stale features): then the rows a step starts
with, and so every stale read, are a moving average over steps of what T2 would give,
``s_t = γ·s_{t-1} + (1-γ)·h_t`` (``s`` restarts from ``h`` after an exact refill); fresh reads still
see the rows written this step. One more buffer per site.

This module is the one place that owns these buffers; where their bytes sit (the device, host
memory, files on disk) is :mod:`.tiers`' business.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import torch
from torch import Tensor

from .pending import Pending
from .tiers import Tiers


class Slot(NamedTuple):
    """Where one chunk's rows and halo sit in the buffer of one key (:meth:`CallHistory.slot`): decided once,
    then only indexed."""

    buf: Tensor                  # the buffer
    into: Tensor                 # the buffer rows the chunk's held rows are written to (one slice)
    pos: Optional[Tensor]        # which of the chunk's rows are held (``None``: all)
    halo: Tensor                 # the buffer rows of the chunk's halo


class CallHistory:
    """Buffers of historical rows and of pending cross-chunk gradients of one call, keyed by ``"site:arg"``.

    Args:
        num_nodes: |V|.
        device: the rank's device.
        tiers: where buffers are allocated (:mod:`.tiers`; default: the device).
        rows: the vertex ids (new, ascending) this rank's buffers hold (``None``: all of them); every halo
            row of this rank's chunks must be among them.
        dtype: the dtype floating-point rows are kept in (``history_dtype``; ``None``: as computed). Reads hand
            them out in the dtype of the rows they stand for.

    Attributes:
        initialised: whether the buffers were filled by an exact pass (or restored from a checkpoint).
        edge_inputs: the identity of the per-edge inputs the buffers were computed with (new values on
            the same graph refill them; :mod:`..step.pipeline`).
    """

    def __init__(self, num_nodes: int, device: torch.device, tiers: Optional[Tiers] = None,
                 rows: Optional[Tensor] = None, dtype: Optional[torch.dtype] = None):
        self.num_nodes = num_nodes
        self.device = device
        self.dtype = dtype
        self.tiers = tiers if tiers is not None else Tiers(device)
        self.size, self.local = num_nodes, None          # buffer rows; vertex id -> buffer row (None: the same)
        self._spans: Dict[tuple, tuple] = {}
        self._maps: Dict[int, tuple] = {}
        self._slots: Dict[tuple, tuple] = {}
        if rows is not None:
            self.size = rows.numel()
            self.local = torch.full((num_nodes,), -1, dtype=torch.long, device=device)
            self.local[rows.to(device)] = torch.arange(self.size, device=device)
        self.buffers: Dict[str, Tensor] = {}
        self.snapshot: Dict[str, Tensor] = {}
        self.smooth: Dict[str, Tensor] = {}      # the moving average of the rows steps start with (smoothing)
        self.grads: Dict[str, Tensor] = {}
        self.pending = Pending()                  # the drain's pending gradients of fresh reads, as the rows read
        self.late: Dict[str, Tensor] = {}        # gradients of this step's stale reads (late_gradients) ...
        self.late_in: Dict[str, Tensor] = {}     # ... and of the last step's, which the owners take now
        self.start: Dict[str, Tensor] = {}       # the rows at the start of the step (for replays)
        self._spare: Dict[str, Dict[str, Tensor]] = {}
        self.initialised = False
        self.edge_inputs: tuple = ()
        # the step whose weights computed the rows (None: refilled by an exact pass just now), for the
        # buffers and the snapshot; and the rows read stale this step (:meth:`age`)
        self.written: Optional[int] = None
        self._snapshot_written: Optional[int] = None
        self._start_written: Optional[int] = None
        self._step = 0
        self.refresh_due = False  # a bound asked for an exact refill before the next step (:mod:`..step.pipeline`)

    # ------------------------------------------------------------------ rows
    def buffer(self, key: str, like: Tensor) -> Tensor:
        """The buffer of ``key``, created (zeros) with ``like``'s trailing shape and dtype."""
        buf = self.buffers.get(key)
        if buf is None:
            dtype = self.dtype if self.dtype is not None and like.is_floating_point() else like.dtype
            buf = self.buffers[key] = self.tiers.zeros((self.size, *like.shape[1:]), dtype)
        return buf

    def slot(self, key: str, lg, like: Tensor) -> Optional[Slot]:
        """The :class:`Slot` of chunk ``lg`` (a :class:`~pyg_pipe.graph.chunks.LocalGraph`) in the buffer of
        ``key``, or ``None`` where the buffer cannot be read and written in place by ``like``'s rows (kept in
        another dtype, on another device, or in a tier). Kept while the buffer is the same tensor."""
        buf = self.buffer(key, like)
        hit = self._slots.get((key, id(lg)))
        if hit is not None and hit[0] is buf and hit[1] is lg:
            return hit[2]
        slot = None
        if buf.device == like.device and buf.dtype == like.dtype and not self.tiers.in_tier(buf):
            pos, at = self.span(lg.start, lg.end, buf)
            slot = Slot(buf, buf[at], pos, self.positions(lg.halo, buf))  # (the halo's rows: one tensor a chunk)
        self._slots[(key, id(lg))] = (buf, lg, slot)
        return slot

    def positions(self, ids: Tensor, buf: Tensor) -> Tensor:
        """Buffer rows of the vertices ``ids``, on ``buf``'s device (the map's lookup kept per ``ids`` tensor:
        a chunk's halo ids are the same tensor every step)."""
        if self.local is None:
            return ids if ids.device == buf.device else ids.to(buf.device)
        hit = self._maps.get(id(ids))
        if hit is None or hit[0] is not ids or hit[1].device != buf.device:
            while len(self._maps) >= 64:  # the oldest first (a step's routes make new id tensors)
                self._maps.pop(next(iter(self._maps)))
            hit = self._maps[id(ids)] = (ids, self.local[ids].to(buf.device))
        return hit[1]

    def span(self, start: int, end: int, buf: Tensor):
        """``(positions, buffer rows)`` of the held vertices among ``start .. end-1``: positions within the
        span (``None``: all of them), and the buffer rows, always one slice (buffer rows follow vertex ids),
        computed once per span."""
        if self.local is None:
            return None, slice(start, end)
        key = (start, end, buf.device)
        hit = self._spans.get(key)
        if hit is None:
            sel = self.local[start:end]
            pos = torch.nonzero(sel >= 0).view(-1)
            at = slice(int(sel[pos[0]]), int(sel[pos[-1]]) + 1) if pos.numel() else slice(0, 0)
            hit = self._spans[key] = (None if pos.numel() == end - start else pos.to(buf.device), at)
        return hit

    def _reused(self, role: str, key: str, shape, dtype: torch.dtype) -> Tensor:
        """The tensor ``role`` used for ``key`` before when it fits, else a new one from the tiers (a tier's
        files and the device budget are then taken once, not every step)."""
        spare = self._spare.setdefault(role, {})
        t = spare.get(key)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            t = spare[key] = self.tiers.zeros(shape, dtype)
        return t

    def write(self, key: str, start: int, rows: Tensor) -> None:
        """Stores the rows ``start .. start + len(rows) - 1`` (vertex-first, detached)."""
        buf = self.buffer(key, rows)
        pos, at = self.span(start, start + rows.size(0), buf)
        rows = rows.detach()
        into = buf.narrow(0, at.start, at.stop - at.start)
        if pos is None:
            into.copy_(rows)
        elif rows.device == buf.device and rows.dtype == buf.dtype:
            torch.index_select(rows, 0, pos, out=into)  # the held rows gathered straight into the buffer
        else:
            into.copy_(rows.index_select(0, pos))
        self.tiers.release(buf)

    def write_ids(self, key: str, ids: Tensor, rows: Tensor) -> None:
        """Stores ``rows`` at the vertices ``ids``."""
        buf = self.buffer(key, rows)
        buf.index_copy_(0, self.positions(ids, buf), rows.detach().to(buf.device, buf.dtype))
        self.tiers.release(buf)

    def read(self, key: str, ids: Tensor, like: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """The stored rows ``ids`` (a copy, on the device; into ``out`` when given)."""
        buf = self.buffer(key, like)
        at = self.positions(ids, buf)
        if out is not None and buf.device == out.device and buf.dtype == out.dtype:
            rows = torch.index_select(buf, 0, at, out=out)
        else:
            rows = self.tiers.to_device(buf.index_select(0, at))
            rows = rows if rows.dtype == like.dtype else rows.to(like.dtype)
            if out is not None:
                rows = out.copy_(rows)
        self.tiers.release(buf)
        return rows

    def read_start(self, key: str, ids: Tensor, like: Tensor) -> Tensor:
        """The rows ``ids`` as they were at the start of the step (kept with ``begin_step(keep_start=True)``;
        a buffer created during the step started as zeros)."""
        start = self.start.get(key)
        if start is None:
            return like.new_zeros((ids.numel(), *like.shape[1:]))
        rows = self.tiers.to_device(start.index_select(0, self.positions(ids, start)))
        rows = rows if rows.dtype == like.dtype else rows.to(like.dtype)
        self.tiers.release(start)
        return rows

    # ------------------------------------------------------------------ gradients of fresh reads
    def add_grad(self, key: str, ids: Tensor, grad: Tensor, alpha: float = 1.0, late: bool = False) -> None:
        """Adds ``alpha * grad`` to the pending gradient of the rows ``ids``: their owner's backward takes it
        this step, or, with ``late`` (the gradient of a stale read), in the next step's drain."""
        store = self.late if late else self.grads
        g = store.get(key)
        if g is None:
            shape = (self.size, *grad.shape[1:])
            if self.tiers.offload is None:  # on the device (pending ones live through the drain only)
                g = store[key] = grad.new_zeros(shape)
            else:  # offloaded: the same files every step (two for the late ones: this step's and the last)
                role = f"late{self._step % 2}" if late else "grads"
                g = store[key] = self._reused(role, key, shape, grad.dtype).zero_()
        g.index_add_(0, self.positions(ids, g), grad.to(g.device, g.dtype), alpha=alpha)
        self.tiers.release(g)

    def take_grad(self, key: str, start: int, end: int, into: Tensor, late_only: bool = False) -> None:
        """Adds to ``into`` (the gradient of rows ``start .. end-1``) what reads by other chunks sent back: this
        step's fresh reads, and the last step's stale ones with ``late_gradients``."""
        for store in (self.late_in,) if late_only else (self.grads, self.late_in):
            g = store.get(key)
            if g is None:
                continue
            pos, at = self.span(start, end, g)
            part = self.tiers.to_device(g[at]).to(into.dtype)
            self.tiers.release(g)
            if pos is None:
                into.add_(part)
            else:
                into.index_add_(0, pos, part)

    def clear_grads(self) -> None:
        self.grads = {}
        self.pending.end_drain()

    # ------------------------------------------------------------------ steps and snapshots
    def begin_step(self, step: int, period: Optional[int], keep_start: bool = False,
                   smoothing: Optional[float] = None) -> None:
        """T2: snapshot every ``period`` steps, restore the snapshot in between; then ``smoothing``: the
        buffers become the moving average of what they start steps with (module docstring). ``keep_start``:
        the rows as they are now stay readable through the step (:meth:`read_start`); with snapshots and
        no smoothing they are the snapshot itself, otherwise they cost a copy."""
        self.grads, self.start = {}, {}
        self.pending.reset()
        self.late_in, self.late = self.late, {}  # the last step's stale-read gradients are taken this step
        self._step = step
        refilled = self.written is None
        if refilled:  # refilled before this step: computed with this step's weights
            self.written = step
        self._start_written = self.written
        if not self.buffers:
            return
        if period is not None:
            if not self._restores(step, period):
                self.snapshot = self._copies("snapshot")
                self._snapshot_written = self.written
            else:
                for k, v in self.buffers.items():
                    v.copy_(self.snapshot[k])
                    self.tiers.release(v, self.snapshot[k])
                self._start_written = self._snapshot_written
        if smoothing is not None:
            self._smooth(smoothing, restart=refilled)
        if keep_start:  # the snapshot equals the buffers now, unless smoothing changed them
            self.start = self.snapshot if period is not None and smoothing is None else self._copies("start")

    def _smooth(self, gamma: float, restart: bool) -> None:
        if restart or set(self.smooth) != set(self.buffers):
            self.smooth = self._copies("smooth")
            return
        for k, v in self.buffers.items():
            s = self.smooth[k]
            s.mul_(gamma).add_(v.to(s.device), alpha=1.0 - gamma)
            v.copy_(s)
            self.tiers.release(v, s)

    def _copies(self, role: str) -> Dict[str, Tensor]:
        """Copies of the buffers, in the tensors ``role`` used before (:meth:`_reused`)."""
        out = {}
        for k, v in self.buffers.items():
            out[k] = self._reused(role, k, v.shape, v.dtype).copy_(v)
            self.tiers.release(out[k], v)
        return out

    def renew(self) -> None:
        """Drops the snapshot: the next step takes a new one (after the buffers were refilled)."""
        self.snapshot = {}
        self.written = None

    def _restores(self, step: int, period: Optional[int]) -> bool:
        """T2 at the start of step ``step``: the buffers are restored from the snapshot (else a snapshot is
        taken: at steps divisible by the period, and whenever a buffer has none)."""
        return (period is not None and bool(self.buffers) and step % period != 0
                and set(self.snapshot) == set(self.buffers))

    def age_at(self, step: int, period: Optional[int]) -> int:
        """The :meth:`age` step ``step`` would read at, were it to begin now (:meth:`begin_step`'s rule)."""
        if self.written is None:
            return 0
        origin = self._snapshot_written if self._restores(step, period) else self.written
        return 0 if origin is None else step - origin

    def age(self) -> int:
        """How many optimizer updates older than this step's weights the rows read stale this step are:
        the rows at the start of the step (the snapshot's, when T2 restored it) were computed by the fill
        of an earlier step, or by an exact refill before this one (age 0)."""
        if self._start_written is None:
            return 0
        return self._step - self._start_written

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The buffers, the snapshot, the smoothed rows and the last step's stale-read gradients (so a resumed
        run continues as the saved one would have)."""
        return {name: {k: v.cpu() for k, v in getattr(self, name).items()}
                for name in ("buffers", "snapshot", "smooth", "late")} | {
            "initialised": self.initialised, "written": self.written, "snapshot_written": self._snapshot_written}

    def load_state_dict(self, state: dict) -> None:
        """Restores saved buffers, snapshot, smoothed rows and late gradients (the last two may be absent)."""
        for name in ("buffers", "snapshot", "smooth", "late"):
            setattr(self, name, {k: self.tiers.copy(self._kept_as(v) if name != "late" else v)
                                 for k, v in (state.get(name) or {}).items()})
        # the steps whose weights computed the rows (ages, smoothing); unknown in older states: as just refilled
        self.written, self._snapshot_written = state.get("written"), state.get("snapshot_written")
        self._slots = {}  # (they hold the buffers replaced)
        self.tiers.evict()
        self.initialised = bool(state.get("initialised", False)) and bool(self.buffers)


    def _kept_as(self, rows: Tensor) -> Tensor:
        """Saved rows in the dtype this history keeps rows in (a run resumed with another ``history_dtype``)."""
        return rows.to(self.dtype) if self.dtype is not None and rows.is_floating_point() else rows


class HistoryStore:
    """The history of every call of the model within a step (call 0, call 1, ...).

    Args:
        num_nodes: |V|.
        device: the rank's device.
        tiers: where the buffers live (:mod:`.tiers`).
        rows: the vertex ids this rank's buffers hold (``None``: all; :class:`CallHistory`).
        dtype: the dtype rows are kept in (``None``: as computed; :class:`CallHistory`).
    """

    def __init__(self, num_nodes: int, device: torch.device, tiers: Optional[Tiers] = None,
                 rows: Optional[Tensor] = None, dtype: Optional[torch.dtype] = None):
        self.num_nodes, self.device, self.dtype = num_nodes, device, dtype
        self.tiers = tiers if tiers is not None else Tiers(device)
        self.rows = rows
        self.calls: Dict[int, CallHistory] = {}

    def of(self, call: int) -> CallHistory:
        """The history of the ``call``-th call of a step (created empty)."""
        hit = self.calls.get(call)
        if hit is None:
            hit = self.calls[call] = CallHistory(self.num_nodes, self.device, self.tiers, self.rows, self.dtype)
        return hit

    def state_dict(self) -> dict:
        return {"calls": {k: v.state_dict() for k, v in self.calls.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restores saved histories; a state without them (or of an older format) leaves every call
        uninitialised, so its first step refills it with an exact pass."""
        self.calls = {}
        for k, v in (state.get("calls") or {}).items():
            self.of(int(k)).load_state_dict(v)
