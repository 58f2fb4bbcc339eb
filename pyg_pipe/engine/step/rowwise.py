"""Operations known to keep the rows of different vertices apart, for the row check (:mod:`.rows`).

The row check judges every operation the forward runs on tensors with one row per vertex. Those that can
combine rows have rules (:mod:`.row_rules`: reductions, contractions, scatters, positional reads, windows,
recurrences over a dimension). Everything else must be known to work row by row, or it is refused: an
operation the check did not know used to pass as row-wise, and 30 such operations over the vertex dimension
(``torch.cdist(x, x)``, ``torch.linalg.svd``, ``F.conv1d`` along the vertices, ``x.flatten().sum()``, ...)
then ran silently wrong with chunks or graph-parallel ways (found 2026-11-28).

Known row-wise:

* every ATen operation tagged ``pointwise`` (``add``, ``relu``, ``where``, ``masked_fill``, ...; the method,
  in-place and operator forms: ``x.add_``, ``x + y``, ``-x``);
* the per-row functionals and activations ATen does not tag (``linear`` is a rule: it contracts the last
  dimension), dropout, layout changes (followed by :func:`.row_layout.moved`), queries (``size``, ``dim``,
  ``shape``) and tensors made like another (``zeros_like``, ``x.new_zeros``);
* operations a user declares row-wise (:func:`declare_row_wise`), on every process alike.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .row_rules import JUDGED, mixes

#: per-row functionals and activations without ATen's pointwise tag, dropout, layout changes, queries, factories
_ROWWISE = frozenset({
    # operators (their ATen forms are tagged; the Python names are not ATen's)
    *(f"__{op}__" for op in ("add", "radd", "iadd", "sub", "rsub", "isub", "mul", "rmul", "imul", "truediv",
                             "rtruediv", "itruediv", "div", "rdiv", "floordiv", "rfloordiv", "ifloordiv", "mod",
                             "rmod", "pow", "rpow", "ipow", "neg", "pos", "abs", "invert", "and", "rand", "iand",
                             "or", "ror", "ior", "xor", "rxor", "ixor", "lshift", "rshift", "eq", "ne", "lt", "le",
                             "gt", "ge", "float", "int", "bool", "index", "format", "repr", "hash", "len",
                             "deepcopy", "reduce_ex", "setstate")),
    # activations and per-element functionals ATen does not tag
    "prelu", "hardswish", "hardsigmoid", "log_sigmoid", "logsigmoid", "softsign", "tanhshrink", "softshrink",
    "hardshrink", "silu", "mish", "gelu", "elu", "selu", "celu", "relu6", "rrelu", "leaky_relu", "softplus",
    "threshold", "hardtanh", "floor_divide", "true_divide", "clip", "clip_", "nan_to_num",
    "bernoulli", "bernoulli_", "dropout", "dropout_", "alpha_dropout", "feature_alpha_dropout", "dropout1d",
    "dropout2d", "dropout3d", "native_dropout", "real", "imag", "conj", "view_as_real", "view_as_complex",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",  # (a batch of rows: one step each)
    # layout changes (where the vertex dimension goes: row_rules.moved)
    "view", "reshape", "flatten", "unflatten", "ravel", "view_as", "reshape_as", "permute", "transpose", "swapaxes",
    "swapdims", "t", "T", "mT", "H", "mH", "movedim", "moveaxis", "unsqueeze", "squeeze", "expand", "expand_as",
    "broadcast_to", "broadcast_tensors", "contiguous", "clone", "detach", "detach_", "to", "type", "type_as",
    "float", "double", "half", "bfloat16", "long", "int", "bool", "short", "byte", "char", "cpu", "cuda",
    "requires_grad_", "retain_grad", "register_hook", "cat", "concat", "concatenate", "stack", "hstack", "vstack",
    "column_stack", "repeat", "tile", "repeat_interleave", "atleast_1d", "atleast_2d", "atleast_3d", "copy_",
    "fill_", "zero_", "masked_fill", "masked_fill_", "where",
    # queries, and tensors made like another
    "size", "dim", "ndimension", "numel", "nelement", "__get__", "is_floating_point", "is_complex", "element_size",
    "data_ptr", "storage_offset", "stride", "is_contiguous", "get_device", "is_pinned", "untyped_storage",
    "_is_view", "is_nonzero", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
    "randint_like", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "result_type", "can_cast",
    "promote_types", "is_same_size", "_has_compatible_shallow_copy_type", "_make_subclass",
})

_declared: set = set()


def declare_row_wise(*names: str) -> None:
    """Tells the row check that the operations ``names`` (as ``torch.overrides`` names them: ``"my_op"`` for
    ``torch.ops.mylib.my_op`` or a function with ``__torch_function__`` handling) keep the rows of different
    vertices apart along every dimension that has one row per vertex. Declare them where every process runs it
    (the training script's top level), so that every rank decides alike."""
    _declared.update(names)


@functools.lru_cache(maxsize=None)
def _pointwise(name: str) -> bool:
    """Whether ATen tags the operation (or its out-of-place form) ``pointwise``."""
    base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    op = getattr(torch.ops.aten, base, None)
    try:
        return op is not None and any(torch.Tag.pointwise in getattr(op, o).tags for o in op.overloads())
    except (AttributeError, RuntimeError):
        return False


def row_wise(name: str) -> bool:
    """Whether the operation ``name`` is known to keep vertex rows apart (module docstring)."""
    return name in _ROWWISE or name in _declared or _pointwise(name)


#: what the row check says of an operation neither known row-wise nor judged by a rule
UNKNOWN = "the row check does not know"


def judge(name: str, args, kwargs, aligned) -> Optional[str]:
    """How the operation combines the vertex rows ``aligned`` (``[(tensor, vertex dim)]``): a rule's verdict
    (:func:`.row_rules.mixes`), else ``None`` for an operation known row-wise, else that it is unknown."""
    what = mixes(name, args, kwargs, aligned)
    if what is None and name not in JUDGED and not row_wise(name):
        return UNKNOWN + " (it cannot tell whether it combines {rows})"
    return what

