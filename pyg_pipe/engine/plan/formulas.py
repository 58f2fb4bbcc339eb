"""Communication per training step, predicted from the graph and the model (no transport here).

The counters of :class:`~..comm.Comm` measure what actually travels; these formulas
say what should, and the tests check that the two agree. fp32 unless ``bytes_per_value`` says
otherwise (``b``; with ``boundary_dtype=torch.bfloat16`` the stage, carried and halo terms take
``boundary_bytes = 2`` instead, while the output and the weight all-reduce stay at ``b``); ``d`` is the width of
the activation at every stage cut, ``|V|`` the number of vertices::

    GNNPipe (S stages, W = 1)
        stage_activations = stage_gradients = (S-1)·|V|·d·b         independent of the depth L
        carried          = 2·(S-1)·|V|·d0·b                         tensors besides the activation
                                                                     crossing a cut (GCNII's x0)
        output           = (P-1)·|V|·d_out·b                         the last stage's output to every rank

    graph parallel (S = 1, W ways, one chunk per way) and hybrid
        halo_forward = halo_backward = Σ_sites d_site · Σ_p |halo(p)| · b
        weight_allreduce             = 2·(W-1)·#params·b              (a ring all-reduce)

    graph parallel with halo_exchange="ring" (:mod:`..runtime.ring`): each row travels hop by hop to its farthest reader
        halo_forward = halo_backward = Σ_sites d_site · Σ_o Σ_{v in part o read by another way} maxdist(v) · b

where a *site* is a propagate call whose source rows are computed by the model (the first layer
reads the input features, which every rank already has), ``Σ_p |halo(p)|`` counts, over the W
partitions, the vertices outside a partition with an edge into it (:func:`halo_rows`), and
``maxdist(v)`` is the largest ring distance ``(r - o) mod W`` from ``v``'s part ``o`` to a part ``r``
that reads it (:func:`ring_halo_rows`; ``>= 1`` per reader, so the ring never sends fewer bytes than
all-to-all, and the same with ``W = 2``).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
from torch import Tensor

from ..comm import CATEGORIES


def gnnpipe_bytes(num_nodes: int, num_stages: int, width: int, out_width: int, carried_width: int = 0,
                  num_ranks: Optional[int] = None, bytes_per_value: int = 4,
                  boundary_bytes: Optional[int] = None) -> Dict[str, int]:
    """Per-step bytes of GNNPipe by category (see the module docstring).

    ``width`` is the activation width at every cut, ``carried_width`` the total width of the other
    tensors crossing each cut (0 for none), ``out_width`` the model output width, sent by the last
    stage to the ``num_ranks - 1`` other ranks (default ``num_ranks = num_stages``). ``boundary_bytes``:
    bytes per value crossing a cut when ``boundary_dtype`` narrows them (2 for bf16; default
    ``bytes_per_value``); the output keeps ``bytes_per_value``.
    """
    ranks = num_stages if num_ranks is None else num_ranks
    b = bytes_per_value if boundary_bytes is None else boundary_bytes
    act = (num_stages - 1) * num_nodes * width * b
    out = dict.fromkeys(CATEGORIES, 0)
    out.update(stage_activations=act, stage_gradients=act,
               carried=2 * (num_stages - 1) * num_nodes * carried_width * b,
               output=(ranks - 1) * num_nodes * out_width * bytes_per_value)
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out


def halo_rows(edge_index: Tensor, perm: Tensor, ptr: Tensor) -> int:
    """``Σ_p |halo(p)|``: for every partition ``p`` (a contiguous new-id range ``ptr[p]:ptr[p+1]`` of
    the order ``perm[new] = old``), the number of distinct vertices outside ``p`` with an edge into ``p``."""
    n = perm.numel()
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n, device=perm.device)
    src, dst = inv[edge_index[0]], inv[edge_index[1]]
    part_of = torch.bucketize(torch.arange(n, device=perm.device), ptr[1:], right=True)
    ps, pd = part_of[src], part_of[dst]
    cross = ps != pd
    pairs = torch.unique(pd[cross] * n + src[cross])
    return int(pairs.numel())


def ring_halo_rows(edge_index: Tensor, perm: Tensor, ptr: Tensor) -> int:
    """``Σ_o Σ_{v in part o} maxdist(v)``: the rows the ring halo exchange sends per unit of width in one
    direction, for the partitions ``ptr`` (contiguous new-id ranges of the order ``perm[new] = old``) as ring
    ways ``0 .. W-1``; ``maxdist(v)`` is the largest ``(r - o) mod W`` over the parts ``r != o`` with an edge
    from ``v`` into them (0 when there is none)."""
    n, W = perm.numel(), ptr.numel() - 1
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n, device=perm.device)
    src, dst = inv[edge_index[0]], inv[edge_index[1]]
    part_of = torch.bucketize(torch.arange(n, device=perm.device), ptr[1:], right=True)
    dist = (part_of[dst] - part_of[src]) % W
    far = torch.zeros(n, dtype=torch.long, device=perm.device).scatter_reduce_(0, src, dist, "amax")
    return int(far.sum())


def ring_halo_bytes(ring_rows: int, widths: Sequence[int], bytes_per_value: int = 4,
                    boundary_bytes: Optional[int] = None) -> int:
    """Per-step ``halo_forward`` bytes (``halo_backward`` is the same) of graph parallelism with
    ``halo_exchange="ring"`` and one chunk per way: ``Σ_sites d_site · ring_rows · b`` with ``ring_rows`` from
    :func:`ring_halo_rows`. The other categories are :func:`graph_parallel_bytes`' (which gives these
    halo terms too when passed ``halo=ring_rows``)."""
    return sum(widths) * ring_rows * (bytes_per_value if boundary_bytes is None else boundary_bytes)


def graph_parallel_bytes(num_nodes: int, halo: int, widths: Sequence[int], num_params: int, ways: int,
                         out_width: int, num_stages: int = 1, width: int = 0, carried_width: int = 0,
                         bytes_per_value: int = 4, boundary_bytes: Optional[int] = None) -> Dict[str, int]:
    """Per-step bytes of graph-parallel (``num_stages = 1``) and hybrid runs with one chunk per way.

    ``halo`` is ``Σ_p |halo(p)|`` of the ``ways``-way partition (:func:`halo_rows`), ``widths`` the
    width of every source row exchanged in one step (one entry per propagate call site and source
    argument whose rows the model computes), ``num_params`` the number of parameters (all stages
    together). Adds the pipeline terms of :func:`gnnpipe_bytes` between the ``num_stages`` stages
    (each way sends its own rows, so together they are the same as one way sending all of them).
    """
    out = gnnpipe_bytes(num_nodes, num_stages, width, out_width, carried_width, num_ranks=num_stages * ways,
                        bytes_per_value=bytes_per_value, boundary_bytes=boundary_bytes)
    h = sum(widths) * halo * (bytes_per_value if boundary_bytes is None else boundary_bytes)
    out.update(halo_forward=h, halo_backward=h,
               weight_allreduce=2 * (ways - 1) * num_params * bytes_per_value)
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out
