"""Nested values (tensors in tuples, lists and dicts) taken apart into their leaves and put back.

Tuples keep their class (a namedtuple, ``torch.return_types.max``, ``torch.Size``), lists and dicts
their order.

The stage link sends a value crossing a pipeline cut as its leaf tensors, with the structure told
once (:mod:`.runtime.link`); checkpoints move the pipeline state tensor by tensor
(:mod:`pyg_pipe.strategies.checkpoint`). The structure is small, picklable and comparable.
"""
from __future__ import annotations

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
