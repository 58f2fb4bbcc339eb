"""Where the vertex dimension of a tensor goes through an operation that changes its layout (transposes, permutes,
stacks, concatenations, squeezes, reshapes): the row check (:mod:`.rows`) follows the rows of every vertex this way,
and the rules of :mod:`.row_rules` judge each operation on them."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .row_rules import _arg, _norm


def moved(name: str, args, kwargs, t: Tensor, v: int, o: Tensor) -> Optional[int]:
    """Where the vertex dimension ``v`` of input ``t`` is in output ``o`` (``None``: lost)."""
    n = t.dim()
    if name in ("transpose", "swapaxes", "swapdims") and len(args) >= 3:
        a, b = _norm(args[1], n), _norm(args[2], n)
        return b if v == a else a if v == b else v
    if name in ("t", "T", "H"):
        return n - 1 - v if n >= 2 else v
    if name in ("mT", "mH"):
        return n - 1 if v == n - 2 else n - 2 if v == n - 1 else v
    if name == "permute":
        dims = args[1:] if len(args) > 2 or not isinstance(args[1] if len(args) > 1 else None, (tuple, list)) \
            else args[1]
        dims = [_norm(d, n) for d in dims]
        return dims.index(v) if v in dims else None
    if name in ("movedim", "moveaxis"):
        src, dst = args[1], args[2]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        order = [d for d in range(n) if d not in [_norm(s, n) for s in src]]
        for s, d in sorted(zip([_norm(s, n) for s in src], [_norm(d, n) for d in dst]), key=lambda p: p[1]):
            order.insert(d, s)
        return order.index(v)
    if name in ("unsqueeze", "stack"):
        d = _arg(args, kwargs, 1, "dim", default=0)
        d = _norm(d, o.dim())
        return v + 1 if d <= v else v
    if name in ("cat", "concat", "concatenate"):
        d = _norm(_arg(args, kwargs, 1, "dim", "axis", default=0), n)
        return None if d == v else v
    if name in ("unbind",):
        d = _norm(_arg(args, kwargs, 1, "dim", default=0), n)
        return None if d == v else v - 1 if d < v else v
    if name in ("chunk", "split", "tensor_split"):
        d = _norm(_arg(args, kwargs, 2, "dim", default=0), n)
        return None if d == v else v
    if name == "squeeze":
        if o.dim() == n:
            return v
        dims = _arg(args, kwargs, 1, "dim")
        dims = [d for d in range(n) if t.size(d) == 1] if dims is None else \
            [dims] if isinstance(dims, int) else list(dims)
        removed = [_norm(d, n) for d in dims if t.size(_norm(d, n)) == 1]
        return None if v in removed else v - sum(1 for d in removed if d < v)
    if name in ("__getitem__",):
        mask = _mask(args)
        if mask is not None:  # x[mask]: the selected entries along the first dimension, the rest after them
            return 0 if v < mask.dim() else v - mask.dim() + 1
        return v if o.dim() == n else (0 if v == 0 and o.dim() > 0 and o.size(0) == t.size(0) else None)
    if o.dim() == n and o.size(v) == t.size(v):
        return v
    if v == 0 and o.dim() > 0 and o.size(0) == t.size(0):
        return 0  # reshapes that keep the leading dimension
    if name in RESHAPES:  # the vertex dimension merged with the ones after it, or split again: where it leads
        return merged(t, v, o)
    return None


#: reshapes: the entries keep their order, so a vertex's entries stay together
RESHAPES = frozenset({"view", "reshape", "flatten", "ravel", "view_as", "reshape_as", "unflatten"})


def _mask(args) -> Optional[Tensor]:
    index = args[1] if len(args) > 1 else None
    return index if isinstance(index, Tensor) and index.dtype == torch.bool and index.dim() >= 1 else None


def followed(name: str, args, t: Tensor, v: int, o: Tensor, d: int) -> bool:
    """Whether dimension ``d`` of ``o`` (where :func:`moved` put the vertex dimension ``v`` of ``t``) still holds
    vertex rows: the same number, merged by a reshape (:func:`merged`), or the rows a boolean mask selects
    (``x[x[:, 0] > 0]``: reducing over them combines the rows of different vertices, the selected ones; was not
    followed, and ``x[mask].mean(0)`` ran silently wrong until 2026-11-28)."""
    return o.size(d) == t.size(v) or name in RESHAPES or (name == "__getitem__" and _mask(args) is not None)


def merged(t: Tensor, v: int, o: Tensor) -> Optional[int]:
    """After a reshape of ``t`` into ``o``: the dimension of ``o`` whose leading part indexes ``t``'s dimension ``v``
    (the dimensions before it unchanged in size), e.g. 0 for ``x.view(-1)`` of an ``(N, F)`` ``x``: reducing over it
    combines vertex rows, as over ``v`` itself. ``None`` when no dimension starts where ``v`` started."""
    before, size = 1, 1
    for d in range(v):
        before *= t.size(d)
    for k in range(o.dim()):
        if size == before and o.size(k) > 1 and (o.size(k) % t.size(v) == 0 or t.size(v) % o.size(k) == 0):
            return k
        size *= o.size(k)
    return None
