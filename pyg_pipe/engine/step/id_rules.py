"""Which tensors hold vertex ids at the ends of edges, and the operations that read vertex rows at them or sum
into vertices by them (:mod:`.rows` follows such ids from a layer's graph: ``edge_index[0]``, ``row, col =
edge_index``; a read of rows at edge sources outside ``propagate``, or a scatter of values by them, is judged
there)."""
from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from .counts import as_value
from .row_rules import _REDUCE, _arg, _norm


class Ids:
    """The tensors holding vertex ids at edge ends that the row check follows (by identity, weakly), each with the
    ends it holds: ``"src"`` / ``"dst"``, a pair for an edge list, ``"own"`` for positions numbered from a count."""

    def __init__(self):
        self._by_id: Dict[int, Any] = {}

    def mark(self, t: Any, kind) -> None:
        if isinstance(t, Tensor):
            self._by_id[id(t)] = (weakref.ref(t), kind)

    def edges(self, g: Any, reverse: bool = False) -> None:
        """``g`` (a ``[2, E]`` edge list of the running layer) holds vertex ids: its sources, then destinations
        (``reverse``: the other way round, for a layer with ``flow="target_to_source"``)."""
        if isinstance(g, Tensor) and g.layout == torch.strided and g.dim() == 2 and g.size(0) == 2:
            self.mark(g, ("dst", "src") if reverse else ("src", "dst"))

    def kind(self, t: Any):
        """Which ends of edges ``t`` holds the vertex ids of (``None``: none)."""
        hit = self._by_id.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def has(self, t: Any) -> bool:
        return self.kind(t) is not None

    def follow(self, name: str, args, kwargs, out) -> bool:
        """Whether the operation's outputs hold vertex ids at edge ends (selected, joined, reshaped from such ids);
        if so they are followed as such."""
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        kinds = ids_kinds(name, args, kwargs, self.kind, len(outs))
        for o, kind in zip(outs, kinds or ()):
            self.mark(o, kind)
        return kinds is not None


#: operations whose output holds entries of their input (so vertex ids at edge ends stay vertex ids):
#: selections, joins and layout changes
_KEEPS_IDS = {"__getitem__", "select", "unbind", "narrow", "flip", "index_select", "masked_select", "cat", "concat",
              "stack", "view", "reshape", "contiguous", "clone", "to", "long", "int", "t", "T", "expand",
              "expand_as", "repeat", "repeat_interleave", "unsqueeze", "squeeze", "flatten", "view_as", "reshape_as",
              "chunk", "split", "detach", "sort", "unique", "broadcast_to", "take", "gather"}


#: which end of its edges a tensor of vertex ids holds: ``"src"`` (sources: the neighbours, outside the chunk's
#: rows), ``"dst"`` (destinations: the chunk's own rows), ``"own"`` (positions numbered from a vertex count: the
#: chunk's own rows, :mod:`.counts`), ``"any"`` (either, or not known); a graph's
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
        # (others joined: self loops, within the chunk's rows; positions joined to edges are the graph's)
        kinds = [k for k in kinds if k is not None and k != "own"] or ["own"]
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


def padded(args: tuple, t: Tensor, v: int, index: Tensor) -> tuple:
    """``args`` with ``t`` padded with zero rows along ``v`` up to the rows ``index`` reads (a refused read: the pass
    goes on to its end). A host synchronisation, on the checked pass only."""
    need = int(index.max()) + 1 if index.numel() else 0
    if need <= t.size(v):
        return args
    pad = t.new_zeros(*t.shape[:v], need - t.size(v), *t.shape[v + 1:])
    return tuple(torch.cat([t, pad], dim=v) if a is t else a for a in args)


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


#: sparse tensors built from indices (positional place of their ``size``): from vertex ids at edge ends, a graph built
#: inside forward; and the conversion of sorted row ids into CSR row pointers that builds one (``index2ptr``)
SPARSE = {"sparse_coo_tensor": 2, "_sparse_coo_tensor_unsafe": 2, "sparse_csr_tensor": 3, "sparse_csc_tensor": 3,
          "sparse_compressed_tensor": 3, "_sparse_csr_tensor_unsafe": 3, "_sparse_compressed_tensor_unsafe": 3,
          "_convert_indices_from_coo_to_csr": None}


def fitted(name: str, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    """The arguments of a refused sparse construction (:data:`SPARSE`) that keep it inside its memory while the pass
    goes on: a size counted on the chunk (``x.size(0)``) is smaller than the ids its edges hold (the halo's are
    numbered after its rows), and torch does not check the indices, so the tensor would reach past its end and
    what runs on it write outside it. Each sparse dimension is grown to hold its indices; row pointers are made from
    ids clamped to the count. (Host synchronisations, on the checked pass only.)"""
    at = SPARSE[name]
    if at is None:  # (row ids, count): ids beyond the count would write past the pointers' end
        size, ids = _arg(args, kwargs, 1, "size"), _arg(args, kwargs, 0, "input")
        if not (isinstance(size, int) and isinstance(ids, Tensor) and size > 0 and len(args) >= 2):
            return args, kwargs
        return (ids.clamp(0, size - 1), *args[1:]), kwargs
    size = _arg(args, kwargs, at, "size")
    if size is None:  # (torch takes it from the indices)
        return args, kwargs
    first = _arg(args, kwargs, 0, "indices", "crow_indices", "ccol_indices")
    second = _arg(args, kwargs, 1, "col_indices", "row_indices")
    size = list(size)
    if at == 2 and isinstance(first, Tensor) and first.numel():    # COO: [sparse dims, nnz]
        size[:first.size(0)] = [max(n, int(m) + 1) for n, m in zip(size, first.amax(1).tolist())]
    elif "cs" in name and isinstance(first, Tensor) and isinstance(second, Tensor):   # CSR / CSC: pointers, indices
        p, i = (0, 1) if "csr" in name else (1, 0)
        size[p], size[i] = first.numel() - 1, max(size[i], int(second.max()) + 1 if second.numel() else 0)
    if len(args) > at:
        return (*args[:at], tuple(size), *args[at + 1:]), kwargs
    return args, {**kwargs, "size": tuple(size)}


#: comparisons that vertex ids answer alike in any numbering (``edge_index[0] != edge_index[1]``: self loops; two
#: graphs compared with ``torch.equal``)
SAME = {"eq", "ne", "__eq__", "__ne__", "equal"}
#: conversions of ids to values
_FLOATS = {"float", "double", "half", "bfloat16"}


def as_values(name: str) -> bool:
    """Whether an operation on vertex ids at edge ends that neither selects, joins nor reshapes them uses them as
    values (``edge_index.max() + 1``, ``edge_index[0].float()``, ``row * num_nodes + col``): a chunk numbers its
    vertices from 0, its halo's after them, so their values are not the graph's."""
    return name not in SAME and (name in _FLOATS or name in _REDUCE or as_value(name))
