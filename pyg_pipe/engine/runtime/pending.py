"""Pending gradients of fresh cross-chunk reads: kept as the rows read, until their owners' backward.

In the pipeline's drain (chunks in the reverse of the fill's order) a chunk's backward hands the gradients of the
rows it read fresh (written this step by an earlier chunk of its way) to their owners, whose backward comes later;
with graph-parallel ways, also the gradients other ways' chunks send back for this way's rows.
Each reader's gradients are kept as they came, one part per owner chunk, a tensor of its own freed when the owner
takes it (the reads of that owner's rows, grouped by :meth:`~.halo.HaloPass._route`), not added into a buffer of
every row the history holds: such a buffer per call site, zeroed every step, was 0.12 of a 2-stage pipeline's live
peak and held rows nobody had read. An owner whose parts come to more rows than it holds has them summed into one
buffer of its held rows, so it never costs more::

    owner o's parts        [(held rows read, gradients, T3 scale), ...]      while their rows <= held_o
                           else  zeros(held_o) + each part in turn            (folded)
    its backward takes     zeros(held_o) + each part in turn                  (the same sum, in the same order)

``zeros + each part in turn`` is the order a buffer of every held row sums them in (:meth:`.CallHistory.add_grad`,
still used for late gradients and with the history in an offload tier), so the gradients are the same bit for bit
either way (tests/engine/test_tiers.py trains both, one way and two, and compares every parameter with
``torch.equal``).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor


class Pending:
    """The parts of one call's drain, keyed by (call site, the owner chunk's first row)."""

    def __init__(self):
        self.parts: Dict[Tuple[str, int], list] = {}   # -> [the folded sum or None, [(rows, grad, scale)], rows]
        self.bytes = self.peak = 0

    def add(self, key: str, parts: List[Tuple[int, int, Tensor, Tensor]], alpha: float) -> None:
        """``parts``: ``(owner's first row, the rows it holds, which of them were read (0-based), their
        gradients)`` per owner chunk, scaled by ``alpha`` when summed."""
        for start, held, rows, grad in parts:
            entry = self.parts.setdefault((key, start), [None, [], 0])
            if entry[0] is None and entry[2] + rows.numel() > held:  # read more than it holds: folded
                entry[0] = grad.new_zeros((held, *grad.shape[1:]))
                for r, g, a in entry[1]:
                    entry[0].index_add_(0, r, g, alpha=a)
                    self.bytes -= g.numel() * g.element_size()
                entry[1] = []
                self.bytes += entry[0].numel() * entry[0].element_size()
            if entry[0] is not None:
                entry[0].index_add_(0, rows, _as(grad, entry[0].dtype), alpha=alpha)
            else:
                entry[1].append((rows, grad, alpha))
                entry[2] += rows.numel()
                self.bytes += grad.numel() * grad.element_size()
        self.peak = max(self.peak, self.bytes)

    def take(self, key: str, start: int, held: int, like: Tensor) -> Optional[Tensor]:
        """The gradient of the ``held`` rows of the owner starting at ``start`` at ``key`` (``None``: nothing
        came), in ``like``'s dtype."""
        got = self.parts.pop((key, start), None)
        if got is None:
            return None
        out, parts, _ = got
        if out is None:
            out = like.new_zeros((held, *like.shape[1:]))
            for rows, grad, alpha in parts:
                out.index_add_(0, rows, _as(grad, out.dtype), alpha=alpha)
                self.bytes -= grad.numel() * grad.element_size()
        else:
            self.bytes -= out.numel() * out.element_size()
        return _as(out, like.dtype)

    def reset(self) -> None:
        self.parts, self.bytes = {}, 0

    def end_drain(self) -> None:
        """At the end of a drain, what no owner took is dropped, as a buffer of every held row left it: an owner
        whose backward never reaches the site (PyG's cached layers, ``SGConv(cached=True)``: from the second call
        on, its propagated rows come from the cache, with no gradient to its input) has nothing to add them to."""
        self.reset()


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` (no call where it is already: a few of these a chunk and layer add up on a GPU's host)."""
    return t if t.dtype == dtype else t.to(dtype)


def owner_parts(history, cg, ids: Tensor, owner: Tensor) -> List[Tuple[int, int, slice, Tensor]]:
    """``ids`` (device; one way's rows) grouped by their ``owner`` chunks of ``cg`` (CPU, ascending) as
    :meth:`Pending.add` takes them: per owner, its first row, the rows ``history`` holds of it (its span), which of
    ``ids`` are its, and their places among its held rows."""
    parts, a, local = [], 0, history.local
    owners, counts = torch.unique_consecutive(owner, return_counts=True)
    for o, n in zip(owners.tolist(), counts.tolist()):
        at = history.span(cg.chunks[o].start, cg.chunks[o].end, ids)[1]
        mine = ids[a:a + n]
        parts.append((cg.chunks[o].start, at.stop - at.start, slice(a, a + n),
                      (mine if local is None else local[mine]) - at.start))
        a += n
    return parts
