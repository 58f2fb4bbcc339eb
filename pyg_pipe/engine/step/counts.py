"""The number of vertices read from a vertex tensor, and the positions made from it, for the row check (:mod:`.rows`).

With chunks or graph-parallel ways a process runs the forward on part of the vertices, so ``x.size(0)`` is the number
of rows it holds, and ``torch.arange(x.size(0))`` numbers those rows from 0 on every chunk, not by vertex. Used as
values they differ from one device, silently (measured 2026-11-28, 2 processes against one: a positional embedding
``x + self.pe(torch.arange(x.size(0)))`` off by 1.9 with graph parallelism and 4.1 with 4 chunks; sinusoidal
positions, ``torch.linspace(0, 1, x.size(0))``, ``torch.eye(x.size(0))``, ``x / x.size(0)``: 0.015 to 2.6; the same
in a custom layer's forward: 0.009 to 4.05; ``edge_index.size(1)`` as a number: 31 to 44).

So during the checked pass, outside the layers and in the user's code of a layer's ``forward`` (outside
``propagate``; PyG's own code builds self loops and negative samples from ``x.size(0)`` and is not judged):

* a size query along a tensor's vertex dimension (``x.size(0)``, ``x.size()``, ``x.shape[0]``, ``x.numel()``), or
  along the edges of the graph's edge list or edge tensors (``edge_index.size(1)``), returns a :class:`Count`: an
  ``int`` that stays a count through arithmetic (``x.size(0) - 1``, ``1 / x.size(0)``);
* a count used as a value by an elementwise operation (``x / x.size(0)``), made into a tensor
  (``torch.tensor(x.size(0))``, ``x.new_tensor(n)``) or given as a fill value (``torch.full((1,), n)``) is refused;
* a factory of constant or random values given a count as a size (``torch.ones(x.size(0))``) makes vertex rows
  along it, followed: reduced they are refused (``torch.ones(x.size(0)).sum()`` was off by 26 in graph parallelism);
* a tensor a factory numbers from a count (``arange``, ``linspace``, ``eye``, ``randperm``, ...) holds *positions*,
  followed as vertex ids of the chunk's own rows (:mod:`.id_rules`, kind ``"own"``): selected or reshaped they stay
  positions, joined to the graph's edges (``add_self_loops(edge_index, num_nodes=x.size(0))``) they are the graph's
  (judged as before); used any other way (an embedding read ``self.pe(positions)``, arithmetic, a read or scatter
  of rows at them) they are refused.

Counts used as sizes (``x.view(x.size(0), 2, -1)``, ``x.new_zeros(x.size(0), d)``) run as before. ``len(x)`` of vertex
rows is refused outside the layers (Python turns what ``__len__`` returns into a plain ``int``: not followed;
``x.size(0)`` is). Python makes a plain ``float`` of a count without asking it where a float is on the left of the
arithmetic (``1.0 / n``), in ``float(n)`` and in ``math`` functions: those are found in the code that read the count
(:mod:`.count_uses`), or, in a traced pipeline stage, at the step that did it."""
from __future__ import annotations

from typing import Any

import torch

from .row_rules import _norm
from .rowwise import _pointwise

#: size queries: along the vertex dimension they return a :class:`Count`
QUERIES = frozenset({"size", "__get__", "numel", "nelement"})
#: factories whose values are positions when given a count
POSITIONAL = frozenset({"arange", "range", "linspace", "logspace", "eye", "randperm", "tril_indices", "triu_indices"})
#: factories of constant or random values: given a count as a size, their output has a row per vertex along it
SIZED = frozenset({"ones", "zeros", "empty", "full", "rand", "randn", "randint", "normal", "new_ones", "new_zeros",
                   "new_empty", "new_full"})
#: what may be asked of positions without using them (their size, their device, ...)
_ASKED = frozenset({"size", "dim", "ndimension", "numel", "nelement", "__get__", "__len__", "__repr__", "__format__",
                    "is_floating_point", "stride", "is_contiguous", "get_device", "data_ptr", "element_size"})
_ARITHMETIC = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow")


def _counted(value: Any) -> Any:
    if isinstance(value, bool) or value is NotImplemented:
        return value
    if isinstance(value, int):
        return Count(value)
    return CountFloat(value) if isinstance(value, float) else value


