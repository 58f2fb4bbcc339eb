"""Halo rows at a propagate call site: from the other ways (exchanged) and from history.

At a call site, a layer reads its source argument (``x`` for ``x_j``) at the sources of the chunk's
local edges: the chunk's own rows, then its halo (:mod:`pyg_pipe.graph.chunks`). :meth:`HaloExchange.join`
builds ``[rows | halo]`` for the chunk that runs now:

* **ways** (W > 1): way ``w`` sends to every other way ``w'`` the rows of its current chunk that any
  chunk of ``w'`` reads (its *mirrors*), and receives theirs; all ways of a stage are at the same
  clock, so what arrives is fresh. ``halo_forward`` bytes: the mirror rows.
* **history** (more than one chunk per way): the chunk writes its rows (and what it received) into
  the site's buffer (:mod:`.history`) and reads its halo from it: rows of chunks
  earlier in the order are fresh, the others historical (:mod:`..plan.schedule`).
* one chunk per way (graph parallelism, exact passes): every halo row is received now.

How rows and gradients travel among the ways is ``halo_exchange``: ``"all_to_all"`` (every way sends
every other way its messages in one grouped exchange) or ``"ring"`` (hop by hop between neighbouring
ways, :mod:`.ring`); both deliver the same rows and the same gradient sums.

Backward (:class:`_HaloJoin`): the gradient of every fresh halo row goes back to its owner, scaled
by T3: kept for it (:mod:`.pending`; in an offload tier, a buffer ``G``) when it is an earlier chunk of this
way, over the wire otherwise (``halo_backward`` bytes); stale reads are dropped, or with ``late_gradients`` kept for
their owners' backward in the next step (one way only: :class:`HaloExchange`). The chunk's own rows receive what
other ways send for them and what later chunks of this way read from them. Every send
and receive of one call site is posted together (``batch_isend_irecv``). All routes of a step are
computed before its first chunk runs, so the per-chunk loop has no host synchronisation.

Recomputation reads exactly what the forward read: the engine's own (a *replay* of a chunk's fill in
the drain, ``recompute=True``, :mod:`..step.pipeline`) and the model's (``torch.utils.checkpoint``, reversible
blocks that rebuild their inputs, calling the site again during backward). With one chunk per way it
exchanges live with the other ways, which recompute at the same point. With history, nothing is
exchanged or written: a halo row owned by a chunk at the same or an earlier clock
was written this step before the read (by its owner, or received from its way), and nothing writes
it again in the step, so the buffer still holds it; a row owned by a later chunk was read before its
owner wrote it, so it is taken from the start-of-step rows (:meth:`CallHistory.read_start`).

One pass over a rank's chunks (the fill of one call of the model, or an exact pass) is a
:class:`HaloPass`: the step's clocks, whether history is read and written, and the history of that
call. The layer hooks reach it through the chunk context (:mod:`..context`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ...graph.chunks import ChunkedGraph, LocalGraph
from ..comm import Comm
from ..context import current, in_backward, leading_rows
from ..plan.grid import RankGrid
from .history import CallHistory
from .pending import owner_parts
from .ring import RingGrads, RingRows
from ..plan.schedule import Schedule

HALO_EXCHANGES = ("all_to_all", "ring")


class _HaloJoin(torch.autograd.Function):
    """``[rows | halo]`` (vertex-first), written into ``into[0]``, whose halo part is filled already; the
    backward hands the halo gradient to its owners."""

    @staticmethod
    def forward(ctx, rows: Tensor, into: list, run: "HaloPass", token: tuple):
        ctx.run, ctx.token = run, token
        ctx.rows = rows.size(0)
        out = into.pop()
        out[:ctx.rows].copy_(rows)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        g_rows = ctx.run.backward(ctx.token, grad[:ctx.rows], grad[ctx.rows:])
        return g_rows, None, None, None


class _Routes:
    """Where one chunk's halo gradients go at one step (device index tensors)."""

    def __init__(self):
        self.own_pos = self.own_scale = self.own_ids = None                 # fresh reads of this way's chunks,
        self.parts: List[Tuple[int, int, slice, Tensor, Tensor]] = []       # by owner: (its first row, rows it
        #                     holds, which of the reads, the held rows they are, their places in the halo)
        self.stale_pos = self.stale_ids = None                              # halo rows read stale
        self.sends: List[Tuple[int, Tensor, Tensor]] = []                   # (way, halo positions, scale)
        self.recvs: List[tuple] = []      # (way, n, cur sel, cur rows, other sel, other ids, their parts or None)
        self.ring: Optional[RingGrads] = None                               # halo_exchange="ring": the reduce


