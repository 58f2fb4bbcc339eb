"""The transposed adjacencies the aggregation's backward runs on, cached per graph, with their edge weights.

The backward of ``csr_aggregate`` w.r.t. the sources (sum / mean) is the same row-loop kernel over the transposed
adjacency: the edges grouped by source (one counting sort), each edge's weight ``value[e]`` (``/ deg`` of its
destination for ``mean``) in that order. Both depend on the graph only (and the weights on ``value``), so a graph
used step after step pays them once: :func:`transposed` and :func:`coefficients` keep them, least recently used
out first, bounded by count and bytes; :func:`forget` drops a graph's entries, :func:`clear_cache` all of them.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict

import torch
from torch import Tensor

_cache_lock = threading.Lock()


# Bounded by count and by bytes (the transposes and the index tensors they keep alive): a caller that
# builds a new adjacency every step must not pile up dead graphs. The newest entry always stays.
_SIZE = 64
_BYTES = int(os.environ.get("PYG_PIPE_TRANSPOSE_CACHE_MB", "512")) * 2**20
_cache: OrderedDict[tuple, list] = OrderedDict()


def clear_cache() -> None:
    """Forget the cached transposed adjacencies (they are rebuilt on the next backward)."""
    with _cache_lock:
        _cache.clear()


def held() -> list:
    """Every tensor the cache holds now (transposes, the graphs they came from, edge weights and the values those
    came from): what a CUDA graph captured now may read at its address, to keep alive as long as the graph is
    (an entry evicted or a weights' slot replaced later would otherwise free memory a replay still reads)."""
    with _cache_lock:
        return [t for entry in _cache.values() for t in entry[:5] + list(entry[5] or ()) if isinstance(t, Tensor)]


def forget(*roots) -> None:
    """Drops the cached transposes of the CSR adjacencies found in ``roots`` (tensors, or dicts, lists and tuples
    holding them): graphs their owner is about to let go of, whose entries would keep them alive."""
    held, stack = set(), list(roots)
    while stack:
        obj = stack.pop()
        if isinstance(obj, Tensor):
            if obj.layout == torch.sparse_csr:
                held.add((obj.crow_indices().data_ptr(), obj.col_indices().data_ptr()))
        elif isinstance(obj, dict):
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack += list(obj)
    with _cache_lock:
        for key in [k for k in _cache if (k[1], k[4]) in held]:
            del _cache[key]


def _key(rowptr: Tensor, col: Tensor, n_src: int) -> tuple:
    return rowptr.device, rowptr.data_ptr(), rowptr.numel(), rowptr._version, col.data_ptr(), col.numel(), \
        col._version, n_src


def _entry_bytes(entry: list) -> int:
    kept = [t for t in entry[5][::2] if t is not None] if entry[5] is not None else []   # (the value, its weights)
    return sum(t.numel() * t.element_size() for t in entry[:5] + kept)


def transposed(rowptr: Tensor, col: Tensor, n_src: int, module) -> tuple:
    """``(tptr, trow, tedge)``: the edges rowptr[0]..rowptr[-1] grouped by source.

    ``tptr`` [n_src+1] offsets into ``trow`` (local destination row) and ``tedge`` (edge id into
    ``col``/``value``). Cached by the identity of the index tensors' memory (address, length, version
    counter); the entry keeps ``rowptr`` and ``col`` alive, so an address cannot be reused by another
    graph while it is cached, and an in-place change bumps the version and misses. A fixed graph thus
    pays the transposition (one counting sort) once, and each of a graph's chunks once. At most 64
    entries and ``PYG_PIPE_TRANSPOSE_CACHE_MB`` (default 512) MiB are kept, least recently used first
    out; ``clear_cache()`` empties it.
    """
    key = _key(rowptr, col, n_src)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit[2:5]
    if module is not None and rowptr.device.type == "cpu":
        tptr, trow, tedge = module.transpose(rowptr, col, n_src)
    else:
        rows = rowptr.numel() - 1
        base = int(rowptr[0])
        deg = rowptr[1:] - rowptr[:-1]
        c = col[base:base + int(rowptr[-1]) - base].long()
        if c.numel() and (int(c.min()) < 0 or int(c.max()) >= n_src):
            raise IndexError(f"csr_aggregate: a source id in col is outside [0, {n_src})")
        perm = torch.argsort(c, stable=True)
        row_of_edge = torch.repeat_interleave(torch.arange(rows, device=col.device), deg.long())
        trow = row_of_edge[perm].to(rowptr.dtype)
        tedge = (perm + base).to(rowptr.dtype)
        counts = torch.bincount(c, minlength=n_src)
        tptr = torch.zeros(n_src + 1, dtype=rowptr.dtype, device=col.device)
        tptr[1:] = torch.cumsum(counts, 0)
    with _cache_lock:
        _cache[key] = [rowptr, col, tptr, trow, tedge, None]   # (the last: coefficients')
        total = sum(_entry_bytes(e) for e in _cache.values())
        while len(_cache) > 1 and (len(_cache) > _SIZE or total > _BYTES):
            total -= _entry_bytes(_cache.popitem(last=False)[1])
    return tptr, trow, tedge


def coefficients(rowptr: Tensor, col: Tensor, n_src: int, module, value, reduce: str, dtype) -> tuple:
    """``(tptr, trow, coef)``: :func:`transposed` and the transposed edges' weights for the backward w.r.t. the
    sources, ``value[tedge]`` (``× 1/deg`` of the row for ``mean``; ``None``: ones), kept with the transpose for the
    ``value`` they came from: weights that stay the same step after step (a cached ``gcn_norm``, the engine's per
    chunk) are gathered once, not in every backward (an ``|E|``-row gather, a kernel on a GPU). The entry holds
    ``value``, so no other tensor can take its memory: the same address, shape, strides and version counter then
    mean the same weights (the Python object may differ per call, as ``adj_t.storage.value()`` makes it)."""
    tptr, trow, tedge = transposed(rowptr, col, n_src, module)
    if value is None and reduce != "mean":
        return tptr, trow, None
    key = _key(rowptr, col, n_src)
    want = (reduce, dtype) if value is None else \
        (reduce, dtype, value.data_ptr(), value.shape, value.stride(), value.dtype, value._version)
    with _cache_lock:
        entry = _cache.get(key)
        slot = entry[5] if entry is not None else None
        if slot is not None and slot[1] == want:
            return tptr, trow, slot[2]
    coef = value[tedge.long()] if value is not None else None
    if reduce == "mean":
        inv_deg = inv_degree(rowptr, dtype)[trow.long()]
        coef = inv_deg if coef is None else coef * inv_deg
    coef = coef.contiguous()
    with _cache_lock:
        if entry is not None and _cache.get(key) is entry:
            entry[5] = (value, want, coef)
    return tptr, trow, coef


def inv_degree(rowptr: Tensor, dtype) -> Tensor:
    deg = (rowptr[1:] - rowptr[:-1]).to(dtype)
    return 1.0 / deg.clamp(min=1)