def _lift(cls, base):
    """``cls``'s arithmetic returns counts (``n - 1``, ``1 / n``, ``n / 100.0`` stay counts; ``int``'s own answers
    a float operand with ``NotImplemented``, which would hand it to ``float``: computed as floats here)."""
    for op in _ARITHMETIC:
        for form in (f"__{op}__", f"__r{op}__"):
            if hasattr(base, form):
                setattr(cls, form, _arithmetic(getattr(base, form), getattr(float, form)))
    for form in ("__neg__", "__pos__", "__abs__"):
        setattr(cls, form, (lambda f: lambda self: _counted(f(self)))(getattr(base, form)))
    return cls


def _arithmetic(own, as_float):
    def op(self, *other):
        out = own(self, *other)
        if out is NotImplemented and other and type(other[0]) is float:
            out = as_float(float(self), *other)
        return _counted(out)
    return op


class Count(int):
    """An ``int`` read from the size of a vertex dimension during the checked pass (or computed from one)."""

    def __reduce__(self):  # (crosses processes as a plain int)
        return int, (int(self),)


class CountFloat(float):
    """A ``float`` computed from a :class:`Count`."""

    def __reduce__(self):
        return float, (float(self),)


_lift(Count, int)
_lift(CountFloat, float)


def count_of(name: str, args, out: Any, v: int) -> Any:
    """What a size query ``name`` on a tensor whose dimension ``v`` has one row per vertex returns, its vertex
    count a :class:`Count` (``out``: what it returned)."""
    if name in ("numel", "nelement"):
        return Count(out)
    if isinstance(out, torch.Size):
        return torch.Size([Count(n) if i == v else n for i, n in enumerate(out)]) if v < len(out) else out
    if name == "size" and isinstance(out, int) and len(args) > 1 and isinstance(args[1], int) and \
            _norm(args[1], args[0].dim()) == v:
        return Count(out)
    return out


def has_count(args, kwargs) -> bool:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (Count, CountFloat)):
            return True
        if isinstance(a, (tuple, list)) and any(isinstance(b, (Count, CountFloat)) for b in a):
            return True
    return False


def as_value(name: str, args=(), kwargs=None) -> bool:
    """Whether an operation given a count uses it as a value (elementwise arithmetic, a tensor made of it, a fill
    value) rather than as a size."""
    if name in _MADE_OF:
        return True
    if name in _FILLS:
        pos = _FILLS[name]
        fill = (kwargs or {}).get("fill_value", args[pos] if len(args) > pos else None)
        return isinstance(fill, (Count, CountFloat))
    return _pointwise(name) or (name.startswith("__") and name.strip("_").lstrip("ri") in _ARITHMETIC + ("div",))


#: tensors made of the values given (``torch.tensor(x.size(0))``: the count as a value, off by 31 – 47 with the graph
#: cut until 2026-11-28, silently)
_MADE_OF = frozenset({"tensor", "as_tensor", "asarray", "new_tensor", "scalar_tensor"})
#: factories and fills with a fill value: name -> its position
_FILLS = {"full": 1, "new_full": 2, "full_like": 1, "fill_": 1, "fill": 1, "masked_fill": 2, "masked_fill_": 2,
          "index_fill": 3, "index_fill_": 3}


def uses_positions(name: str) -> bool:
    """Whether an operation on positions that neither selects, joins nor reshapes them uses their values."""
    return name not in _ASKED


def counted_dim(args, kwargs, out: Any) -> Any:
    """The dimension of a factory's output ``out`` its size argument gives a count (``torch.ones(x.size(0), d)``: 0),
    else ``None``."""
    values = list(args) + list(kwargs.values())
    size = next((a for a in values if isinstance(a, (tuple, list)) and any(isinstance(b, Count) for b in a)), None)
    if size is None:  # (sizes as separate numbers)
        size = [a for a in values if isinstance(a, int) and not isinstance(a, bool)]
    d = next((i for i, n in enumerate(size) if isinstance(n, Count)), None)
    return d if isinstance(out, torch.Tensor) and d is not None and d < out.dim() else None
