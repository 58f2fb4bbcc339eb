"""The halo of a streamed chunk (:mod:`.stream`): the group's inputs carry their true halo rows
(:class:`StreamInput`); a propagate whose sources are computed inside the group is a *barrier site*, whose
rows every chunk writes to the store in one pass and reads, complete, in the next; its backward depends on
the phase."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

from ...graph.chunks import ChunkedGraph, LocalGraph
from ..context import leading_rows
from ..runtime.store import Store


class _Barrier(Exception):
    """Raised at the first propagate of a pass whose sources are not complete yet (a barrier site)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


class StreamInput:
    """One node value a streamed chunk receives: its rows, handed to the group, and its ``[rows | halo]``, handed to
    a layer that propagates it (registered with the chunk context as the rows' extension). Gathered as one tensor
    from the store (:meth:`~..runtime.store.Store.gather_local`, the rows a view of it), or, where no layer of the
    group propagated the value on the chunks before (:class:`~.direct.DirectCalls`), the rows alone, the whole
    gathered only if a layer asks for it after all (``make``): the same values either way.

    With gradients the rows are a leaf of their own and the whole the output of :class:`_Whole` on them, whose
    backward hands the rows their part of the gradient as a view and keeps the halo's part (:attr:`halo_grad`,
    ``None`` where nothing propagated the value: GCNII's ``x_0``); the store adds the two
    (:meth:`~..runtime.store.Store.add_grad_local`). The gathered tensor as the leaf, read through its rows' slice,
    would instead zero-fill and copy a gradient of its whole size for every slice read in the backward (two per
    chunk and group of a GCNII; docs/benchmarks.md, "Gradient slices, and halo reads no layer needs")."""

    def __init__(self, t: Tensor, rows: int, grad: bool, make: Optional[Callable[[], Tensor]] = None):
        self.grad = grad and t.is_floating_point()
        self.ext, self.make = (t, None) if make is None else (None, make)
        self.rows = t[:rows].detach().requires_grad_() if self.grad else t[:rows]
        self.halo, self._whole = _HaloGrad(), None

    @property
    def halo_grad(self) -> Optional[Tensor]:
        """The gradient of the halo rows (``None``: the whole was not propagated, or nothing reached it)."""
        return self.halo.grad

    @property
    def used(self) -> bool:
        """Whether a layer asked for the whole."""
        return self._whole is not None

    def whole(self) -> Tensor:
        """``[rows | halo]``, with its gradient's path to the rows (made at the first call)."""
        if self._whole is None:
            ext = self.ext if self.ext is not None else self.make()
            self._whole = _Whole.apply(self.rows, ext, self.halo) if self.grad else ext
        return self._whole


class _HaloGrad:
    """Where :class:`_Whole`'s backward leaves the halo's gradient (not the input itself: the autograd node would
    hold its own output through it, a reference cycle that keeps the chunk's activations until a collection)."""

    def __init__(self):
        self.grad: Optional[Tensor] = None


class _Whole(torch.autograd.Function):
    """A :class:`StreamInput`'s ``[rows | halo]`` (the gathered tensor: its first rows hold the rows leaf's values, in
    the leaf's own storage or, gathered late, in a copy): the rows' gradient a view, the halo's kept aside."""

    @staticmethod
    def forward(ctx, rows: Tensor, ext: Tensor, sink: _HaloGrad):
        ctx.sink, ctx.rows = sink, rows.size(0)
        return ext.view_as(ext)

    @staticmethod
    def backward(ctx, grad: Tensor):
        sink = ctx.sink
        halo = grad[ctx.rows:]
        sink.grad = halo if sink.grad is None else sink.grad + halo
        return grad[:ctx.rows], None, None


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
        rows = leading_rows(t, vdim, lg.rows)
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
