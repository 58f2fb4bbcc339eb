"""Where the vertex dimension of a tensor goes through an operation that changes its layout (transposes, permutes,
stacks, concatenations, squeezes, reshapes): the row check (:mod:`.rows`) follows the rows of every vertex this way,
and the rules of :mod:`.row_rules` judge each operation on them.

Rows joined along the vertex dimension (``torch.cat([x, y])``, ``x.repeat(2, 1)``) stay followed, with their
*layout*: the pieces along that dimension, each the rows of all vertices or something else (a learned row). Reducing
over them combines the rows of different vertices (``torch.cat([x, 2 * x]).max(0)`` ran silently wrong until
2026-11-28, off by 0.91 in graph parallelism); taking whole pieces back (``h[:n]``, ``h.split(n)``, ``h.chunk(2)``,
``h.view(2, n, -1)``) gives vertex rows again, exactly. ``x.repeat_interleave(r, 0)`` keeps each vertex's copies
together: followed as rows, any part of it taken is by position."""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .row_rules import _arg, _norm, einsum_terms, index_entries


class Followed:
    """The tensors the row check follows (by identity, weakly): for each, its vertex dimension, whether that dimension
    has one row per edge rather than per vertex, the pieces joined along it (a :data:`Layout`, or ``None``), and how
    many consecutive entries along it belong to each vertex (``x.view(-1)``: the features; ``None``: unknown)."""

    def __init__(self):
        self._by_id: Dict[int, Tuple[Any, int, bool, Any, Optional[int]]] = {}

    def add(self, t: Tensor, d: Optional[int], edges: bool = False, layout=None, per: Optional[int] = 1) -> None:
        if d is not None:
            self._by_id[id(t)] = (weakref.ref(t), d, edges, layout, per)

    def get(self, t: Tensor) -> Optional[tuple]:
        """``(vertex dimension, per edge, layout, entries per vertex)`` of a followed ``t``, else ``None``."""
        hit = self._by_id.get(id(t))
        return hit[1:] if hit is not None and hit[0]() is t else None

    def per_edge(self, t: Tensor) -> bool:
        return (self.get(t) or (0, False))[1]

    def layout(self, t: Tensor):
        return (self.get(t) or (0, False, None))[2]

    def follow(self, name: str, args, kwargs, t: Tensor, v: int, out, vdim_of: Callable) -> Optional[str]:
        """Follows the rows of ``t`` (vertex dimension ``v``) into the operation's outputs ``out``; returns how it
        combined the rows of different vertices where a reshape did (else ``None``)."""
        edges, per = self.per_edge(t), (self.get(t) or (0, False, None, 1))[3]
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(o, Tensor) or o.dim() == 0 or o.layout != torch.strided:
                continue
            hit = located(name, args, kwargs, t, v, o, self.layout, vdim_of, per)
            if isinstance(hit, str):
                return hit
            if hit is not None:
                self.add(o, hit[0], edges, *hit[1:])
        return None

    def take(self, name: str, func, args, kwargs, t: Tensor, v: int):
        """An operation selecting by position along ``v`` from rows joined along it: when it takes whole pieces
        (``torch.cat([x, y])[:n]``) its outputs hold vertex rows again (followed; returned), else ``None``."""
        lay = self.layout(t)
        if lay is None or name not in TAKES or args[0] is not t:
            return None
        out = func(*args, **kwargs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        took = taken(name, args, kwargs, t, v, lay, outs)
        for o, (d, pieces) in zip(outs, took or ()):
            self.add(o, d, self.per_edge(t), pieces)
        return out if took is not None else None


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
    if name in ("cat", "concat", "concatenate", "hstack", "repeat_interleave") or (name in STACKS and n >= 2):
        return 0 if name == "repeat_interleave" and _arg(args, kwargs, 2, "dim") is None else v
    if name in STACKS:  # vectors stacked as the rows of a matrix
        return v + 1
    if name in ("expand", "expand_as", "broadcast_to"):  # (new leading dimensions: x.expand(2, -1, -1) was lost and a
        return v + o.dim() - n                           # reduction after it ran unchecked until 2026-11-28)
    if name == "einsum":  # where the vertex letter of the operand is in the output ("nd->dn": a transpose, was lost)
        parsed = einsum_terms(args)
        if parsed is not None:
            terms, ops, rhs = parsed
            term = next((term for term, op in zip(terms, ops) if op is t), None)
            return rhs.index(term[v]) if term is not None and v < len(term) and term[v] in rhs else None
    if name in ("repeat", "tile"):  # (more repeats than dimensions: new leading ones)
        reps = _reps(args)
        return v + max(0, len(reps) - n)
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
        return _indexed(args[1] if len(args) > 1 else None, t, v, o)
    if o.dim() == n and o.size(v) == t.size(v):
        return v
    if v == 0 and o.dim() > 0 and o.size(0) == t.size(0):
        return 0  # reshapes that keep the leading dimension
    if name in RESHAPES:  # the vertex dimension merged with the ones after it, or split again: where it leads
        return merged(t, v, o)
    return None


#: reshapes: the entries keep their order, so a vertex's entries stay together
RESHAPES = frozenset({"view", "reshape", "flatten", "ravel", "view_as", "reshape_as", "unflatten"})


def _indexed(index, t: Tensor, v: int, o: Tensor) -> Optional[int]:
    """Where ``o = t[index]`` (no boolean mask first) puts dimension ``v`` of ``t``: integers remove the
    dimensions before it, ``None`` adds one (``x[None]``, ``x.unsqueeze(0)[0]``: were lost, and a reduction after them
    ran unchecked until 2026-11-28). With tensor or list indices, which torch may move to the front, where it stays
    in place or leads."""
    n = t.dim()
    entries = index_entries(index, n)
    if any(isinstance(e, (Tensor, list, range)) for e, _ in entries):
        return v if o.dim() == n else (0 if v == 0 and o.dim() > 0 and o.size(0) == t.size(0) else None)
    out = 0
    for e, d in entries:
        if d == v:
            return out if isinstance(e, slice) else None
        if d is None or isinstance(e, slice):
            out += 1
    return None


def _mask(args) -> Optional[Tensor]:
    index = args[1] if len(args) > 1 else None
    return index if isinstance(index, Tensor) and index.dtype == torch.bool and index.dim() >= 1 else None


def followed(name: str, args, t: Tensor, v: int, o: Tensor, d: int) -> bool:
    """Whether dimension ``d`` of ``o`` (where :func:`moved` put the vertex dimension ``v`` of ``t``) still holds
    vertex rows: the same number, merged by a reshape (:func:`merged`), or the rows a boolean mask selects
    (``x[x[:, 0] > 0]``: reducing over them combines the rows of different vertices, the selected ones; was not
    followed, and ``x[mask].mean(0)`` ran silently wrong until 2026-11-28)."""
    return o.size(d) == t.size(v) or name in RESHAPES or name in JOINS or \
        (name == "__getitem__" and _mask(args) is not None)


def merged(t: Tensor, v: int, o: Tensor) -> Optional[int]:
    """After a reshape of ``t`` into ``o``: the dimension of ``o`` whose leading part indexes ``t``'s dimension ``v``
    (the dimensions before it unchanged in size), e.g. 0 for ``x.view(-1)`` of an ``(N, F)`` ``x``: reducing over it
    combines vertex rows, as over ``v`` itself. ``None`` when no dimension starts where ``v`` started."""
    before, size = 1, 1
    for d in range(v):
        before *= t.size(d)
    for k in range(o.dim()):
        if size == before and o.size(k) > 1:
            return k
        size *= o.size(k)
    return None


#: the pieces along a tensor's vertex dimension: (start, stop, whether the piece holds vertex rows) for each
Layout = Tuple[Tuple[int, int, bool], ...]
#: operations joining tensors (or copies of one) along a dimension
JOINS = frozenset({"cat", "concat", "concatenate", "vstack", "row_stack", "hstack", "repeat", "tile",
                   "repeat_interleave"})
STACKS = frozenset({"vstack", "row_stack"})
#: operations taking ranges of rows along a dimension
TAKES = frozenset({"__getitem__", "narrow", "split", "split_with_sizes", "chunk", "tensor_split"})


def _reps(args) -> tuple:
    reps = args[1:]
    return tuple(reps[0]) if len(reps) == 1 and isinstance(reps[0], (tuple, list, torch.Size)) else tuple(reps)


def located(name: str, args, kwargs, t: Tensor, v: int, o: Tensor, layout_of: Callable, vdim_of: Callable,
            per: Optional[int] = 1):
    """Where the rows of ``t`` (vertex dimension ``v``, pieces ``layout_of(t)``, ``per`` entries a vertex) are in
    output ``o``: ``(dimension, layout, entries per vertex)``, the layout ``None`` when the dimension holds the rows
    once; ``None`` when ``o`` does not hold them; :data:`GROUPS` when a reshape split the vertex dimension into groups
    of several vertices (``x.view(-1, 2, d)`` pairs consecutive rows: which vertices meet depends on the chunk)."""
    if _gathered(name, args, kwargs, t, v):
        return None
    lay = layout_of(t)
    if name in RESHAPES and lay is not None:
        d = _blocks(t, v, o, lay)
        if d is not None:
            return d, None, 1
    d = moved(name, args, kwargs, t, v, o)
    if d is None or not 0 <= d < o.dim() or not followed(name, args, t, v, o, d):
        return None
    if o.size(d) == t.size(v):
        return d, lay, per
    if name in RESHAPES:  # (the vertices along v: its size over the entries of each)
        n = t.size(v) // per if per else t.size(v)
        return (d, None, o.size(d) // n) if n and o.size(d) % n == 0 else GROUPS
    if name == "repeat_interleave":
        reps = _arg(args, kwargs, 1, "repeats")
        return d, None, per * reps if per and isinstance(reps, int) and _arg(args, kwargs, 2, "dim") is not None \
            else None
    joined = _joined(name, args, kwargs, t, v, lay, layout_of, vdim_of) if name in JOINS else None
    return d, joined, 1


#: what :func:`located` says of a reshape that groups the rows of several vertices
GROUPS = "reshapes {rows} into groups by position"


def _gathered(name: str, args, kwargs, t: Tensor, v: int) -> bool:
    """Whether the operation reads rows along ``v`` at an index tensor (``x[edge_index[1]]``, ``index_select``): its
    output has a row per index entry, not per vertex, even where their numbers agree (SuperGATConv's attention logits
    at as many sampled edges as a ring's vertices were taken for vertex rows)."""
    if name == "__getitem__":
        index = args[1] if len(args) > 1 else None
        entries = list(index) if isinstance(index, tuple) else [index]
        return v < len(entries) and isinstance(entries[v], Tensor) and entries[v].dtype != torch.bool and \
            not any(e is None or e is Ellipsis for e in entries[:v])
    if name in ("index_select", "gather", "take_along_dim"):
        dim = _arg(args, kwargs, 2 if name == "take_along_dim" else 1, "dim")
        return isinstance(dim, int) and _norm(dim, t.dim()) == v
    return False


def _joined(name: str, args, kwargs, t: Tensor, v: int, lay, layout_of: Callable, vdim_of: Callable):
    """The layout of a join along the vertex dimension (``None``: not along it, or a repeat of each row)."""
    n, out = t.size(v), []
    if name in ("repeat", "tile"):
        reps = _reps(args)  # (aligned with the dimensions from the last; tile: fewer repeats, the first kept)
        i = v + len(reps) - t.dim()
        k = reps[i] if i >= 0 else 1
        return tuple((a + i * n, b + i * n, r) for i in range(k) for a, b, r in (lay or ((0, n, True),))) \
            if k > 1 else None
    if name == "repeat_interleave":
        return None
    dim = 0 if name in STACKS else (1 if t.dim() >= 2 else 0) if name == "hstack" else \
        _norm(_arg(args, kwargs, 1, "dim", "axis", default=0), t.dim())
    if dim != v:
        return None
    at = 0
    for p in (args[0] if args else kwargs.get("tensors", ())):
        if not isinstance(p, Tensor) or (p.dim() == 1 and p.numel() == 0 and t.dim() > 1):
            continue  # (an empty vector: skipped by cat)
        size = p.size(dim)
        own = layout_of(p)
        out += [(a + at, b + at, r) for a, b, r in (own or ((0, size, vdim_of(p) == dim),))]
        at += size
    return tuple(out)


def _blocks(t: Tensor, v: int, o: Tensor, lay) -> Optional[int]:
    """``t``'s vertex dimension joins k pieces of n vertex rows each (``torch.cat([x, y])``) and ``o`` reshapes it to
    ``(k, n)``: the dimension of the rows in ``o`` (the other indexes the pieces)."""
    n = lay[0][1] - lay[0][0]
    if not all(r and b - a == n for a, b, r in lay):
        return None
    before, size = 1, 1
    for d in range(v):
        before *= t.size(d)
    for k in range(o.dim() - 1):
        if size == before and o.size(k) == len(lay) and o.size(k + 1) == n:
            return k + 1
        size *= o.size(k)
    return None


def taken(name: str, args, kwargs, t: Tensor, v: int, lay, outs) -> Optional[List]:
    """When the operation takes whole pieces of ``t``'s joined rows along ``v`` (``h[:n]``, ``h[n:]``,
    ``h.split(n)``, ``h.chunk(2)``, ``h.narrow(0, n, n)``): for each output, ``(its vertex dimension, its layout)``
    (``(None, ...)``: it took no vertex rows; layout ``None``: it took one piece, the rows once); else ``None``."""
    size = t.size(v)
    if name == "__getitem__":
        index = args[1] if len(args) > 1 else None
        entries = list(index) if isinstance(index, tuple) else [index]
        if len(entries) <= v or any(not isinstance(e, (slice, int)) or isinstance(e, bool) for e in entries) or \
                any(e != slice(None) for e in entries[:v]) or not isinstance(entries[v], slice):
            return None
        start, stop, step = entries[v].indices(size)
        ranges = [(start, stop)] if step == 1 else []
    elif name == "narrow":
        if _norm(_arg(args, kwargs, 1, "dim"), t.dim()) != v:
            return None
        start = _norm(_arg(args, kwargs, 2, "start"), size)
        ranges = [(start, start + _arg(args, kwargs, 3, "length"))]
    else:
        if name not in TAKES or _norm(_arg(args, kwargs, 2, "dim", default=0), t.dim()) != v:
            return None
        ranges, at = [], 0
        for o in outs:
            ranges.append((at, at + o.size(v)))
            at += o.size(v)
    bounds = {a for a, _, _ in lay} | {size}
    if not ranges or any(a not in bounds or b not in bounds for a, b in ranges):
        return None
    took = [tuple((a - s, b - s, r) for a, b, r in lay if s <= a and b <= e) for s, e in ranges]
    return [(v if any(r for _, _, r in p) else None, p if len(p) > 1 else None) for p in took]
