"""Route PyG's sparse-adjacency aggregation (``torch_geometric.utils.spmm``) to the fused kernels.

PyG layers that accept a sparse ``adj_t`` aggregate in ``message_and_aggregate`` with
``spmm(adj_t, x, reduce=self.aggr)`` (GCNConv, GCN2Conv, SAGEConv, GINConv, SGConv, APPNP, TAGConv,
GraphConv, ...). Every one of those modules binds the name with ``from torch_geometric.utils import
spmm``, so the function object lives on in each module's namespace. ``install()`` replaces that one
function object, wherever a loaded module holds it (found by identity in ``sys.modules``, including
``torch_geometric.utils`` itself, so modules imported later pick up the replacement too), by
``fused_spmm``; ``uninstall()`` puts the original back wherever the replacement is found.

Why this and not something else: the alternatives are editing the user's layers (excluded), hooking
``MessagePassing.propagate`` (would have to re-implement each layer's ``message_and_aggregate``, and
layers differ in what they do around ``spmm``), or patching ``torch.sparse.mm`` (far wider blast
radius: every caller in the process). Replacing the single function object that all layers call is
the narrowest seam: the layers' own code runs unchanged, the swap is idempotent and reversible, and
anything the kernels do not cover goes to PyG's original ``spmm`` unchanged.

``fused_spmm`` takes the kernel path only when all of these hold, else it calls the original:

- ``src`` is a 2-D ``torch.sparse_csr`` tensor, or a coalesced ``torch.sparse_coo`` tensor (its row
  indices are then sorted, so the CSR row pointer is one O(E) pass; uncoalesced COO goes to PyG);
- ``reduce`` is ``sum``/``add``, ``mean`` or ``max``; ``other`` is a 2-D float32/float64 tensor of
  the adjacency's dtype, on its device, with ``src.size(1) == other.size(0)``;
- a compiled kernel is loaded for that device (without one, PyG's ``torch.sparse.mm`` path is what the
  fallback would run anyway).

Values and gradients match PyG's path (``torch.sparse.mm``): the adjacency's values weight the
messages, ``mean`` divides by the row's stored-entry count, ``max`` takes the maximum of
``value * x`` and gives 0 for empty rows; gradients flow to ``other`` and, when the sparse adjacency
requires grad, to its values (through ``adj_t.values()``, so ``adj_t.grad`` is sparse with
``adj_t``'s layout, as with ``torch.sparse.mm``). Ties in ``max`` send the gradient to the first
maximal edge only. On CUDA the kernel also covers ``max``, which PyG's path refuses there.

Usage::

    import pyg_pipe.ops as ops
    ops.install()                 # process-wide, idempotent; ops.uninstall() reverts
    with ops.fused_kernels():     # or scoped
        out = GCNConv(16, 16)(x, adj_t)
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

import torch
from torch import Tensor

from pyg_pipe.ops.aggregate import _KERNEL_DTYPES, _REDUCE_ALIASES, csr_aggregate
from pyg_pipe.ops.build import _device_kind, _kernels

__all__ = ["fused_kernels", "fused_spmm", "install", "installed", "uninstall"]

_lock = threading.RLock()
_original = None  # PyG's spmm, remembered at the first install


def _pyg_spmm():
    from torch_geometric.utils import _spmm

    return _spmm.spmm


def _as_csr(src: Tensor):
    """(rowptr, col, value) of a CSR or coalesced COO adjacency, or None when not cheap/possible."""
    if src.dim() != 2 or src.dense_dim() != 0:
        return None
    if src.layout == torch.sparse_csr:
        return src.crow_indices(), src.col_indices(), src.values()
    if src.layout == torch.sparse_coo and src.is_coalesced():
        index = src.indices()
        rowptr = torch._convert_indices_from_coo_to_csr(index[0], src.size(0), out_int32=index.dtype == torch.int32)
        return rowptr, index[1], src.values()
    return None


def _supported(src, other, reduce) -> bool:
    return (isinstance(src, Tensor) and isinstance(other, Tensor) and reduce in _REDUCE_ALIASES
            and src.layout in (torch.sparse_csr, torch.sparse_coo) and other.dim() == 2
            and other.dtype in _KERNEL_DTYPES and src.dtype == other.dtype and src.device == other.device
            and src.dim() == 2 and src.size(1) == other.size(0)
            and _kernels(_device_kind(other)) is not None)


def _make_fused(original):
    @functools.wraps(original)
    def fused_spmm(src, other, reduce: str = "sum"):
        if torch.jit.is_scripting() or not _supported(src, other, reduce):
            return original(src, other, reduce)
        parts = _as_csr(src)
        if parts is None:
            return original(src, other, reduce)
        rowptr, col, value = parts
        return csr_aggregate(rowptr, col, other, value=value, reduce=reduce)

    fused_spmm.__doc__ = ("pyg_pipe fused-kernel replacement of torch_geometric.utils.spmm (see "
                          "pyg_pipe.ops.pyg); falls back to the original for anything it does not cover.\n\n"
                          + (original.__doc__ or ""))
    fused_spmm.__wrapped_original__ = original
    return fused_spmm


fused_spmm = None  # set at the first install


def _rebind(old, new) -> int:
    """Replace module-global bindings ``spmm is old`` by ``new`` in every loaded module."""
    count = 0
    for module in list(sys.modules.values()):
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for name in ("spmm",):
            if namespace.get(name) is old:
                namespace[name] = new
                count += 1
    return count


def install() -> None:
    """Route ``torch_geometric.utils.spmm`` to the fused kernels, in every loaded module.

    Idempotent (a second call only rebinds modules imported since). Call it once per process, e.g.
    in a strategy's setup; it does not build the kernels by itself (the first aggregation does).
    """
    global _original, fused_spmm
    with _lock:
        if _original is None:
            _original = _pyg_spmm()
            fused_spmm = _make_fused(_original)
        _rebind(_original, fused_spmm)


def uninstall() -> None:
    """Undo ``install()``: put PyG's own ``spmm`` back wherever the replacement is bound."""
    with _lock:
        if _original is not None:
            _rebind(fused_spmm, _original)


def installed() -> bool:
    """Whether ``torch_geometric.utils.spmm`` is currently the fused replacement."""
    import torch_geometric.utils as pyg_utils

    return fused_spmm is not None and pyg_utils.spmm is fused_spmm


@contextlib.contextmanager
def fused_kernels():
    """Context manager: ``install()`` on entry; on exit ``uninstall()`` unless it was installed before.

    Nests: only the outermost scope that did the installing removes it.
    """
    with _lock:
        was = installed()
        install()
    try:
        yield
    finally:
        with _lock:
            if not was:
                uninstall()
