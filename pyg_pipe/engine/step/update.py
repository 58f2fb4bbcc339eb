"""A layer's ``update`` under the engine: the node arguments it reads, as on one device.

In a call that computes the chunk's rows only, a source read at both ends of the edges (``x`` for ``x_i`` and
``x_j``) is handed to ``propagate`` as the pair ``(rows | halo, rows)``, as PyG passes bipartite inputs
(:mod:`.layers`). PyG hands ``update`` what ``propagate`` was given, so a layer whose ``update`` reads that argument
(``def update(self, aggr_out, x): return aggr_out + self.lin(x)``, the root term of many hand-written layers and of
PyG's tutorials) would receive the pair where one device gives it the tensor (refused with a ``TypeError`` until
2026-11-29). Such a layer's ``update`` is wrapped, once per module at install: each pair the engine made is handed
over as its second element, the chunk's rows, which are the rows ``aggr_out`` has (and what one device's ``x``
holds for them). A pair the model passed itself (a bipartite call) is handed over as it is."""
from __future__ import annotations

import functools
import inspect
from typing import List

from torch_geometric.nn import MessagePassing

from ..context import current


@functools.lru_cache(maxsize=None)
def reads_arguments(cls: type) -> bool:
    """Whether ``cls.update`` takes arguments besides the aggregation's output."""
    params = list(inspect.signature(cls.update).parameters.values())[2:]  # (self, inputs)
    return bool(params)


def install(module: MessagePassing) -> List[MessagePassing]:
    """Wraps ``module.update`` where it reads arguments of ``propagate`` (the modules patched: removed by deleting
    the instance attribute ``update``)."""
    if not reads_arguments(type(module)):
        return []
    own = type(module).update.__get__(module, type(module))

    @functools.wraps(own)
    def update(inputs, *args, **kwargs):
        ctx = current()
        pairs = ctx.stack[-1].pairs if ctx is not None and ctx.stack else None
        if pairs:
            kwargs = {k: _rows(pairs, v) for k, v in kwargs.items()}
            args = tuple(_rows(pairs, v) for v in args)
        return own(inputs, *args, **kwargs)

    module.update = update
    return [module]


def keep(inv, module: MessagePassing, pair: tuple, rows) -> None:
    """Notes a pair the engine made for ``module``'s propagate, ``(rows | halo, rows)``, where its ``update`` reads
    arguments (for the wrapper to hand over ``rows``); nothing for the other layers."""
    if reads_arguments(type(module)):
        inv.pairs[id(pair)] = (pair, rows)


def _rows(pairs: dict, value):
    hit = pairs.get(id(value))
    return hit[1] if hit is not None and hit[0] is value else value
