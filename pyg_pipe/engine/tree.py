"""Nested values (tensors in tuples, lists and dicts) taken apart into their leaves and put back.

Tuples keep their class (a namedtuple, ``torch.return_types.max``, ``torch.Size``), lists and dicts
their order.

The stage link sends a value crossing a pipeline cut as its leaf tensors, with the structure told
once (:mod:`.runtime.link`); checkpoints move the pipeline state tensor by tensor
(:mod:`pyg_pipe.strategies.checkpoint`). The structure is small, picklable and comparable.
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Tuple

from torch import Tensor


def is_tensor(value: Any) -> bool:
    return isinstance(value, Tensor)


def flatten(value: Any, leaf: Callable[[Any], bool] = is_tensor) -> Tuple[List[Any], Any]:
    """``(leaves, structure)``: the values for which ``leaf`` holds, in order, and the rest of ``value``
    (dicts, lists and tuples walked into, any other value kept in the structure)."""
    leaves: List[Any] = []
    return leaves, _strip(value, leaf, leaves)


def _strip(v: Any, leaf: Callable[[Any], bool], leaves: List[Any]) -> Any:
    if isinstance(v, dict):
        return ("dict", tuple((k, _strip(x, leaf, leaves)) for k, x in v.items()))
    if type(v) in (list, tuple):
        return (type(v).__name__, tuple(_strip(x, leaf, leaves) for x in v))
    if isinstance(v, tuple):  # a namedtuple, torch.return_types.*, torch.Size: rebuilt as its class
        return ("tuple_of", (type(v), tuple(_strip(x, leaf, leaves) for x in v)))
    if leaf(v):
        leaves.append(v)
        return ("leaf", len(leaves) - 1)
    return ("value", v)


def unflatten(leaves: List[Any], structure: Any) -> Any:
    """The value :func:`flatten` took apart, with ``leaves`` in place of its leaves."""
    kind, body = structure
    if kind == "leaf":
        return leaves[body]
    if kind == "value":
        return body
    if kind == "dict":
        return {k: unflatten(leaves, s) for k, s in body}
    if kind == "tuple_of":
        cls, body = body
        parts = [unflatten(leaves, s) for s in body]
        return cls._make(parts) if hasattr(cls, "_make") else cls(parts)
    parts = [unflatten(leaves, s) for s in body]
    return tuple(parts) if kind == "tuple" else parts


def pack_rows(value: Any, rows: int) -> Tuple[Any, Any]:
    """A model's output as one ``[rows, k]`` tensor, and what :func:`unpack_rows` needs to rebuild it.

    One tensor stays as it is (``None``). A tuple, list, dict or namedtuple of tensors, each with ``rows``
    rows and all of one dtype (VGAE's ``(mu, logstd)``), becomes their rows side by side, every leaf
    flattened past dimension 0: the engine shares, and back-propagates through, one tensor whatever the
    model returns. Anything else is returned unchanged (the output check refuses it)."""
    import torch
    if isinstance(value, Tensor):
        return value, None
    leaves, structure = flatten(value)
    if not leaves or any(t.dim() == 0 or t.size(0) != rows for t in leaves) or len({t.dtype for t in leaves}) != 1:
        return value, None
    shapes = tuple(tuple(t.shape[1:]) for t in leaves)
    return torch.cat([t.reshape(rows, -1) for t in leaves], dim=1), (structure, shapes)


def unpack_rows(packed: Tensor, spec: Any) -> Any:
    """The value :func:`pack_rows` packed, rebuilt from ``packed`` (any row count) as views of it."""
    if spec is None:
        return packed
    structure, shapes = spec
    widths = [math.prod(s) for s in shapes]
    parts = packed.split(widths, dim=1)
    return unflatten([p.reshape(packed.size(0), *s) for p, s in zip(parts, shapes)], structure)
