"""``cached=True`` layers (``GCNConv(cached=True)``, ``SGConv``, ...) on chunks: one cache per chunk.

A layer that caches its normalised graph keeps it in ``_cached*`` attributes, computed for the graph of its
first call. On chunks each (layer, chunked graph, chunk) gets an entry of its own in the runtime's layer
cache, keyed ``(id(layer), id(chunked graph), chunk)``: before a call on a chunk the layer's attributes are
swapped for that chunk's entry (:func:`swap_cache`; the layer's own are put back after the call), and what
the call cached is stored back (:func:`store_cache`). Streaming runs a chunk's layers several times a step
(barrier passes, replays); each run reads the entries as the step found them (:func:`by_chunk`,
:class:`CacheView`), as one device's step would.
"""
from __future__ import annotations

import weakref
from typing import Dict

from ..context import ChunkContext, Invocation


def _key(module, inv: Invocation) -> tuple:
    return id(module), id(inv.cg), inv.lg.index


def _is_entry(key) -> bool:
    """Whether ``key`` of the layer cache is a ``cached=True`` layer's entry (:func:`_key`)."""
    return isinstance(key, tuple) and len(key) == 3 and isinstance(key[0], int)


def swap_cache(ctx: ChunkContext, inv: Invocation, module) -> None:
    """``cached=True`` layers get one cache per chunk local graph (their own cache is put back after)."""
    if not getattr(module, "cached", False):
        return
    mine = ctx.cache.get(_key(module, inv), {})
    for attr in _cache_attrs(module):
        inv.restore.setdefault(attr, getattr(module, attr))
        setattr(module, attr, mine.get(attr))


def store_cache(ctx: ChunkContext, inv: Invocation, module) -> None:
    """What a ``cached=True`` layer cached on the chunk, kept as the chunk's entry."""
    if getattr(module, "cached", False):
        ctx.cache[_key(module, inv)] = {k: getattr(module, k) for k in _cache_attrs(module)}


_CACHE_ATTRS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _cache_attrs(module) -> tuple:
    """The ``_cached*`` attributes of a ``cached=True`` layer (PyG's ``_cached_edge_index``, ...), looked up
    once per layer and again only when its attributes change in number."""
    n = len(vars(module))
    hit = _CACHE_ATTRS.get(module)
    if hit is None or hit[0] != n:
        hit = _CACHE_ATTRS[module] = (n, tuple(k for k in vars(module) if k.startswith("_cached")))
    return hit[1]


def by_chunk(layer_cache: dict) -> Dict[int, dict]:
    """The ``cached=True`` layers' entries of the layer cache, per chunk, as they are now (one pass). A layer
    writes its entry for chunk ``c`` only while it runs on ``c``, so this snapshot at the start of the step
    is what each (group, chunk) found at its own first run (a layer called in two groups finds no entry of
    this step's first group in the second: it computes the same normalisation once more)."""
    out: Dict[int, dict] = {}
    for k, v in layer_cache.items():
        if _is_entry(k):
            out.setdefault(k[2], {})[k] = v
    return out


class CacheView(dict):
    """The layer cache as a run of chunk ``c`` sees it: ``cached=True`` layers read what they held before the
    step's first run of this chunk and group (the barrier passes and the replays compute what that run
    computed, as one device's step would), and write to the cache itself."""

    def __init__(self, real: dict, before: dict, c: int):
        super().__init__()
        self.real, self.before, self.c = real, before, c

    def get(self, key, default=None):
        if _is_entry(key) and key[2] == self.c:
            return self.before.get(key, default)
        return self.real.get(key, default)

    def __setitem__(self, key, value):
        self.real[key] = value
