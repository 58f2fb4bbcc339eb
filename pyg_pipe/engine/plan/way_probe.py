"""``grid="auto"``'s timing of graph parallelism: a training pass over a way's part of the graph, run by every rank
at once with its halo exchanges, as the ways run it.

Timed on one rank with the others idle, a way's pass left out what its step pays in the run (measured on 2 gloo
processes, 16-layer GCNII, 20,000 vertices, fused kernels; docs/gnnpipe.md): the other ways computing on the same
machine at the same time (the pass 1.2x slower), and, at every propagate, forward and backward, the halo rows going
out and coming in and the wait for the slowest way (90 of a 280 ms step; the link's two-size fit predicted 17). The
pass was 0.09 s, the step 0.28 s, and the choice went to graph parallelism where a 2-stage pipeline took 0.17 s.

So each candidate way count ``W`` is timed as it runs: the plan's partition into ``W`` parts (made on the root and
broadcast), rank ``r`` in group ``r // W`` runs the part ``r % W`` (its rows and its halo, the first chunk of the
probe), and at every halo join it exchanges rows with the other ways of its group in the counts the partition gives
(way ``i`` receives from way ``j`` the rows of ``j`` it reads; :func:`halo_counts`), and the gradients back in the
backward. After the forward each way sends its output rows to the others and the loss check's two numbers, after
the backward which parameters have gradients and the gradients (:meth:`Exchangers.output`,
:meth:`Exchangers.gradients`), as the step does. Every rank runs the same :data:`WAY_PASSES` passes, so the
exchanges meet; its time is the median pass, and the step's the slowest rank's (an all-reduce of the maximum).

Until 2026-11-29 the pass ended at its backward and its time was the smallest of three. On a 2-layer GCN (20,000
vertices, 2 processes) graph parallelism's step was then predicted at 0.48 - 0.60 of its measured one: of a 25 - 28 ms
step, about 10 ms was waiting at the step's nine exchanges, which a pass with three of them, and its luckiest of
three, left out (the passes with exchanges took 16 - 38 ms, their median about 22).

A pipeline's chunk is still timed on one rank with the others idle (:func:`.grid_cost.measure_pass`): its stages
are busy at different moments of fill and drain. Timed by every rank at once, 4 processes sharing 2 cores predicted
the pipelines with few chunks 1.6 - 1.9x too slow and chose 32 chunks where 2 were fastest (1.79x its step).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from ..context import leading_rows
from .decide import root_decides

#: the ways' passes timed, each rank's median taken (a step pays the typical wait at its exchanges)
WAY_PASSES = 5


def halo_counts(perm: Tensor, ptr: Tensor, edge_index: Tensor, num_nodes: int) -> Tensor:
    """``M[i, j]``: the distinct vertices of part ``j`` with an edge into part ``i`` (the rows way ``i`` receives
    from way ``j``) of the partition ``(perm, ptr)``."""
    parts = ptr.numel() - 1
    part = torch.empty(num_nodes, dtype=torch.long)
    part[perm] = torch.bucketize(torch.arange(num_nodes), ptr[1:].long(), right=True)
    src, dst = edge_index
    cross = part[src] != part[dst]
    pairs = torch.unique(src[cross] * parts + part[dst[cross]])
    reader, owner = pairs % parts, part[pairs // parts]
    return torch.bincount(reader * parts + owner, minlength=parts * parts).view(parts, parts)


def first_part(perm: Tensor, ptr: Tensor, part: int) -> Tuple[Tensor, Tensor]:
    """The partition with ``part`` moved to the front (the probe runs the first chunk), the others after it."""
    order = [part] + [p for p in range(ptr.numel() - 1) if p != part]
    pieces = [perm[int(ptr[p]):int(ptr[p + 1])] for p in order]
    sizes = torch.tensor([0] + [x.numel() for x in pieces])
    return torch.cat(pieces), sizes.cumsum(0)


class _Swap(torch.autograd.Function):
    """The halo rows of a join, received from the other ways; the gradient of what was sent comes back to it."""

    @staticmethod
    def forward(ctx, rows: Tensor, exchanger: "Exchangers", vdim: int) -> Tensor:
        ctx.exchanger, ctx.vdim, ctx.shape = exchanger, vdim, rows.shape
        return exchanger.swap(rows, vdim, backward=False)

    @staticmethod
    def backward(ctx, grad: Tensor):
        back = ctx.exchanger.swap(grad.contiguous(), ctx.vdim, backward=True)
        out = grad.new_zeros(ctx.shape)  # (the rows sent, as the forward took them: several peers may read one)
        idx = torch.arange(back.size(ctx.vdim), device=grad.device) % max(ctx.shape[ctx.vdim], 1)
        return out.index_add_(ctx.vdim, idx, back), None, None


class Exchangers:
    """A probe's halo (in place of :class:`~..profile._Fillers`' zeros): each join exchanges rows with the other
    ways of this rank's group, ``counts[i, j]`` rows from way ``j`` to way ``i`` (``i``: this rank's way)."""

    def __init__(self, comm, counts: Tensor, ways: int, sizes: Optional[Tensor] = None):
        self.comm, W = comm, ways
        group, self.way = divmod(comm.rank, W)
        self.peers = [(group * W + j, int(counts[self.way, j]), int(counts[j, self.way]))
                      for j in range(W) if j != self.way]
        self.sizes = {group * W + j: int(sizes[j]) for j in range(W)} if sizes is not None else {}

    def swap(self, rows: Tensor, vdim: int, backward: bool) -> Tensor:
        """Sends each peer the rows it reads from this way (taken from ``rows``; in the backward, the gradients of
        the rows received from it) and returns what the peers sent, joined along ``vdim``."""
        sends, recvs = [], []
        for peer, take, give in self.peers:
            out_n, in_n = (take, give) if backward else (give, take)
            idx = torch.arange(out_n, device=rows.device) % max(rows.size(vdim), 1)
            sends.append((rows.index_select(vdim, idx), peer))
            shape = list(rows.shape)
            shape[vdim] = in_n
            recvs.append((shape, rows.dtype, peer))
        got = self.comm.exchange(sends, recvs, "halo_backward" if backward else "halo_forward")  # (boundary_dtype too)
        return torch.cat(got, dim=vdim) if got else rows.narrow(vdim, 0, 0)

    def join(self, key: str, cg, lg, t: Tensor, vdim: int) -> Tensor:
        rows = leading_rows(t, vdim, lg.rows)
        return torch.cat([rows, _Swap.apply(rows, self, vdim)], dim=vdim)

    def output(self, roots: List[Tensor]) -> None:
        """The step's exchanges after the forward: the way's output rows to every other way, the peers' rows
        back (``sizes``: each way's rows; every rank receives the whole output), then the loss check (two
        numbers)."""
        for t in roots:  # (each way sends exactly its count, so the receives match whatever the root's rows)
            t = t.detach().reshape(t.size(0) if t.dim() else 1, -1)
            n = self.sizes.get(self.comm.rank, t.size(0))
            mine = t[:n] if t.size(0) >= n else torch.cat([t, t.new_zeros(n - t.size(0), t.size(1))])
            self._each_peer(mine, lambda peer: (self.sizes.get(peer, n), mine.size(1)))
        self._each_peer(torch.zeros(2, dtype=torch.float64, device=self.comm.device))

    def gradients(self, params: List[torch.nn.Parameter]) -> None:
        """The step's exchanges after the backward: which parameters have gradients (a byte each) and the
        gradients, flattened, as the ways sum them (:class:`~..runtime.weights.GradientSum`). With two ways one
        exchange is the all-reduce; with more it sends each peer the whole (a ring sends ``2 (W - 1) / W`` of it)."""
        if params:  # (a parameter without a gradient on this rank sends zeros, as the step's sum does)
            self._each_peer(torch.zeros(len(params), dtype=torch.uint8, device=self.comm.device))
            self._each_peer(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                       .to(params[0].dtype) for p in params]))

    def _each_peer(self, t: Tensor, shape_of: Optional[Callable[[int], tuple]] = None) -> None:
        """``t`` to every peer, and from each a tensor of ``shape_of(peer)`` (by default ``t``'s shape)."""
        peers = [peer for peer, _, _ in self.peers]
        shapes = [t.shape if shape_of is None else shape_of(peer) for peer in peers]
        self.comm.exchange([(t, peer) for peer in peers], [(s, t.dtype, p) for s, p in zip(shapes, peers)], "other")


def shared_partition(partition: Callable, ways: int, chunks: int, num_nodes: int, comm, root: int) \
        -> Tuple[Tensor, Tensor]:
    """``partition(ways, chunks)`` made on ``root`` and broadcast: every rank probes the same cut."""
    cut = root_decides(lambda: torch.cat([t.long().cpu() for t in partition(ways, chunks)]),
                       torch.zeros(num_nodes + chunks + 1, dtype=torch.long), comm, root, "sharing a partition")
    return cut[:num_nodes], cut[num_nodes:]


def time_ways(seconds_of: Callable, partition: Callable, edge_index: Tensor, num_nodes: int, ways: List[int],
              comm, root: int) -> Tuple[dict, dict, dict]:
    """``({W: H_W}, {W: t_W}, {W: why})`` for each way count: ``H_W`` the halo rows of the most loaded way, ``t_W``
    the slowest rank's training pass over its way's part with the exchanges (module docstring; not timed where a
    way reads no halo), and the way counts whose part some rank's model could not run on (the first failure told;
    those grids are left out of the choice, the others still run it). ``seconds_of(perm, ptr, halo, passes)``: the
    smallest of ``passes`` passes over the first chunk of ``(perm, ptr)`` with ``halo`` joining its sources. Every
    rank calls it; the partitions are the root's."""
    halos, times, refused = {}, {}, {}
    for W in ways:
        perm, ptr = shared_partition(partition, W, W, num_nodes, comm, root)
        counts = halo_counts(perm, ptr, edge_index, num_nodes)
        halos[W] = int(counts.sum(1).max())
        if int(counts.sum(1).min()) == 0:  # a way reading no halo runs no joins to meet its peers': not timed
            continue                          # (the step then adds the exchanges from the link's speed)
        mine = first_part(perm, ptr, comm.rank % W)
        failed = None
        try:  # one pass without exchanges first: a way's part the model cannot run on fails here, on its rank
            seconds_of(*mine, None, 1)  # alone, not inside an exchange its peers wait on
        except Exception as exc:  # noqa: BLE001 - told to every rank below; the grids without W ways remain
            failed = f"{type(exc).__name__}: {exc}"
        told = [f for f in comm.all_gather_objects(failed, "trying graph parallelism") if f is not None]
        if told:
            refused[W] = told[0]
            continue
        seconds = torch.tensor([float(seconds_of(*mine, Exchangers(comm, counts, W, ptr.diff()), WAY_PASSES))],
                               dtype=torch.float64)
        times[W] = float(comm.all_reduce(seconds, None, "timing graph parallelism", op="max"))
    return halos, times, refused
