"""Which operations combine the rows of different vertices (:mod:`.rows` follows the tensors with a row per
vertex; these rules judge each operation on them): reductions and scans over the vertex dimension, contractions
over it, scatters and gathers along it, indexing by position, and how an operation moves that dimension."""
from __future__ import annotations

import sys
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

#: reductions and scans over a dimension: name -> (position of the ``dim`` argument, default dim;
#: ``None``: all dimensions)
_REDUCE: Dict[str, Tuple[int, Optional[int]]] = {
    **{n: (1, None) for n in ("sum", "nansum", "mean", "nanmean", "prod", "amax", "amin", "aminmax", "max", "min",
                              "argmax", "argmin", "median", "nanmedian", "logsumexp", "count_nonzero", "std", "var",
                              "std_mean", "var_mean", "unique", "unique_consecutive")},
    **{n: (1, -1) for n in ("softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax", "cummin",
                            "logcumsumexp", "sort", "argsort", "mode", "msort")},
    **{n: (2, -1) for n in ("topk", "kthvalue")},
    **{n: (2, None) for n in ("norm", "quantile", "nanquantile")},
    "normalize": (2, 1),
}
_CONTRACT = {"mm", "matmul", "bmm", "__matmul__", "__rmatmul__", "addmm", "baddbmm", "addbmm", "einsum",
             "scaled_dot_product_attention", "multi_head_attention_forward", "_native_multi_head_attention"}
_SCATTER = {"scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_", "index_add",
            "index_add_", "index_reduce", "index_reduce_", "index_copy", "index_copy_", "index_fill", "index_fill_",
            "index_put", "index_put_", "index_select", "gather", "take_along_dim", "narrow", "roll", "flip"}
#: torch's dispatch helpers between a caller and a function mode
_HELPERS = ("torch.overrides", "torch._tensor", "torch.functional", "torch.nn.functional", "torch._jit_internal")


def caller(depth: int = 2):
    """The frame that called the operation (past torch's dispatch helpers); ``depth``: the frames from here to
    the function mode's handler, plus one."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_HELPERS):
        frame = frame.f_back
    return frame


def op_name(func) -> str:
    """The operation's name; the transposing properties (``x.T``, ``x.mT``) by their own."""
    name = getattr(func, "__name__", str(func))
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        for prop in ("T", "mT", "H", "mH"):
            if owner is getattr(Tensor, prop, None):
                return prop
    return name


def tensors(args, kwargs) -> List[Tensor]:
    out = []
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out += [u for u in v if isinstance(u, Tensor)]
    return out


def _norm(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _arg(args, kwargs, pos: int, *names, default=None):
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return args[pos] if len(args) > pos else default


def mixes(name: str, args, kwargs, aligned) -> Optional[str]:
    """How the operation combines vertex rows (``None``: it does not)."""
    first = args[0] if args else None
    for t, v in aligned:
        if name in _REDUCE:
            if t is not first:
                continue
            pos, default = _REDUCE[name]
            dim = _arg(args, kwargs, pos, "dim", "axis", default=default)
            if isinstance(dim, Tensor) or isinstance(dim, bool):
                if name in ("max", "min") and isinstance(dim, Tensor):
                    continue  # elementwise maximum of two tensors
                dim = default  # std(x, unbiased) and friends
            dims = range(t.dim()) if dim is None else [dim] if isinstance(dim, int) else list(dim)
            if v in [_norm(d, t.dim()) for d in dims]:
                return "orders or accumulates {rows}" if name in ("sort", "argsort", "msort", "cumsum", "cumprod",
                                                                 "cummax", "cummin", "logcumsumexp") \
                    else "reduces over {rows}"
        elif name in _CONTRACT:
            if _contracts(name, args, kwargs, t, v):
                return "multiplies {rows} together"
        elif name in _SCATTER:
            if name in ("roll", "flip"):
                dims = _arg(args, kwargs, 2 if name == "roll" else 1, "dims")
                dims = range(t.dim()) if dims is None else [dims] if isinstance(dims, int) else list(dims)
                if t is first and v in [_norm(d, t.dim()) for d in dims]:
                    return "reorders {rows}"
                continue
            dim = _arg(args, kwargs, 1, "dim")
            if name == "take_along_dim":
                dim = _arg(args, kwargs, 2, "dim")
            if not isinstance(dim, int) or _norm(dim, t.dim()) != v:
                continue
            if name == "narrow":
                start, length = _arg(args, kwargs, 2, "start"), _arg(args, kwargs, 3, "length")
                if start == 0 and length == t.size(v):
                    continue
            index_arg = _arg(args, kwargs, 2, "index")
            if index_arg is t:
                continue  # the aligned tensor is an index into something else
            return "selects or scatters {rows} by position"
        elif name in ("__getitem__", "__setitem__") and t is first:
            if _positional_index(args[1] if len(args) > 1 else None, v, t.size(v)):
                return "selects {rows} by position"
        elif name in ("nonzero", "argwhere") or (name == "where" and len(args) == 1):
            return "lists the positions of {rows}"
        elif name == "batch_norm" and bool(_arg(args, kwargs, 5, "training", default=False)) and v == 0:
            return "normalises with statistics over {rows}"
        elif name in ("layer_norm", "group_norm") and t is first:
            shape = _arg(args, kwargs, 1, "normalized_shape", "num_groups")
            if name == "group_norm" and v > 0:
                return "normalises with statistics over {rows}"
            if name == "layer_norm" and isinstance(shape, (tuple, list, torch.Size)) and v >= t.dim() - len(shape):
                return "normalises with statistics over {rows}"
    return None


def _contracts(name: str, args, kwargs, t: Tensor, v: int) -> bool:
    if name == "einsum":
        eq = args[0] if args and isinstance(args[0], str) else None
        ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list)) else list(args[1:])
        if eq is None or "..." in eq:
            return False
        lhs, _, rhs = eq.replace(" ", "").partition("->")
        terms = lhs.split(",")
        if not rhs and "->" not in eq:
            rhs = "".join(sorted(c for c in set(lhs) if c.isalpha() and lhs.count(c) == 1))
        for term, op in zip(terms, ops):
            if op is t and v < len(term) and term[v] not in rhs:
                return True
        return False
    if name == "scaled_dot_product_attention":
        return any(_arg(args, kwargs, i, n) is t for i, n in ((1, "key"), (2, "value"))) and v == t.dim() - 2
    if name in ("multi_head_attention_forward", "_native_multi_head_attention"):
        seq = 0 if name == "multi_head_attention_forward" else 1  # (L, B, E) / (B, L, E)
        return any(_arg(args, kwargs, i, n) is t for i, n in ((1, "key"), (2, "value"))) and v == seq
    ops = list(args)
    if name in ("addmm", "baddbmm", "addbmm"):
        ops = ops[1:3]
    elif name == "__rmatmul__":
        ops = ops[:2][::-1]
    else:
        ops = ops[:2]
    if len(ops) != 2 or not all(isinstance(o, Tensor) for o in ops):
        return False
    a, b = ops
    if a is t and v == a.dim() - 1:
        return True
    return b is t and v == (b.dim() - 2 if b.dim() >= 2 else 0)