class HaloExchange:
    """The halo exchange of this rank: what stays the same from pass to pass (see the module docstring).

    Args:
        grid: the rank grid (ways of this stage exchange).
        comm: counted transport.
        schedule: chunk order and freshness.
        mode: ``halo_exchange``, ``"all_to_all"`` or ``"ring"`` (:mod:`.ring`).
        late: ``late_gradients``: the gradients of stale reads reach their owners in the next step's drain.
    """

    def __init__(self, grid: RankGrid, comm: Comm, schedule: Schedule, mode: str = "all_to_all",
                 late: bool = False):
        if mode not in HALO_EXCHANGES:
            raise ValueError(f"halo_exchange={mode!r} must be 'all_to_all' or 'ring'.")
        if late and grid.ways > 1 and schedule.cpw > 1:
            raise ValueError(f"late_gradients=True is built for one way per stage; with {grid.ways} graph-parallel "
                             f"ways and several chunks a way, the stale reads of other ways' rows would need their "
                             f"gradients sent next step, which is not built. Use ways=1 (GNNPipeStrategy), or "
                             f"late_gradients=False.")
        self.late = late
        self.grid, self.comm, self.schedule = grid, comm, schedule
        self.ring = mode == "ring" and grid.ways > 1
        self.ranks = [grid.rank_of(grid.stage, w) for w in range(grid.ways)]
        self._static: Dict[tuple, object] = {}   # per (graph, chunk, what): index tensors that stay the same
        self._rings: Dict[Tuple[int, int], RingRows] = {}

    def begin(self, history: Optional[CallHistory], clock: Tensor, read_history: bool,
              write_history: bool) -> "HaloPass":
        """A pass: ``clock`` is every chunk's position (all zeros for one chunk per way), ``history`` the
        buffers of the call this pass runs."""
        return HaloPass(self, history, clock, read_history, write_history)

    def local(self, cg: ChunkedGraph, lg: LocalGraph, w: int, ids: Tensor) -> Tensor:
        """``ids`` (rows of ``lg``'s chunk) as row positions within the chunk (cached)."""
        key = (id(cg), lg.index, -1 - w)
        hit = self._static.get(key)
        if hit is None:
            hit = self._static[key] = ids - lg.start
        return hit

    def ring_rows(self, cg: ChunkedGraph, lg: LocalGraph) -> RingRows:
        """The forward ring plan of ``lg``'s position in ``cg`` (cached: it depends on the graph only)."""
        key = (id(cg), lg.index)
        hit = self._rings.get(key)
        if hit is None:
            hit = self._rings[key] = RingRows(cg, lg, self.grid.way, self.grid.ways)
        return hit

    def on_host(self, cg: ChunkedGraph, lg: LocalGraph) -> Tuple[Tensor, Tensor]:
        """``lg``'s halo owners and halo ids in host memory, copied once (each step's routes read them on the host:
        from a GPU, a copy and a wait every step otherwise)."""
        key = (id(cg), lg.index, "host")
        hit = self._static.get(key)
        if hit is None:
            hit = self._static[key] = (lg.halo_chunk.cpu(), lg.halo.cpu())
        return hit

    def positions(self, cg: ChunkedGraph, lg: LocalGraph, w: int, ids: Tensor) -> Tensor:
        """``ids`` (halo vertices of ``lg``) as positions in its halo (cached)."""
        key = (id(cg), lg.index, w)
        hit = self._static.get(key)
        if hit is None:
            hit = self._static[key] = torch.searchsorted(lg.halo, ids)
        return hit


