"""Fused CSR gather-aggregate: the compiled kernels and the fallbacks behind one call.

``csr_aggregate(rowptr, col, x, value, reduce)`` computes, for every destination row ``i`` of a CSR
adjacency (rows = destinations, ``col`` = global source ids into ``x``)::

    out[i] = REDUCE_{e = rowptr[i] .. rowptr[i+1]-1}  value[e] * x[col[e]]        (value[e] = 1 without values)

with REDUCE one of ``sum``, ``mean`` (the sum divided by the row's edge count) and ``max``; rows without
edges give 0, as PyG's ``scatter`` and ``torch.sparse.mm`` do. It is differentiable w.r.t. ``x`` and
``value``. The compiled kernels never build the ``[E, d]`` message tensor that PyG's default path
(``x[src]`` then scatter) does: each output row is accumulated in registers.

Backends, tried in this order for the device of ``x`` (``backend()`` says which one is used):

====================  ==============================================================================
``"cpp"``             ``extensions/csr_aggregate.cpp`` (OpenMP), JIT-built on first use
``"cuda"``            ``extensions/csr_aggregate_cuda.cu``, built only where CUDA and nvcc exist
``"torch_sparse"``    ``torch_sparse.matmul`` when the optional torch-sparse package is installed
``"torch"``           ``torch.sparse.mm`` on a CSR tensor (``max`` on CUDA: index_select + scatter)
====================  ==============================================================================

How the kernels are built, loaded and fallen back from is :mod:`.build`.

Backward: ``sum``/``mean`` w.r.t. ``x`` run the same row-loop kernel over the transposed adjacency
(counting sort, cached per graph: :mod:`.transpose`), so no atomics and a deterministic result on both
CPU and CUDA; w.r.t. ``value`` a per-edge dot product ``<grad_out[i], x[col[e]]>`` (divided by the
degree for ``mean``); ``max`` routes the gradient through the arg-max edge recorded in the forward
(on CUDA with atomic adds, so that one is not deterministic).

``csr_gated_aggregate(rowptr, col, a, b, c, reduce)`` is the gated Gather of NGra's G-GCN (PyG's
``ResGatedGraphConv``), ``out[i] = REDUCE_e sigmoid(a[i] + b[col[e]]) * c[col[e]]`` (sum or mean): the
compiled kernels keep the per-edge, per-feature gate in registers and recompute it in the backward, so
neither pass stores anything of size ``[E, d]``; without them it runs the same formula on edge lists.

Usage::

    from pyg_pipe.ops import csr_aggregate
    out = csr_aggregate(rowptr, col, x, value=None, reduce="mean")          # all rows
    out = csr_aggregate(rowptr, col, x, reduce="sum", row_start=a, row_end=b)  # rows a..b-1 only
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import build
from .transpose import clear_cache, coefficients, inv_degree, transposed

__all__ = ["clear_cache", "csr_aggregate", "csr_gated_aggregate"]

_REDUCE_CODE = {"sum": 0, "mean": 1, "max": 2}
_REDUCE_ALIASES = {"add": "sum", "sum": "sum", "mean": "mean", "max": "max", "amax": "max"}
_KERNEL_DTYPES = (torch.float32, torch.float64)

# --------------------------------------------------------------------------------------------
# autograd around the compiled kernels
# --------------------------------------------------------------------------------------------


class _CompiledAggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rowptr, col, value, x, reduce, module):
        code = _REDUCE_CODE[reduce]
        result = module.forward(rowptr, col, value, x, code)
        out = result[0]
        arg = result[1] if reduce == "max" else None
        ctx.reduce, ctx.module, ctx.n_src = reduce, module, x.size(0)
        ctx.has_value = value is not None
        # the sources are read again only by the max's backward and by the edge values' gradient: a sum
        # or mean over constant weights does not keep them alive (in a chunk they are the joined copy
        # ``[rows | halo]``, a layer's largest kept tensor otherwise)
        keep_x = reduce == "max" or (value is not None and ctx.needs_input_grad[2])
        ctx.save_for_backward(rowptr, col, value, x if keep_x else None, arg)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        rowptr, col, value, x, arg = ctx.saved_tensors
        module, reduce = ctx.module, ctx.reduce
        need_value = ctx.has_value and ctx.needs_input_grad[2]
        need_x = ctx.needs_input_grad[3]
        g = grad_out.contiguous()
        grad_x = grad_value_part = None
        if reduce == "max":
            grad_x, grad_value_part = module.max_backward(rowptr, col, value, x, g, arg, ctx.n_src,
                                                          need_x, need_value)
        else:
            inv_deg = inv_degree(rowptr, g.dtype) if reduce == "mean" else None
            if need_x:
                tptr, trow, coef = coefficients(rowptr, col, ctx.n_src, module, value, reduce, g.dtype)
                grad_x = module.forward(tptr, trow, coef, g, 0)[0]
            if need_value:
                grad_value_part = module.edge_dot(rowptr, col, x, g)
                if inv_deg is not None:
                    deg = (rowptr[1:] - rowptr[:-1]).long()
                    grad_value_part = grad_value_part * torch.repeat_interleave(inv_deg, deg)
        grad_value = None
        if need_value:  # reads the row range's edge span on the host: a sync on CUDA, only for edge values
            base, end = int(rowptr[0]), int(rowptr[-1])
            if base == 0 and end == value.numel():
                grad_value = grad_value_part
            else:
                grad_value = torch.zeros_like(value)
                grad_value[base:end] = grad_value_part
        return None, None, grad_value, grad_x, None, None


# --------------------------------------------------------------------------------------------
# fallbacks
# --------------------------------------------------------------------------------------------


def _slice_edges(rowptr: Tensor, col: Tensor, value: Tensor | None):
    """Rebase a row-range slice to a self-contained CSR: (rowptr from 0, col, value) of its edges."""
    base, end = int(rowptr[0]), int(rowptr[-1])
    rp = rowptr - base if base else rowptr
    c = col[base:end] if (base or end != col.numel()) else col
    v = value[base:end] if value is not None and (base or end != value.numel()) else value
    return rp, c, v


def _torch_aggregate(rowptr: Tensor, col: Tensor, value: Tensor | None, x: Tensor, reduce: str) -> Tensor:
    rp, c, v = _slice_edges(rowptr, col, value)
    rows, n_src = rp.numel() - 1, x.size(0)
    # torch.sparse.mm's gradient w.r.t. the values mishandles duplicate entries (it returns one per
    # distinct (row, col)), so a differentiable ``value`` takes the edge-list path.
    sparse_ok = v is None or not v.requires_grad
    cpu_ok = x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES
    if sparse_ok and (cpu_ok or (x.device.type == "cuda" and reduce != "max")):
        rp64, c64 = rp.long(), c.long()
        w = v if v is not None else torch.ones(c.numel(), dtype=x.dtype, device=x.device)
        adj = torch.sparse_csr_tensor(rp64, c64, w, (rows, n_src), check_invariants=False)
        if x.device.type == "cpu":
            return torch.sparse.mm(adj, x, {"sum": "sum", "mean": "mean", "max": "amax"}[reduce])
        out = torch.sparse.mm(adj, x)
        if reduce == "mean":
            out = out * inv_degree(rp, out.dtype).unsqueeze(1)
        return out
    # generic edge-list path (max on CUDA, half precision): builds the [E, d] messages
    deg = (rp[1:] - rp[:-1]).long()
    dst = torch.repeat_interleave(torch.arange(rows, device=x.device), deg)
    msg = x.index_select(0, c.long())
    if v is not None:
        msg = msg * v.unsqueeze(1)
    out = x.new_zeros(rows, x.size(1))
    red = {"sum": "sum", "mean": "mean", "max": "amax"}[reduce]
    return out.scatter_reduce(0, dst.unsqueeze(1).expand_as(msg), msg, red, include_self=False)


def _torch_sparse_aggregate(rowptr, col, value, x, reduce):
    import torch_sparse

    rp, c, v = _slice_edges(rowptr, col, value)
    adj = torch_sparse.SparseTensor(rowptr=rp.long(), col=c.long(), value=v,
                                    sparse_sizes=(rp.numel() - 1, x.size(0)), is_sorted=True,
                                    trust_data=True)
    return torch_sparse.matmul(adj, x, reduce=reduce)


# --------------------------------------------------------------------------------------------
# the public call
# --------------------------------------------------------------------------------------------


def csr_aggregate(rowptr: Tensor, col: Tensor, x: Tensor, value: Tensor | None = None,
                  reduce: str = "sum", row_start: int = 0, row_end: int | None = None) -> Tensor:
    """Aggregate source rows of ``x`` into destination rows over a CSR adjacency, fused.

    Args:
        rowptr: [N_dst + 1] int32/int64 row offsets into ``col`` (rows are destinations). Offsets are
            absolute: a slice of a bigger CSR's rowptr (not starting at 0) works as is.
        col: [E] source ids (same dtype as ``rowptr``), global row numbers of ``x``.
        x: [N_src, d] source features (float32/float64 use the compiled kernels; other float
            dtypes the fallback). For the chunk case ``x`` is the full-graph buffer.
        value: optional [E] per-edge weights (multiplied into the messages; cast to ``x.dtype``).
        reduce: ``"sum"`` (alias ``"add"``), ``"mean"`` or ``"max"`` (alias ``"amax"``). Empty rows give 0.
        row_start, row_end: compute only destination rows ``row_start .. row_end - 1`` (default: all).

    Returns:
        [row_end - row_start, d] tensor; differentiable w.r.t. ``x`` and ``value``.
    """
    reduce_name = _REDUCE_ALIASES.get(reduce)
    if reduce_name is None:
        raise ValueError(f"csr_aggregate: `reduce` must be one of 'sum', 'mean', 'max' (or 'add', 'amax'), "
                         f"got {reduce!r}")
    if x.dim() != 2:
        raise ValueError(f"csr_aggregate: `x` must be 2-D [N_src, d], got shape {tuple(x.shape)}")
    if rowptr.dim() != 1 or col.dim() != 1 or rowptr.numel() < 1:
        raise ValueError("csr_aggregate: `rowptr` ([N_dst + 1]) and `col` ([E]) must be 1-D")
    n_dst = rowptr.numel() - 1
    row_end = n_dst if row_end is None else row_end
    if not 0 <= row_start <= row_end <= n_dst:
        raise ValueError(f"csr_aggregate: need 0 <= row_start ({row_start}) <= row_end ({row_end}) <= "
                         f"number of rows ({n_dst})")
    if row_start or row_end != n_dst:
        rowptr = rowptr[row_start:row_end + 1]
    if rowptr.dtype != col.dtype or rowptr.dtype not in (torch.int32, torch.int64):
        rowptr, col = rowptr.long(), col.long()
    if value is not None:
        if value.dim() != 1 or value.numel() != col.numel():
            raise ValueError(f"csr_aggregate: `value` must be 1-D like `col` ({col.numel()} entries), got "
                             f"shape {tuple(value.shape)}")
        if value.dtype != x.dtype:
            value = value.to(x.dtype)

    kind = build._device_kind(x)
    module = build._kernels(kind) if x.dtype in _KERNEL_DTYPES else None
    if module is not None:
        return _CompiledAggregate.apply(rowptr.contiguous(), col.contiguous(),
                                        value.contiguous() if value is not None else None,
                                        x.contiguous(), reduce_name, module)
    if build._torch_sparse() is not None:
        return _torch_sparse_aggregate(rowptr, col, value, x, reduce_name)
    return _torch_aggregate(rowptr, col, value, x, reduce_name)


# --------------------------------------------------------------------------------------------
# the gated Gather (G-GCN)
# --------------------------------------------------------------------------------------------


class _CompiledGated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rowptr, col, a, b, c, mean, module):
        ctx.module, ctx.mean = module, mean
        ctx.save_for_backward(rowptr, col, a, b, c)
        return module.gated_forward(rowptr, col, a, b, c, mean)

    @staticmethod
    def backward(ctx, grad_out):
        rowptr, col, a, b, c = ctx.saved_tensors
        module = ctx.module
        g = grad_out
        if ctx.mean:
            g = g * inv_degree(rowptr, g.dtype).unsqueeze(1)
        need_a, need_bc = ctx.needs_input_grad[2], ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        tptr, trow, _ = transposed(rowptr, col, b.size(0), module) if need_bc else (rowptr, col, None)
        ga, gb, gc = module.gated_backward(rowptr, col, tptr, trow, a, b, c, g.contiguous(), need_a, need_bc)
        return (None, None, ga if need_a else None, gb if ctx.needs_input_grad[3] else None,
                gc if ctx.needs_input_grad[4] else None, None, None)


def _torch_gated(rowptr: Tensor, col: Tensor, a: Tensor, b: Tensor, c: Tensor, mean: bool) -> Tensor:
    """The same formula on edge lists (builds ``[E, d]`` tensors, as PyG's path does)."""
    rp, cc, _ = _slice_edges(rowptr, col, None)
    rows = rp.numel() - 1
    dst = torch.repeat_interleave(torch.arange(rows, device=c.device), (rp[1:] - rp[:-1]).long())
    src = cc.long()
    msg = torch.sigmoid(a.index_select(0, dst) + b.index_select(0, src)) * c.index_select(0, src)
    out = c.new_zeros(rows, c.size(1)).index_add_(0, dst, msg)
    return out * inv_degree(rp, out.dtype).unsqueeze(1) if mean else out


def csr_gated_aggregate(rowptr: Tensor, col: Tensor, a: Tensor, b: Tensor, c: Tensor, reduce: str = "sum") -> Tensor:
    """The gated Gather: ``out[i] = REDUCE_{e in row i} sigmoid(a[i] + b[col[e]]) * c[col[e]]``.

    Args:
        rowptr: [R + 1] offsets into ``col`` (rows are destinations; absolute, as for :func:`csr_aggregate`).
        col: [E] source ids into ``b`` and ``c``.
        a: [R, d] destination terms of the gate; b: [N_src, d] source terms; c: [N_src, d] source values.
        reduce: ``"sum"`` (``"add"``) or ``"mean"``; rows without edges give 0.

    Returns:
        [R, d], differentiable w.r.t. ``a``, ``b`` and ``c``. float32/float64 on a device with compiled
        kernels never build an ``[E, d]`` tensor, forward or backward; anything else takes the edge-list path.
    """
    name = _REDUCE_ALIASES.get(reduce)
    if name not in ("sum", "mean"):
        raise ValueError(f"csr_gated_aggregate: `reduce` must be 'sum' or 'mean', got {reduce!r}")
    if rowptr.dtype != col.dtype or rowptr.dtype not in (torch.int32, torch.int64):
        rowptr, col = rowptr.long(), col.long()
    kind = build._device_kind(c)
    module = build._kernels(kind) if c.dtype in _KERNEL_DTYPES and a.dtype == b.dtype == c.dtype else None
    if module is not None and hasattr(module, "gated_forward"):
        return _CompiledGated.apply(rowptr.contiguous(), col.contiguous(), a.contiguous(), b.contiguous(),
                                    c.contiguous(), name == "mean", module)
    return _torch_gated(rowptr, col, a, b, c, name == "mean")