def _positional_index(index, v: int, n: int) -> bool:
    """Whether indexing with ``index`` selects along dimension ``v`` (of ``n`` rows) by position."""
    entries = list(index) if isinstance(index, tuple) else [index]
    if any(e is None or e is Ellipsis for e in entries):
        return False  # a layout change this check does not follow
    if v >= len(entries):
        return False
    before = entries[:v]
    if any(not (isinstance(e, slice) and e == slice(None)) for e in before):
        return False
    e = entries[v]
    if isinstance(e, slice):  # positional unless it covers all n rows (``x[:x.size(0)]`` as much as ``x[:]``)
        return not (e.start in (None, 0) and e.step in (None, 1) and
                    (e.stop is None or (isinstance(e.stop, int) and e.stop >= n)))
    if isinstance(e, bool):
        return False
    if isinstance(e, int):
        return True
    if isinstance(e, Tensor):
        return e.dtype != torch.bool
    if isinstance(e, (list, range)):
        return True
    return False


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
        return v if o.dim() == n else (0 if v == 0 and o.dim() > 0 and o.size(0) == t.size(0) else None)
    if o.dim() == n and o.size(v) == t.size(v):
        return v
    if v == 0 and o.dim() > 0 and o.size(0) == t.size(0):
        return 0  # reshapes that keep the leading dimension
    return None


#: operations whose output holds entries of their input (so vertex ids at edge ends stay vertex ids):
#: selections, joins and layout changes
_KEEPS_IDS = {"__getitem__", "select", "unbind", "narrow", "flip", "index_select", "masked_select", "cat", "concat",
              "stack", "view", "reshape", "contiguous", "clone", "to", "long", "int", "t", "T", "expand",
              "expand_as", "repeat", "repeat_interleave", "unsqueeze", "squeeze", "flatten", "view_as", "reshape_as",
              "chunk", "split", "detach", "sort", "unique", "broadcast_to", "take", "gather"}


#: which end of its edges a tensor of vertex ids holds: ``"src"`` (sources: the neighbours, outside the chunk's
#: rows), ``"dst"`` (destinations: the chunk's own rows), ``"any"`` (either, or not known); a graph's
#: ``[2, E]`` entries, one per row: ``("src", "dst")``
#: operations that keep a ``[2, E]`` graph's rows as they are
_KEEPS_ROWS = {"clone", "to", "long", "int", "contiguous", "detach"}


