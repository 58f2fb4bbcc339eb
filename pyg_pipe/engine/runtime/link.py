"""The stage link: what travels between adjacent pipeline stages, chunk by chunk.

Forward, stage ``s`` sends stage ``s+1`` (same way) the values crossing their cut
(:func:`pyg_pipe.model.split.split`) for each chunk; backward, the gradients of those values go the
other way. Values are tensors or tuples/lists of tensors of any shape (node rows, edge rows, an
LSTM state of shape ``(1, rows, d)``): their structure and shapes are sent once, on the first step
of a plan, with small headers, and recorded on both sides; later steps send the raw tensors only, so
the per-chunk loop never waits on the host. A value whose shape changes between steps is reported
by the sender before anything hangs.

**Overlap**: while a stage computes chunk ``order[i]``, the receive of what chunk ``order[i+1]``
needs is already posted (:meth:`StageLink.prefetch` in the fill, :meth:`StageLink.prefetch_grads` in
the drain), so the previous (next) stage's send completes during the compute instead of after it::

    without:  recv(i) ── wait ──► compute(i) │ recv(i+1) ── wait ──► compute(i+1) │ ...
    with:     recv(i) ── wait ──► post recv(i+1); compute(i) │ wait(i+1) (usually done) ──► ...

Only chunks whose shapes are known (every step after a plan's first) are prefetched, and only after
the current chunk's receives completed, so messages from a rank still match the receives in order.

Bytes (:mod:`..comm`): the value feeding the next stage's first layer counts as
``stage_activations`` / ``stage_gradients``, every other value as ``carried``; the last stage's
output sent to the other ranks as ``output``. In training passes, floating-point values and gradients
crossing a cut travel in ``boundary_dtype`` when the knob sets one (bf16: half the bytes), and are cast
back on arrival (:meth:`Comm._wire`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ...model.errors import UnsupportedModelError
from ..comm import Comm
from ..tree import flatten, unflatten

Spec = Tuple[Any, List[Optional[Tuple[Tuple[int, ...], torch.dtype]]]]   # (structure, leaf shapes)


def _leaf(value: Any) -> bool:
    """What travels as a leaf: everything but containers (``None`` included, so the structure is fixed)."""
    return not isinstance(value, (tuple, list, dict))


def _floats(values: Dict[str, Any]) -> List[Tuple[str, Tensor]]:
    """``(name, tensor)`` of every floating-point leaf of ``values`` (the ones with gradients)."""
    return [(name, leaf) for name, value in values.items() for leaf in flatten(value, _leaf)[0]
            if isinstance(leaf, Tensor) and leaf.is_floating_point()]


class StageLink:
    """Per-chunk transport to the next stage and from the previous one (same way).

    Args:
        comm: counted transport.
        prev, next: ranks of the neighbouring stages (``None`` at the ends).
    """

    def __init__(self, comm: Comm, prev: Optional[int], next: Optional[int]):
        self.comm, self.prev, self.next = comm, prev, next
        self.sent: Dict[Tuple[Any, str], Spec] = {}        # structure and shapes, as told to the next stage
        self.received: Dict[Tuple[Any, str], Spec] = {}    # as told by the previous stage
        self._has_grad: List[bool] = []                     # per received tensor, this step
        self._want: List[bool] = []                         # per sent tensor, this step
        self._floats: Dict[Any, List[Tuple[Tuple[int, ...], torch.dtype]]] = {}  # per chunk key: sent float leaves
        self._posted: Dict[Any, Any] = {}                    # chunk key -> receives posted ahead (prefetch)
        self.prefetched = 0                                  # chunks whose receives were posted ahead

    # ------------------------------------------------------------------ forward
    def send(self, chunk: int, values: Dict[str, Any], activation: Optional[str]) -> None:
        for name, value in values.items():
            leaves, spec = flatten(value, _leaf)
            shapes = [_shape(name, leaf) for leaf in leaves]
            known = self.sent.get((chunk, name))
            if known is None:
                self.sent[(chunk, name)] = (spec, shapes)
                self.comm.send_object((spec, shapes), self.next)
            elif known[1] != shapes or known[0] != spec:
                raise UnsupportedModelError(
                    f"Value '{name}' crossing the pipeline cut changed shape between steps ({known[1]} -> {shapes}); "
                    f"pyg_pipe needs the same shapes every step for a chunk.")
            category = "stage_activations" if name == activation else "carried"
            for leaf in leaves:
                if leaf is not None:
                    self.comm.send(leaf, self.next, category)
        if chunk not in self._floats:  # shapes are fixed per chunk (checked above): recorded once
            self._floats[chunk] = [(tuple(t.shape), t.dtype) for _, t in _floats(values)]

    def recv(self, chunk, names: List[str], requires_grad: bool) -> Dict[str, Any]:
        posted = self._posted.pop(chunk, None)
        if posted is None:
            posted = self._post(chunk, names)
        else:
            self.prefetched += 1
        out = {}
        for name, (spec, pending) in posted.items():
            leaves = []
            for p in pending:
                t = None if p is None else p.get()
                if t is not None and requires_grad and t.is_floating_point():
                    t.requires_grad_()
                leaves.append(t)
            out[name] = unflatten(leaves, spec)
        return out

    def prefetch(self, chunk, names: List[str]) -> None:
        """Posts the receives of ``chunk``'s values now (module docstring), if their shapes are known."""
        if self.prev is not None and all((chunk, name) in self.received for name in names):
            self._posted[chunk] = self._post(chunk, names)

    def _post(self, chunk, names: List[str]) -> Dict[str, Any]:
        """``name -> (structure, [pending receive or None per leaf])``; a value not seen before is told by
        its header first (read here, on the host: plan time only)."""
        posted = {}
        for name in names:
            known = self.received.get((chunk, name))
            if known is None:
                known = self.received[(chunk, name)] = self.comm.recv_object(self.prev)
            spec, shapes = known
            posted[name] = (spec, [None if shape is None else self.comm.irecv(shape[0], shape[1], self.prev, True)
                                   for shape in shapes])
        return posted

    # ------------------------------------------------------------------ backward
    def send_grads(self, chunk, received: Dict[str, Any], activation: Optional[str], first: bool) -> None:
        """Sends the gradients of the values received for ``chunk`` back to the previous stage.

        Which received tensors got a gradient at all (a value the stage did not use has none, and
        the previous stage must then not back-propagate, as one process would not: optimizers treat a
        missing gradient and a zero one differently) is told once per step, with the first chunk.
        """
        leaves = _floats(received)
        if first:
            self._has_grad = [leaf.grad is not None for _, leaf in leaves]
            self.comm.send(torch.tensor(self._has_grad, dtype=torch.uint8, device=self.comm.device), self.prev, None)
        for (name, leaf), has in zip(leaves, self._has_grad):
            if has:
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                self.comm.send(g, self.prev, "stage_gradients" if name == activation else "carried")

    def expect_grads(self, sent: Dict[str, Any]) -> None:
        """Before a step's drain: which of the tensors sent per chunk the next stage back-propagated into
        (told once per step, read on the host here, outside the per-chunk loop)."""
        self._want = [bool(f) for f in self.comm.recv((len(_floats(sent)),), torch.uint8, self.next).tolist()]

    def recv_grads(self, chunk, sent: Dict[str, Any]) -> Tuple[List[Tensor], List[Tensor]]:
        """``(roots, grads)``: the float tensors sent for ``chunk`` that the next stage back-propagated
        into, and their gradients."""
        posted = self._posted.pop(("grad", chunk), None)
        if posted is None:
            posted = self._post_grads(chunk)
        else:
            self.prefetched += 1
        roots, grads = [], []
        for (_, leaf), p in zip(_floats(sent), posted):
            if p is not None:
                g = p.get()
                if leaf.requires_grad:
                    roots.append(leaf)
                    grads.append(g)
        return roots, grads

    def prefetch_grads(self, chunk) -> None:
        """Posts the receives of the gradients of what was sent for ``chunk`` now (module docstring)."""
        if self.next is not None and chunk in self._floats:
            self._posted[("grad", chunk)] = self._post_grads(chunk)

    def _post_grads(self, chunk) -> List[Any]:
        return [self.comm.irecv(shape, dtype, self.next, True) if want else None
                for (shape, dtype), want in zip(self._floats[chunk], self._want)]


def _shape(name: str, leaf) -> Optional[Tuple[Tuple[int, ...], torch.dtype]]:
    if leaf is None:
        return None
    if not isinstance(leaf, Tensor):
        raise UnsupportedModelError(
            f"Value '{name}' crosses a pipeline cut but holds a {type(leaf).__name__}; only tensors (or tuples of "
            f"tensors) can travel between stages. Compute it from the inputs without parameters or randomness "
            f"(every stage then recomputes it), or pass it as a tensor.")
    if leaf.layout != torch.strided:
        raise UnsupportedModelError(f"Value '{name}' crossing a pipeline cut is a sparse tensor; only dense tensors "
                                    f"travel between stages.")
    return tuple(leaf.shape), leaf.dtype