class HaloPass:
    """Source rows with halos for this rank's chunks in one pass (see the module docstring)."""

    def __init__(self, exchange: HaloExchange, history: Optional[CallHistory], clock: Tensor, read_history: bool,
                 write_history: bool):
        self.exchange, self.history = exchange, history
        self.grid, self.comm, self.schedule = exchange.grid, exchange.comm, exchange.schedule
        self.clock = clock
        self.read_history, self.write_history = read_history, write_history
        self.late = exchange.late and read_history
        # one way reading and writing history (the pipeline's fill): a chunk's rows and halo sit in the buffers
        # at places decided once (:meth:`CallHistory.slot`), so a join only copies and gathers
        own = self.grid.ways == 1 and isinstance(history, CallHistory)
        self._direct = own and read_history and write_history
        # the fresh reads' gradients kept as parts wherever the history is on the device (:mod:`.pending`); with
        # an offload tier they go into its buffers
        self._parts = isinstance(history, CallHistory) and history.tiers.offload is None
        self._routes: Dict[Tuple[int, int], _Routes] = {}
        self.reads: Dict[str, List[Tuple[ChunkedGraph, LocalGraph]]] = {}  # site -> chunks that read history there

    def prepare(self, graphs: List[ChunkedGraph]) -> None:
        """Computes the backward routes of this rank's chunks of ``graphs`` (before the per-chunk loop,
        which then never reads a value on the host)."""
        for cg in graphs:
            cpw = cg.chunks_per_way
            for lg in cg.chunks[self.grid.way * cpw:(self.grid.way + 1) * cpw]:
                self._route(cg, lg)

    # ------------------------------------------------------------------ forward
    def join(self, key: str, cg: ChunkedGraph, lg: LocalGraph, t: Tensor, vdim: int) -> Tensor:
        """``t`` (the chunk's rows, or all ``num_local`` rows, along ``vdim``) as ``[rows | halo]`` with the
        true halo rows."""
        rows = leading_rows(t, vdim, lg.rows)
        if vdim:
            rows = rows.movedim(vdim, 0)
        out = rows.new_empty((lg.num_local, *rows.shape[1:]))
        if not (self._direct and self._direct_halo(key, cg, lg, rows, out[lg.rows:])):
            self._halo(key, cg, lg, rows, out[lg.rows:])
        if torch.is_grad_enabled() and rows.requires_grad:
            out = _HaloJoin.apply(rows, [out], self, (key, cg, lg))
        else:
            out[:lg.rows].copy_(rows)
        return out.movedim(0, vdim) if vdim else out

    def _direct_halo(self, key: str, cg: ChunkedGraph, lg: LocalGraph, rows: Tensor, halo: Tensor) -> bool:
        """:meth:`_halo` of a fill with one way, where the buffer is read and written in place (``False``: not
        here, a replay or recomputation, or a buffer in a tier or another dtype)."""
        ctx = current()
        if ctx is None or ctx.replay or ctx.recomputing():
            return False
        slot = self.history.slot(key, lg, rows)
        if slot is None:
            return False
        if slot.pos is None:
            slot.into.copy_(rows.detach())
        else:
            torch.index_select(rows.detach(), 0, slot.pos, out=slot.into)
        torch.index_select(slot.buf, 0, slot.halo, out=halo)
        self.reads.setdefault(key, []).append((cg, lg))
        return True

    def _halo(self, key: str, cg: ChunkedGraph, lg: LocalGraph, rows: Tensor, halo: Tensor) -> None:
        """Fills ``halo`` with the true halo rows (exchanged, or from history)."""
        ctx = current()
        if ctx is not None and self.read_history and (ctx.replay or ctx.recomputing()):
            self._replayed(key, cg, lg, rows, halo)
            return
        received = self._exchange_rows(cg, lg, rows) if self.grid.ways > 1 else []
        if self.write_history:
            if not (ctx.recomputing() if ctx is not None else in_backward()):
                self.history.write(key, lg.start, rows)
            for _, ids, r in received:
                self.history.write_ids(key, ids, r)
        if self.read_history:
            self.history.read(key, lg.halo, rows, out=halo)
            self.reads.setdefault(key, []).append((cg, lg))  # (for the staleness meter, :mod:`.staleness`)
            return
        if cg.chunks_per_way > 1:
            raise RuntimeError("pyg_pipe: halo rows of other chunks of this way need history (internal error)")
        for w, ids, r in received:
            halo.index_copy_(0, self.exchange.positions(cg, lg, w, ids), r)

    def _replayed(self, key: str, cg: ChunkedGraph, lg: LocalGraph, rows: Tensor, halo: Tensor) -> None:
        """The halo rows the fill read (module docstring): the buffer's, the stale ones from the start of the step."""
        r = self._route(cg, lg)
        self.history.read(key, lg.halo, rows, out=halo)
        if r.stale_pos is not None:
            halo.index_copy_(0, r.stale_pos, self.history.read_start(key, r.stale_ids, rows).to(halo.dtype))

    def _exchange_rows(self, cg: ChunkedGraph, lg: LocalGraph, rows: Tensor) -> List[Tuple[int, Tensor, Tensor]]:
        """Sends this chunk's mirror rows to the other ways; returns ``(way, ids, rows)`` received."""
        if self.exchange.ring:
            return self.exchange.ring_rows(cg, lg).run(self.comm, self.exchange.ranks, self.grid.way, rows)
        mirrors, cpw, me = cg.mirrors(), cg.chunks_per_way, self.grid.way
        sends, recvs, ids_in, ways_in = [], [], [], []
        for w in range(self.grid.ways):
            if w == me:
                continue
            out_ids = mirrors[(lg.index, w)]
            if out_ids.numel():
                sends.append((rows[self.exchange.local(cg, lg, w, out_ids)], self.grid.rank_of(self.grid.stage, w)))
            in_ids = mirrors[(w * cpw + lg.index % cpw, me)]
            if in_ids.numel():
                recvs.append(((in_ids.numel(), *rows.shape[1:]), rows.dtype, self.grid.rank_of(self.grid.stage, w)))
                ids_in.append(in_ids)
                ways_in.append(w)
        got = self.comm.exchange(sends, recvs, "halo_forward")
        return list(zip(ways_in, ids_in, got))

    # ------------------------------------------------------------------ backward
    def _route(self, cg: ChunkedGraph, lg: LocalGraph) -> _Routes:
        hit = self._routes.get((id(cg), lg.index))
        if hit is not None:
            return hit
        dev, cpw, me = lg.halo.device, cg.chunks_per_way, self.grid.way
        clock, schedule = self.clock, self.schedule
        r = _Routes()
        owner = self.exchange.on_host(cg, lg)[0]
        fresh = schedule.fresh(clock, owner, lg.index)
        scale = schedule.gradient_scale(owner, lg.index)
        owner_way = owner // cpw
        own = torch.nonzero(fresh & (owner_way == me)).view(-1)
        stale = torch.nonzero(~fresh).view(-1)
        if stale.numel():
            r.stale_pos = stale.to(dev)
            r.stale_ids = lg.halo[r.stale_pos]
        if own.numel():
            order = torch.argsort(owner[own], stable=True)  # grouped by owner chunk: each owner's share one slice
            own = own[order]
            r.own_pos, r.own_scale = own.to(dev), _scale(scale[own], dev)
            r.own_ids = lg.halo[r.own_pos]
            if self._parts:
                r.parts = [(*p, r.own_pos[p[2]]) for p in owner_parts(self.history, cg, r.own_ids, owner[own])]
        W = self.grid.ways
        fresh_ids: Dict[Tuple[int, int], Tensor] = {}   # (reader way, owner way) -> ids whose gradient goes there
        for w in range(W):
            reader = cg.chunks[w * cpw + lg.index % cpw]
            o2, halo = self.exchange.on_host(cg, reader)
            read = schedule.fresh(clock, o2, reader.index)
            for o in range(W) if self.exchange.ring else (me,):
                if o != w:
                    fresh_ids[(w, o)] = halo[read & (o2 // cpw == o)]
        for w in range(W):
            if w == me:
                continue
            pos = torch.nonzero(fresh & (owner_way == w)).view(-1)
            if pos.numel():
                r.sends.append((w, pos.to(dev), _scale(scale[pos], dev)))
            if not self.exchange.ring:
                _receive(r, w, fresh_ids[(w, me)], lg, dev)
        if self.exchange.ring:  # every reader's gradients of this way's rows arrive summed, in one bundle
            r.ring = RingGrads(fresh_ids, me, W, dev)
            _receive(r, -1, r.ring.final_ids, lg, dev)
        starts = torch.tensor([c.start for c in cg.chunks[me * cpw:(me + 1) * cpw]])
        for i, (w, n, cur_sel, cur_rows, other_sel, other_ids, ids) in enumerate(r.recvs):  # (ids: on the CPU)
            parts = None
            if self._parts and ids.numel():  # the rows of this way's other chunks, by owner chunk, kept as parts
                owner_of = me * cpw + torch.bucketize(ids, starts, right=True) - 1
                order = torch.argsort(owner_of, stable=True)
                other_sel, other_ids = other_sel[order.to(dev)], other_ids[order.to(dev)]
                parts = [(*p, other_sel[p[2]]) for p in owner_parts(self.history, cg, other_ids, owner_of[order])]
            r.recvs[i] = (w, n, cur_sel, cur_rows, other_sel, other_ids, parts)
        self._routes[(id(cg), lg.index)] = r
        return r

    def backward(self, token: tuple, g_rows: Tensor, g_halo: Tensor) -> Tensor:
        key, cg, lg = token
        r = self._route(cg, lg)
        g_rows = self._taken(key, lg, g_rows) if self._parts else g_rows.clone()
        if self.history is not None:  # what other chunks' reads of these rows sent back (with parts: the late ones)
            self.history.take_grad(key, lg.start, lg.end, g_rows, late_only=self._parts)
        if r.own_pos is not None:
            if self._parts:
                self._keep_fresh(key, r, g_halo)
            else:
                fresh = g_halo.index_select(0, r.own_pos)
                alpha = r.own_scale if isinstance(r.own_scale, float) else 1.0  # (T3's scale: as it is added)
                fresh = fresh if isinstance(r.own_scale, float) else _scaled(fresh, r.own_scale)
                self.history.add_grad(key, r.own_ids, fresh, alpha=alpha)
        if self.late and r.stale_pos is not None:  # late_gradients: the owners take these next step
            self.history.add_grad(key, r.stale_ids, g_halo.index_select(0, r.stale_pos), late=True)
        if not r.sends and not r.recvs and r.ring is None:  # nothing crosses ways (one way, or no shared rows)
            return g_rows
        ranks = self.exchange.ranks
        own = [(w, _scaled(g_halo.index_select(0, pos), scale)) for w, pos, scale in r.sends]
        if r.ring is not None:
            got = r.ring.run(self.comm, ranks, self.grid.way, dict(own), g_halo)
        else:
            recvs = [((n, *g_halo.shape[1:]), g_halo.dtype, ranks[w]) for w, n, *_ in r.recvs]
            got = self.comm.exchange([(g, ranks[w]) for w, g in own], recvs, "halo_backward")
        for (w, n, cur_sel, cur_rows, other_sel, other_ids, parts), g in zip(r.recvs, got):
            if cur_sel.numel():
                g_rows.index_add_(0, cur_rows, g[cur_sel])
            if parts:  # (each owner's rows a tensor of their own: freed when it takes them)
                self.history.pending.add(key, [(a, held, rows, g.index_select(0, sel))
                                               for a, held, _, rows, sel in parts], 1.0)
            elif other_sel.numel():
                self.history.add_grad(key, other_ids, g[other_sel])
        return g_rows

    def _taken(self, key: str, lg: LocalGraph, g_rows: Tensor) -> Tensor:
        """``g_rows`` (a new tensor) plus what later chunks' fresh reads of the chunk's rows sent back as parts."""
        pos, at = self.history.span(lg.start, lg.end, g_rows)
        back = self.history.pending.take(key, lg.start, at.stop - at.start, g_rows)
        if back is None:
            return g_rows.clone()
        return g_rows + back if pos is None else g_rows.index_add(0, pos, back)  # (its held rows: all, or at pos)

    def _keep_fresh(self, key: str, r: _Routes, g_halo: Tensor) -> None:
        """This chunk's fresh reads' gradients (scaled by T3) kept for their owners, one tensor each (freed when the
        owner takes it: :mod:`.pending`)."""
        scale = r.own_scale
        if isinstance(scale, float):  # (T3's scale applied as the gradient is added)
            parts = [(a, held, rows, g_halo.index_select(0, pos)) for a, held, _, rows, pos in r.parts]
        else:
            parts = [(a, held, rows, _scaled(g_halo.index_select(0, pos), scale[at]))
                     for a, held, at, rows, pos in r.parts]
        self.history.pending.add(key, parts, scale if isinstance(scale, float) else 1.0)


def _receive(r: _Routes, w: int, ids: Tensor, lg: LocalGraph, dev) -> None:
    """Where the gradients of ``ids`` (CPU, owned by this way), received from way ``w`` (``-1``: the ring), go:
    rows of the current chunk, or history (:meth:`HaloPass.backward`)."""
    if ids.numel():
        cur = (ids >= lg.start) & (ids < lg.end)
        r.recvs.append((w, ids.numel(), torch.nonzero(cur).view(-1).to(dev), (ids[cur] - lg.start).to(dev),
                        torch.nonzero(~cur).view(-1).to(dev), ids[~cur].to(dev), ids[~cur]))


def _scale(scale: Tensor, device) -> object:
    """T3 scales of some rows: one number when they are all equal (the usual case), else a tensor."""
    if scale.numel() and bool((scale == scale[0]).all()):
        return float(scale[0])
    return scale.to(device)


def _scaled(rows: Tensor, scale) -> Tensor:
    if isinstance(scale, float):
        return rows if scale == 1.0 else rows.mul_(scale)
    return rows.mul_(scale.to(rows.dtype).view(-1, *([1] * (rows.dim() - 1))))