def ids_kinds(name: str, args, kwargs, kind_of, n_out: int):
    """The ends of edges each output of the operation holds (a list, one kind per output; ``None``: it holds
    no vertex ids at edge ends). It selects, joins or reshapes such ids (``edge_index[0]``, ``row, col =
    edge_index``, ``torch.cat([edge_index, loops], 1)``); ``kind_of(t)`` is an input's kind (``None``: no ids)."""
    if name not in _KEEPS_IDS or not args:
        return None
    first = args[0]
    if isinstance(first, (tuple, list)):  # cat / stack
        kinds = [kind_of(t) if isinstance(t, Tensor) else None for t in first]
        if all(k is None for k in kinds):
            return None
        dim = _arg(args, kwargs, 1, "dim", default=0)
        if name == "stack" and dim == 0 and all(isinstance(k, str) for k in kinds):
            return [tuple(kinds)]  # torch.stack([row, col])
        kinds = [k for k in kinds if k is not None]  # (others joined: self loops, within the chunk's rows)
        return [kinds[0] if all(k == kinds[0] for k in kinds) else "any"] * n_out
    k = kind_of(first) if isinstance(first, Tensor) else None
    if k is None:
        return None
    if isinstance(k, str):
        return [k] * n_out
    return _graph_rows(name, args, kwargs, k, n_out)


def _graph_rows(name: str, args, kwargs, k: tuple, n_out: int) -> list:
    """:func:`ids_kinds` of an operation on a ``[2, E]`` graph whose rows hold the ends ``k``."""
    if name == "__getitem__" and len(args) > 1:
        e0 = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
        if isinstance(e0, int) and -len(k) <= e0 < len(k):
            return [k[e0]]
        return [k] if isinstance(e0, slice) and e0 == slice(None) else ["any"]
    dim = _arg(args, kwargs, 1, "dim", "dims", default=0)
    if name == "select" and dim == 0:
        i = _arg(args, kwargs, 2, "index")
        return [k[i]] if isinstance(i, int) and -len(k) <= i < len(k) else ["any"]
    if name in ("unbind", "chunk", "split") and dim == 0 and n_out == len(k):
        return list(k)
    if name == "flip":
        dims = [dim] if isinstance(dim, int) else list(dim)
        return [tuple(reversed(k)) if 0 in [_norm(d, 2) for d in dims] else k]
    if name in _KEEPS_ROWS or (name in ("narrow", "index_select") and _norm(dim, 2) == 1):
        return [k] * n_out
    return ["any"] * n_out


#: operations that sum (or write) values into per-vertex positions given by an index: ``(name, where the index is)``
_SCATTERS = {**{n: 2 for n in ("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
                               "scatter_reduce_", "index_add", "index_add_", "index_reduce", "index_reduce_",
                               "index_copy", "index_copy_")}, "bincount": 0, "index_put": 1, "index_put_": 1}


def scatter_index(name: str, args, kwargs) -> Optional[Tensor]:
    """The index of a scatter (``x.scatter_add_(0, index, src)``, ``x.index_add_(0, index, src)``,
    ``torch.bincount(index)``, ``x.index_put_((index,), v, accumulate=True)``), else ``None``."""
    pos = _SCATTERS.get(name)
    if pos is None:
        return None
    index = _arg(args, kwargs, pos, "index", "indices", "input")
    if pos == 1 and isinstance(index, (tuple, list)):
        index = index[0] if index else None
    return index if isinstance(index, Tensor) else None


def in_bounds(name: str, args, kwargs) -> tuple:
    """``args`` of a scatter with its index clamped to the rows it writes (the pass of a refused scatter runs on)."""
    pos = _SCATTERS.get(name)
    if pos != 2 or len(args) < 3 or not isinstance(args[0], Tensor) or not isinstance(args[1], int):
        return args
    return (*args[:2], args[2].clamp(0, args[0].size(args[1]) - 1), *args[3:])


def reads_at_ids(name: str, args, kwargs, rows, is_ids) -> Optional[Tuple[Tensor, int, Tensor]]:
    """``(t, v, index)`` when the operation reads the rows of ``t`` (vertex dimension ``v``) at positions
    given by vertex ids at edge ends: ``x[edge_index[0]]``, ``x.index_select(0, row)``,
    ``x.gather(0, row.view(-1, 1).expand(-1, d))`` (which end: the kind of ``index``)."""
    if not args:
        return None
    for t, v in rows:
        if t is not args[0]:
            continue
        if name == "__getitem__" and len(args) > 1:
            entries = list(args[1]) if isinstance(args[1], tuple) else [args[1]]
            if v < len(entries) and all(isinstance(e, slice) and e == slice(None) for e in entries[:v]):
                e = entries[v]
                if isinstance(e, Tensor) and e.dtype != torch.bool and is_ids(e):
                    return t, v, e
        elif name in ("index_select", "gather", "take_along_dim"):
            dim = _arg(args, kwargs, 2 if name == "take_along_dim" else 1, "dim")
            index = _arg(args, kwargs, 1 if name == "take_along_dim" else 2, "index", "indices")
            if isinstance(dim, int) and _norm(dim, t.dim()) == v and isinstance(index, Tensor) and is_ids(index):
                return t, v, index
    return None
