"""The halo of a streamed chunk (:mod:`.stream`): the group's inputs carry their true halo rows; a
propagate whose sources are computed inside the group is a *barrier site*, whose rows every chunk writes
to the store in one pass and reads, complete, in the next; its backward depends on the phase."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import Tensor

from ...graph.chunks import ChunkedGraph, LocalGraph
from ..runtime.store import Store


class _Barrier(Exception):
    """Raised at the first propagate of a pass whose sources are not complete yet (a barrier site)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


class _Join(torch.autograd.Function):
    """``[rows | halo]`` at a barrier site; its backward depends on the phase (module docstring)."""

    @staticmethod
    def forward(ctx, rows: Tensor, halo: Tensor, anchor: Tensor, site: "_Site", ids: Tensor):
        ctx.site, ctx.ids, ctx.rows = site, ids, rows.size(0)
        return torch.cat([rows, halo])

    @staticmethod
    def backward(ctx, grad: Tensor):
        site = ctx.site
        if site.capture:  # phase k: the gradient of every source row (own and halo) -> G_k; stop here
            site.store.add_grad(site.key, ctx.ids, grad)
            site.reached = True
            return None, None, torch.zeros((), device=grad.device), None, None
        # a later phase: the rows take their complete gradient, gathered in the phase of this site (none: zero)
        site.reached = True
        g_rows = site.store.grad_rows(site.key, site.lg)
        g_rows = grad.new_zeros((ctx.rows, *grad.shape[1:])) if g_rows is None else g_rows.to(grad.dtype)
        return g_rows, None, None, None, None


@dataclass
class _Site:
    key: str
    store: Store
    lg: LocalGraph
    capture: bool = False
    reached: bool = False
    anchor: Optional[Tensor] = None


class StreamHalo:
    """The halo source of a streamed chunk (the chunk context's ``halo``): barrier sites read complete
    buffers, the first incomplete one stops the pass (module docstring)."""

    def __init__(self, store: Store, complete: List[str], capture: Optional[str] = None):
        self.store, self.complete, self.capture = store, complete, capture
        self.sites: Dict[str, _Site] = {}
        self.constant: set = set()   # sites whose sources need no gradient

    def join(self, key: str, cg: ChunkedGraph, lg: LocalGraph, t: Tensor, vdim: int) -> Tensor:
        rows = t.narrow(vdim, 0, lg.rows)
        if vdim:
            rows = rows.movedim(vdim, 0)
        if key not in self.complete:
            self.store.kinds[key] = "rows"  # a layer's source rows, one per vertex
            self.store.put(key, lg, rows)
            raise _Barrier(key)
        ids = lg.nodes
        halo = self.store.gather(key, lg.halo)
        if torch.is_grad_enabled() and rows.requires_grad:
            site = self.sites[key] = _Site(key, self.store, lg, capture=key == self.capture)
            site.anchor = torch.zeros((), device=rows.device, requires_grad=True)
            out = _Join.apply(rows, halo.to(rows.dtype), site.anchor, site, ids)
        else:
            if not rows.requires_grad:
                self.constant.add(key)
            out = torch.cat([rows, halo.to(rows.dtype)])
        return out.movedim(0, vdim) if vdim else out
