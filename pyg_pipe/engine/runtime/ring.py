"""The ring halo exchange (``halo_exchange="ring"``, NGra's ring of devices): halo rows travel hop by hop
between neighbouring ways instead of from every way to every other way.

Ways ``0 .. W-1`` of a stage form the ring ``w -> w+1 (mod W)``. At a call site, for the chunk position
that runs now, let ``M[o->r]`` be the rows (ascending new ids) of origin way ``o``'s current chunk that
reader way ``r`` reads (the all-to-all's message from ``o`` to ``r``, :meth:`ChunkedGraph.mirrors`) and
``U_h(o) = ∪_{k >= h} M[o -> o+k]`` the rows of ``o`` still needed ``h`` or more hops along::

    forward, hop h = 1 .. W-1, one grouped send + receive per hop (``halo_forward``)
        way w sends w+1       U_h(w-h+1): its own rows at h = 1, then the part of the bundle it received at
                              hop h-1 still needed further along
        way w receives        U_h(w-h) from w-1; keeps the rows M[(w-h) -> w] it reads (positions in the
                              bundle precomputed) and forwards U_{h+1}(w-h) at hop h+1

What a way keeps is exactly what the all-to-all delivers: ``(origin way, ids, rows)`` for every origin.

Backward is the reverse ring, a ring **reduce**. ``F[r->o]``: the ids owned by way ``o`` whose gradient
reader way ``r`` sends (its fresh reads, T3-scaled; what the all-to-all sends from ``r`` to ``o``), and
``V_h(o) = ∪_{k >= h} F[o+k -> o]``::

    backward, hop h = W-1 .. 1 (``halo_backward``)
        way w sends w-1       V_h(w-h): the bundle V_{h+1}(w-h) it received at hop h+1 with its own
                              gradients of F[w -> w-h] added at their positions
        way w receives        V_h(w+1-h) from w+1; at h = 1 that is V_1(w), the sum of every reader's
                              gradients of w's rows, applied as the all-to-all's are (:meth:`HaloPass.backward`)

**Bytes** per site and direction, with one chunk per way (``b`` bytes per value, ``d`` the site's width)::

    ring        d·b·Σ_o Σ_h |U_h(o)|  =  d·b·Σ_o Σ_{v in part o read by another way} maxdist(v)
    all-to-all  d·b·Σ_o Σ_v readers(v)  =  d·b·Σ_p |halo(p)|

with ``maxdist(v) = max over the ways r reading v of (r - o) mod W`` and ``readers(v)`` their number
(:func:`..plan.formulas.ring_halo_rows`). A row read only by the next way costs 1 in both, one
read only by the previous way ``W-1`` in the ring and 1 in all-to-all, one read by every way ``W-1`` in
both: the ring never sends fewer bytes, and more when rows are read by few far ways. In exchange each
rank talks to 2 peers (its ring neighbours) instead of ``W-1``, so only neighbour links carry traffic.
With ``W = 2`` the ring is the all-to-all: one hop, the same messages, the same bytes.

With ``boundary_dtype`` a forwarded row is re-sent exactly as it arrived (no further rounding), while a
partial gradient sum is rounded to that dtype at every hop (the all-to-all rounds each reader's gradient
once). Hops are sequential (``W-1`` rounds per site and direction) and not yet overlapped with the layer's
computation. Every plan (bundle sizes and positions, as device index tensors) is computed before the
per-chunk loop: the forward's once per graph and chunk position (it depends on the graph only), the
backward's with the step's routes (:meth:`HaloPass.prepare`), so the loop reads nothing on the host.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ...graph.chunks import ChunkedGraph, LocalGraph
from ..comm import Comm

_EMPTY = torch.empty(0, dtype=torch.long)


def suffix_unions(parts: Sequence[Tensor]) -> List[Tensor]:
    """``out[h-1] = ∪_{k >= h} parts[k-1]`` (ascending, unique) for ``h = 1 .. len(parts)``: the rows of one
    origin still needed ``h`` or more hops along, given ``parts[k-1]``, the rows needed exactly ``k`` hops
    along (CPU)."""
    out: List[Tensor] = [_EMPTY] * len(parts)
    acc = _EMPTY
    for i in range(len(parts) - 1, -1, -1):
        acc = torch.unique(torch.cat([acc, parts[i]])) if parts[i].numel() else acc
        out[i] = acc
    return out


def _positions(within: Tensor, ids: Tensor, device) -> Optional[Tensor]:
    """Positions of ``ids`` (a subset) in ``within`` (both ascending, CPU), on ``device``; ``None`` when
    ``ids`` is all of ``within`` (no selection needed)."""
    if ids.numel() == within.numel():
        return None
    return torch.searchsorted(within, ids).to(device)


def _take(t: Tensor, pos: Optional[Tensor]) -> Tensor:
    return t if pos is None else t.index_select(0, pos)


class RingRows:
    """The forward ring of one way at one chunk position of a graph (module docstring).

    Args:
        cg: the chunked graph (its :meth:`~ChunkedGraph.mirrors` are the all-to-all's messages).
        lg: this way's chunk at the position.
        way, ways: this way and W.
    """

    def __init__(self, cg: ChunkedGraph, lg: LocalGraph, way: int, ways: int):
        mirrors, cpw, p, W, w = cg.mirrors(), cg.chunks_per_way, lg.index % cg.chunks_per_way, ways, way
        dev = lg.halo.device

        def M(o: int, r: int) -> Tensor:
            return mirrors[(o * cpw + p, r)].cpu()

        U = {o: suffix_unions([M(o, (o + k) % W) for k in range(1, W)]) for o in range(W)}
        # hop h (index h-1): (send positions or None, sent rows, received rows, keep positions or None,
        # kept ids, origin of the received bundle)
        self.hops: List[Tuple[Optional[Tensor], int, int, Optional[Tensor], Tensor, int]] = []
        for h in range(1, W):
            o_send, o_recv = (w - h + 1) % W, (w - h) % W
            out = U[o_send][h - 1]
            if h == 1:  # own rows: positions within the chunk
                send = (out - lg.start).to(dev) if out.numel() != lg.rows else None
            else:       # part of the bundle received at hop h-1 (origin w-h+1 as well)
                send = _positions(U[o_send][h - 2], out, dev)
            got, mine = U[o_recv][h - 1], M(o_recv, w)
            self.hops.append((send, out.numel(), got.numel(), _positions(got, mine, dev), mine.to(dev), o_recv))

    def run(self, comm: Comm, ranks: Sequence[int], way: int, rows: Tensor) -> List[Tuple[int, Tensor, Tensor]]:
        """Passes the rows around the ring; returns ``(origin way, ids, rows)`` of every row this way reads
        from another way, ordered by origin (as the all-to-all's)."""
        W, shape, prev = len(ranks), rows.shape[1:], None
        rows = rows.detach()
        kept: Dict[int, Tuple[int, Tensor, Tensor]] = {}
        for h, (send, n_send, n_recv, keep, ids, origin) in enumerate(self.hops, 1):
            sends = [(_take(rows if h == 1 else prev, send), ranks[(way + 1) % W])] if n_send else []
            recvs = [((n_recv, *shape), rows.dtype, ranks[(way - 1) % W])] if n_recv else []
            got = comm.exchange(sends, recvs, "halo_forward")
            prev = got[0] if n_recv else None
            if ids.numel():
                kept[origin] = (origin, ids, _take(prev, keep))
        return [kept[o] for o in sorted(kept)]


class RingGrads:
    """The backward ring reduce of one way for one chunk at one step (module docstring).

    Args:
        fresh_ids: ``{(r, o): ids}`` (CPU, ascending) for every reader way ``r`` and owner way ``o != r``:
            ``F[r->o]``, the rows of ``o`` whose gradient the chunk of ``r`` at this position sends.
        way, ways: this way and W.
        device: where the index tensors go.

    Attributes:
        final_ids: ``V_1(way)``, the ids (CPU) of the gradients the last hop brings this way.
    """

    def __init__(self, fresh_ids: Dict[Tuple[int, int], Tensor], way: int, ways: int, device):
        W, w = ways, way
        V = {o: suffix_unions([fresh_ids[((o + k) % W, o)] for k in range(1, W)]) for o in range(W)}
        # hop h, from W-1 down to 1: (origin of the sent bundle, sent rows, where the bundle received at hop
        # h+1 goes in it or None, where this way's own gradients go in it or None, received rows)
        self.hops: List[Tuple[int, int, Optional[Tensor], Optional[Tensor], bool, int]] = []
        for h in range(W - 1, 0, -1):
            o = (w - h) % W
            out, mine = V[o][h - 1], fresh_ids[(w, o)]
            prev = V[o][h] if h < W - 1 else _EMPTY
            self.hops.append((o, out.numel(), _positions(out, prev, device) if prev.numel() else None,
                              _positions(out, mine, device) if mine.numel() else None, bool(mine.numel()),
                              V[(w + 1 - h) % W][h - 1].numel()))
        self.final_ids = V[w][0]

    def run(self, comm: Comm, ranks: Sequence[int], way: int, own: Dict[int, Tensor],
            like: Tensor) -> List[Tensor]:
        """Reduces the gradients around the reverse ring. ``own[o]``: this way's (scaled) gradients of
        ``F[way -> o]``; ``like``: a tensor of the gradients' trailing shape and dtype. Returns ``[V_1(way)'s
        gradients]`` (empty when no other way read this way's rows)."""
        W, shape, prev = len(ranks), like.shape[1:], None
        for o, n_send, prev_at, mine_at, has_mine, n_recv in self.hops:
            sends = []
            if n_send:
                if prev is None:          # nothing came from further along: only this way's own gradients
                    bundle = own[o] if mine_at is None else like.new_zeros((n_send, *shape)).index_add_(
                        0, mine_at, own[o])
                elif not has_mine:        # nothing to add: pass it on
                    bundle = prev
                else:
                    bundle = prev if prev_at is None else like.new_zeros((n_send, *shape)).index_add_(0, prev_at, prev)
                    bundle = bundle.index_add_(0, mine_at, own[o]) if mine_at is not None else bundle.add_(own[o])
                sends.append((bundle, ranks[(way - 1) % W]))
            recvs = [((n_recv, *shape), like.dtype, ranks[(way + 1) % W])] if n_recv else []
            got = comm.exchange(sends, recvs, "halo_backward")
            prev = got[0] if n_recv else None
        return [prev] if prev is not None else []
