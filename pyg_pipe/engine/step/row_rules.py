"""Which operations combine the rows of different vertices (:mod:`.rows` follows the tensors with a row per
vertex; these rules judge each operation on them): reductions and scans over the vertex dimension, contractions
over it, scatters and gathers along it, indexing by position, and how an operation moves that dimension."""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch_geometric.nn import MessagePassing

#: reductions and scans over a dimension: name -> (position of the ``dim`` argument, default dim;
#: ``None``: all dimensions)
_REDUCE: Dict[str, Tuple[int, Optional[int]]] = {
    **{n: (1, None) for n in ("sum", "nansum", "mean", "nanmean", "prod", "amax", "amin", "aminmax", "max", "min",
                              "argmax", "argmin", "median", "nanmedian", "logsumexp", "count_nonzero", "std", "var",
                              "std_mean", "var_mean", "unique", "unique_consecutive")},
    **{n: (1, -1) for n in ("softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax", "cummin",
                            "logcumsumexp", "sort", "argsort", "mode", "msort")},
    **{n: (2, -1) for n in ("topk", "kthvalue")},
    **{n: (2, None) for n in ("norm", "quantile", "nanquantile", "linalg_norm", "linalg_vector_norm")},
    **{n: (1, None) for n in ("all", "any")},
    **{n: (9, None) for n in ("allclose", "equal", "dist", "histc", "histogram", "bincount", "masked_select", "cov",
                              "corrcoef", "kron")},  # (9: no positional dim; cov, corrcoef, kron: any layout)
    **{n: (9, -1) for n in ("trapezoid", "trapz", "cumulative_trapezoid")},
    **{n: (2, -1) for n in ("diff", "fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "fft_hfft", "fft_ihfft")},
    **{n: (2, (-2, -1)) for n in ("fft_fft2", "fft_ifft2", "fft_rfft2", "fft_irfft2")},
    **{n: (2, None) for n in ("fft_fftn", "fft_ifftn", "fft_rfftn", "fft_irfftn")},
    "normalize": (2, 1), "unfold": (1, 0), "unbind": (1, 0), "vsplit": (9, 0), "hsplit": (9, 1), "dsplit": (9, 2),
    **{n: (2, 0) for n in ("split", "chunk", "tensor_split", "split_with_sizes")},
    "gumbel_softmax": (4, -1), "glu": (1, -1), "cross": (2, -1), "linalg_cross": (2, -1), "select": (1, None),
}
#: reductions over a dimension of both operands: name -> (position of ``dim``, default)
_PAIR_REDUCE = {"cosine_similarity": (2, 1), "linalg_vecdot": (9, -1), "pdist": (9, 0), "pairwise_distance": (9, -1),
                "linear": (9, -1), "bilinear": (9, -1)}
#: operations over the trailing (spatial) dimensions of ``(N, C, L...)``: name -> the first dimension they mix
_SPATIAL = {**{n: 2 for n in ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                              "avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
                              "max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices",
                              "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
                              "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d", "lp_pool1d",
                              "lp_pool2d", "lp_pool3d", "interpolate", "upsample", "upsample_nearest",
                              "upsample_bilinear", "grid_sample", "fold", "fractional_max_pool2d")},
            **{n: 1 for n in ("local_response_norm", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle")}}
#: recurrences over a sequence dimension (``batch_first``: the argument's position)
_RECURRENT = {"lstm": 8, "gru": 8, "rnn_tanh": 8, "rnn_relu": 8}
#: functions of the matrices in the last two dimensions (decompositions, inverses, determinants, triangles, diagonals)
_MATRIX = {"linalg_svd", "svd", "linalg_svdvals", "linalg_qr", "qr", "linalg_eig", "linalg_eigh", "linalg_eigvals",
           "linalg_eigvalsh", "linalg_inv", "inverse", "linalg_pinv", "pinverse", "linalg_solve", "linalg_lstsq",
           "lstsq", "linalg_cholesky", "cholesky", "linalg_det", "det", "linalg_slogdet", "slogdet", "logdet",
           "linalg_matrix_rank", "matrix_rank", "linalg_matrix_exp", "matrix_exp", "linalg_matrix_power",
           "matrix_power", "linalg_lu", "linalg_lu_factor", "lu", "svd_lowrank", "pca_lowrank", "lobpcg",
           "linalg_cond", "linalg_matrix_norm", "matrix_norm", "trace", "tril", "triu", "diagonal", "diag",
           "diag_embed", "cholesky_solve", "cholesky_inverse", "triangular_solve", "linalg_solve_triangular",
           "linalg_householder_product", "geqrf", "orgqr", "linalg_multi_dot", "chain_matmul"}
#: losses: over every entry unless ``reduction="none"``
_LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "cross_entropy", "nll_loss", "binary_cross_entropy",
           "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss", "gaussian_nll_loss", "margin_ranking_loss",
           "hinge_embedding_loss", "soft_margin_loss", "multilabel_soft_margin_loss", "multilabel_margin_loss",
           "multi_margin_loss", "cosine_embedding_loss", "triplet_margin_loss", "triplet_margin_with_distance_loss"}
_CONTRACT = {"mm", "matmul", "bmm", "__matmul__", "__rmatmul__", "addmm", "baddbmm", "addbmm", "einsum",
             "scaled_dot_product_attention", "multi_head_attention_forward", "_native_multi_head_attention",
             "tensordot", "cdist", "outer", "ger", "inner", "dot", "vdot", "mv", "addmv"}
_SCATTER = {"scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_", "index_add",
            "index_add_", "index_reduce", "index_reduce_", "index_copy", "index_copy_", "index_fill", "index_fill_",
            "index_put", "index_put_", "index_select", "gather", "take_along_dim", "narrow", "roll", "flip"}
#: torch's dispatch helpers between a caller and a function mode
_HELPERS = ("torch.overrides", "torch._tensor", "torch.functional", "torch.nn.functional", "torch._jit_internal")


def caller(depth: int = 2):
    """The frame that called the operation (past torch's dispatch helpers); ``depth``: the frames from here to
    the function mode's handler, plus one."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_HELPERS):
        frame = frame.f_back
    return frame


def users(frame) -> bool:
    """Whether the operation was called by the user's code, not PyG's (whose layers and utilities read sizes to build
    self loops and samples, as the zoo tests)."""
    return frame is None or not frame.f_globals.get("__name__", "").startswith("torch_geometric")


def in_propagate() -> bool:
    """Whether the operation runs inside a layer's ``propagate`` / ``edge_updater`` (where the engine joins
    halo rows) rather than in its ``forward`` around them (called by the check's handler)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code.co_name
        if code in ("propagate", "edge_updater"):
            return True
        if code == "forward" and isinstance(frame.f_locals.get("self"), MessagePassing):
            return False
        frame = frame.f_back
    return False

def op_name(func) -> str:
    """The operation's name; the transposing properties (``x.T``, ``x.mT``) by their own."""
    name = getattr(func, "__name__", str(func))
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        for prop in ("T", "mT", "H", "mH"):
            if owner is getattr(Tensor, prop, None):
                return prop
    return name


def tensors(args, kwargs) -> List[Tensor]:
    out = []
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out += [u for u in v if isinstance(u, Tensor)]
    return out


def _norm(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _arg(args, kwargs, pos: int, *names, default=None):
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return args[pos] if len(args) > pos else default


def mixes(name: str, args, kwargs, aligned) -> Optional[str]:
    """How the operation combines vertex rows (``None``: it does not)."""
    first = args[0] if args else None
    for t, v in aligned:
        if name in _REDUCE:
            if t is not first:
                continue
            pos, default = _REDUCE[name]
            dim = _arg(args, kwargs, pos, "dim", "axis", default=default)
            if name == "cross" and _arg(args, kwargs, pos, "dim") is None:  # torch.cross's own default: the first
                dim = next((i for i, s in enumerate(t.shape) if s == 3), default)  # dimension of size 3 (a 3-row chunk)
            if isinstance(dim, Tensor) or isinstance(dim, bool):
                if name in ("max", "min") and isinstance(dim, Tensor):
                    continue  # elementwise maximum of two tensors
                dim = default  # std(x, unbiased) and friends
            dims = range(t.dim()) if dim is None else [dim] if isinstance(dim, int) else list(dim)
            if name == "hsplit" and t.dim() == 1:
                dims = [0]
            if v in [_norm(d, t.dim()) for d in dims]:
                return "orders or accumulates {rows}" if name in ("sort", "argsort", "msort", "cumsum", "cumprod",
                                                                 "cummax", "cummin", "logcumsumexp") \
                    else "splits {rows} by position" if name in ("unfold", "unbind", "vsplit", "hsplit", "dsplit",
                                                                 "split", "chunk", "tensor_split",
                                                                 "split_with_sizes") \
                    else "selects {rows} by position" if name == "select" \
                    else "selects entries of {rows} by value" if name == "masked_select" \
                    else "combines {rows} by position" if name in ("diff", "glu", "cross", "linalg_cross") or \
                    name.startswith("fft_") \
                    else "reduces over {rows}"
        elif name in _PAIR_REDUCE:
            pos, default = _PAIR_REDUCE[name]
            dim = _arg(args, kwargs, pos, "dim", default=default)
            if isinstance(dim, int) and _norm(dim, t.dim()) == v:
                return "reduces over {rows}"
        elif name in _MATRIX:  # (a chain of products keeps the rows of its first factor)
            chain = args[0] if name in ("linalg_multi_dot", "chain_matmul") and args and \
                isinstance(args[0], (list, tuple)) else args if name == "chain_matmul" else None
            if chain is not None and len(chain) and chain[0] is t and v == 0 and t.dim() == 2:
                continue
            if v >= t.dim() - 2:
                return "combines {rows} as a matrix"
        elif name in _LOSSES:
            if _arg(args, kwargs, 99, "reduction", default="mean") != "none":
                return "reduces over {rows}"
        elif name in _SPATIAL:
            if t is not first or v >= _SPATIAL[name]:
                return "combines {rows} by position"
        elif name in _RECURRENT:  # (L, B, F), or (B, L, F) with batch_first; an unbatched (L, F)
            packed = len(args) > 1 and isinstance(args[1], Tensor) and args[1].dim() == 1
            seq = 1 if t.dim() == 3 and _arg(args, kwargs, _RECURRENT[name], "batch_first", default=False) else 0
            if t is first and (packed or v == seq):
                return "runs a recurrence over {rows}"
        elif name == "pad":  # pairs of amounts from the last dimension backwards
            pad, k = _arg(args, kwargs, 1, "pad", default=()), t.dim() - 1 - v
            if t is first and len(pad) > 2 * k + 1 and (pad[2 * k] or pad[2 * k + 1]):
                return "shifts {rows} by position"
        elif name in ("embedding", "embedding_bag", "take", "put", "put_", "__iter__"):
            if (t is _arg(args, kwargs, 1, "weight")) if name.startswith("embedding") else \
                    (t is first and (name != "__iter__" or v == 0)):
                return "selects {rows} by position"
        elif name == "one_hot":  # num_classes=-1 (the default): one more than the largest value of every entry
            if t is first and _arg(args, kwargs, 1, "num_classes", default=-1) < 0:
                return "takes num_classes=-1 (the default) from the largest value over {rows}: pass num_classes"
        elif name == "isin":  # each entry tested against every test element
            if t is _arg(args, kwargs, 1, "test_elements", "test_element"):
                return "tests entries against every one of {rows}"
        elif name in ("tolist", "numpy", "__array__"):
            return "takes {rows} to Python"
        elif name == "rot90":
            k, dims = _arg(args, kwargs, 1, "k", default=1), _arg(args, kwargs, 2, "dims", default=(0, 1))
            if t is first and k % 4 and v in [_norm(d, t.dim()) for d in dims]:
                return "reorders {rows}"
        elif name == "rms_norm" and t is first:
            shape = _arg(args, kwargs, 1, "normalized_shape", default=())
            if v >= t.dim() - len(shape):
                return "normalises with statistics over {rows}"
        elif name == "renorm":  # each slice along dim rescaled by its norm over the other dimensions
            if t is first and _norm(_arg(args, kwargs, 2, "dim"), t.dim()) != v:
                return "reduces over {rows}"
        elif name in _CONTRACT:
            if _contracts(name, args, kwargs, t, v, aligned):
                return "multiplies {rows} together"
        elif name in _SCATTER:
            if name in ("roll", "flip"):
                dims = _arg(args, kwargs, 2 if name == "roll" else 1, "dims")
                dims = range(t.dim()) if dims is None else [dims] if isinstance(dims, int) else list(dims)
                if t is first and v in [_norm(d, t.dim()) for d in dims]:
                    return "reorders {rows}"
                continue
            dim = _arg(args, kwargs, 1, "dim")
            if name == "take_along_dim":
                dim = _arg(args, kwargs, 2, "dim")
            if not isinstance(dim, int) or _norm(dim, t.dim()) != v:
                continue
            if name == "narrow":
                start, length = _arg(args, kwargs, 2, "start"), _arg(args, kwargs, 3, "length")
                if start == 0 and length == t.size(v):
                    continue
            index_arg = _arg(args, kwargs, 2, "index")
            if index_arg is t:
                continue  # the aligned tensor is an index into something else
            return "selects or scatters {rows} by position"
        elif name in ("__getitem__", "__setitem__") and t is first:
            if _positional_index(args[1] if len(args) > 1 else None, v, t.size(v), t.dim()):
                return "selects {rows} by position"
        elif name in ("nonzero", "argwhere") or (name == "where" and len(args) == 1):
            return "lists the positions of {rows}"
        elif name == "batch_norm" and bool(_arg(args, kwargs, 5, "training", default=False)) and v == 0:
            return "normalises with statistics over {rows}"
        elif name == "instance_norm" and t is first and v >= 2:  # (N, C, L...): statistics per (n, c) over L...
            return "normalises with statistics over {rows}"
        elif name in ("layer_norm", "group_norm") and t is first:
            shape = _arg(args, kwargs, 1, "normalized_shape", "num_groups")
            if name == "group_norm" and v > 0:
                return "normalises with statistics over {rows}"
            if name == "layer_norm" and isinstance(shape, (tuple, list, torch.Size)) and v >= t.dim() - len(shape):
                return "normalises with statistics over {rows}"
    return None


#: reads and writes of rows at an index tensor: inside a layer's forward not judged as positional (PyG's layers select
#: rows by a value, as MFConv groups them by degree, or at sampled edges, as SuperGATConv does)
INDEXED = frozenset({"index_select", "gather", "take_along_dim", "index_add", "index_add_", "index_copy", "index_copy_",
                     "index_put", "index_put_", "index_fill", "index_fill_", "index_reduce", "index_reduce_",
                     "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_"})


def by_index(name: str, args) -> bool:
    """Whether the operation reads or writes rows at an index tensor (:data:`INDEXED`, or ``x[index]``)."""
    if name in ("__getitem__", "__setitem__") and len(args) > 1:
        return any(isinstance(e, Tensor) for e in (args[1] if isinstance(args[1], tuple) else (args[1],)))
    return name in INDEXED


#: every operation a rule above judges (one it finds not mixing rows is row-wise)
JUDGED = frozenset({*_REDUCE, *_PAIR_REDUCE, *_MATRIX, *_LOSSES, *_CONTRACT, *_SCATTER, *_SPATIAL, *_RECURRENT,
                    "__getitem__", "__setitem__", "nonzero", "argwhere", "where", "batch_norm", "layer_norm",
                    "group_norm", "instance_norm", "renorm", "pad", "embedding", "embedding_bag", "take", "put",
                    "put_", "__iter__", "tolist", "numpy", "__array__", "rot90", "rms_norm", "one_hot", "isin"})


def _contracts(name: str, args, kwargs, t: Tensor, v: int, aligned) -> bool:
    if name == "einsum":
        parsed = einsum_terms(args)
        if parsed is None:
            return False
        terms, ops, rhs = parsed
        for term, op in zip(terms, ops):
            if op is t and v < len(term) and term[v] not in rhs:
                return True
        vertex = {id(o): d for o, d in aligned}  # (two vertex letters: rows paired with rows, "ij,kj->ik")
        return len({term[vertex[id(op)]] for term, op in zip(terms, ops)
                    if id(op) in vertex and vertex[id(op)] < len(term)}) > 1
    if name == "scaled_dot_product_attention":
        return any(_arg(args, kwargs, i, n) is t for i, n in ((1, "key"), (2, "value"))) and v == t.dim() - 2
    if name in ("multi_head_attention_forward", "_native_multi_head_attention"):
        seq = 0 if name == "multi_head_attention_forward" else 1  # (L, B, E) / (B, L, E)
        return any(_arg(args, kwargs, i, n) is t for i, n in ((1, "key"), (2, "value"))) and v == seq
    if name in ("tensordot", "cdist", "outer", "ger", "inner", "dot", "vdot", "mv", "addmv"):
        return _pairs(name, args, kwargs, t, v)
    ops = list(args)
    if name in ("addmm", "baddbmm", "addbmm"):
        ops = ops[1:3]
    elif name == "__rmatmul__":
        ops = ops[:2][::-1]
    else:
        ops = ops[:2]
    if len(ops) != 2 or not all(isinstance(o, Tensor) for o in ops):
        return False
    a, b = ops
    if a is t and v == a.dim() - 1:
        return True
    return b is t and v == (b.dim() - 2 if b.dim() >= 2 else 0)


def einsum_terms(args) -> Optional[Tuple[List[str], list, str]]:
    """``(input subscripts, operands, output subscripts)`` of ``torch.einsum(eq, *operands)``, with the implicit output
    spelled out and ``...`` replaced by letters of their own (aligned from the right); ``None`` without an equation."""
    eq = args[0] if args and isinstance(args[0], str) else None
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list)) else list(args[1:])
    if eq is None:
        return None
    lhs, _, rhs = eq.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if "->" not in eq:  # implicit output: the broadcast dimensions, then the letters used once, in order
        rhs = ("..." if "..." in lhs else "") + "".join(sorted(c for c in set(lhs) if c.isalpha() and
                                                               lhs.count(c) == 1))
    if "..." in lhs:  # the broadcast dimensions as letters of their own, aligned from the right
        spans = [op.dim() - len(term) + 3 if "..." in term and isinstance(op, Tensor) else 0
                 for term, op in zip(terms, ops)]
        letters = "".join(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq)[:max(spans, default=0)]
        terms = [term.replace("...", letters[len(letters) - k:] if k else "") for term, k in zip(terms, spans)]
        rhs = rhs.replace("...", letters)
    return terms, ops, rhs


def _pairs(name: str, args, kwargs, t: Tensor, v: int) -> bool:
    """:func:`_contracts` for the products of two operands other than matrix products: whether the vertex dimension
    ``v`` of ``t`` is summed over, or ``t`` is the second operand, whose every row meets each row of the first."""
    a, b = (args[1], args[2]) if name == "addmv" else (args[0], args[1] if len(args) > 1 else kwargs.get("other"))
    if name == "tensordot":
        dims = _arg(args, kwargs, 2, "dims", default=2)
        if isinstance(dims, int):
            summed = list(range(a.dim() - dims, a.dim())) if t is a else list(range(dims))
        else:
            summed = [_norm(d, t.dim()) for d in ([dims[0]] if t is a else [dims[1]])[0]] \
                if isinstance(dims[0], (list, tuple)) else [_norm(dims[0 if t is a else 1], t.dim())]
        return v in summed
    if name in ("cdist", "outer", "ger"):
        return t is b and (name != "cdist" or v == t.dim() - 2)
    if name == "inner":
        return t is b or v == t.dim() - 1
    if name in ("mv", "addmv"):  # matrix @ vector: the matrix keeps its rows
        return t is b or v == 1
    return True  # dot, vdot: a vertex operand is summed over


def index_entries(index, ndim: int) -> List[Tuple[Any, Optional[int]]]:
    """The entries of an index ``x[index]`` into a tensor of ``ndim`` dimensions, each with the first input dimension it
    reads (``None``: an entry adding a dimension, ``None`` or a Python bool); ``...`` expanded to full slices, and the
    dimensions after the last entry as full slices. A boolean tensor reads as many dimensions as it has."""
    entries = list(index) if isinstance(index, tuple) else [index]

    def width(e) -> int:
        if e is None or isinstance(e, bool):
            return 0
        return e.dim() if isinstance(e, Tensor) and e.dtype == torch.bool else 1
    left = ndim - sum(width(e) for e in entries if e is not Ellipsis)
    out: List[Tuple[Any, Optional[int]]] = []
    d = 0
    for e in entries:
        if e is Ellipsis:
            out += [(slice(None), d + i) for i in range(max(left, 0))]
            d += max(left, 0)
            left = 0
            continue
        w = width(e)
        out.append((e, d if w else None))
        d += w
    return out + [(slice(None), i) for i in range(d, ndim)]


def _positional_index(index, v: int, n: int, ndim: int) -> bool:
    """Whether indexing with ``index`` selects along dimension ``v`` (of ``n`` rows) by position. Integers and ``None``
    before it move it (``x.unsqueeze(0)[0, :1]`` selects rows by position: ran silently wrong until 2026-11-28)."""
    for e, d in index_entries(index, ndim):
        if d is None or not (d == v or (isinstance(e, Tensor) and e.dtype == torch.bool and d < v < d + e.dim())):
            continue
        if isinstance(e, slice):  # positional unless it covers all n rows (``x[:x.size(0)]`` as much as ``x[:]``)
            return not (e.start in (None, 0) and e.step in (None, 1) and
                        (e.stop is None or (isinstance(e.stop, int) and e.stop >= n)))
        if isinstance(e, int):
            return True
        if isinstance(e, Tensor):
            return e.dtype != torch.bool
        return isinstance(e, (list, range))
    return False
