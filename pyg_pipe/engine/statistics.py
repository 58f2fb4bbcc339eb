"""Graph-wide statistics on chunks: BatchNorm with the statistics of every way, other norms gathered.

Most of a GNN is per vertex row, but some modules reduce over all vertices: BatchNorm (mean and
variance over the rows), InstanceNorm, GraphNorm, PairNorm, ``torch_geometric.nn.LayerNorm`` in
graph mode, ... A way holds only its rows, so these modules are run by the engine:

* **BatchNorm** (``torch.nn`` BatchNorm1d/2d/3d, also inside PyG's ``BatchNorm`` and inside layers
  such as GIN's MLP) uses the statistics of all ways, as ``torch.nn.SyncBatchNorm`` does: the sums of
  the rows of every way are all-reduced (the mean first, then the centred squares), autograd goes
  through the all-reduce, and the running statistics are updated with the global mean and the
  unbiased global variance, so they equal one process's.
* **other graph-wide modules** run on the rows of all ways, gathered (``all_gather``, differentiable):
  exact, and as costly as one copy of their input per way.

Only the rows a chunk owns count: inside a layer, where tensors carry halo rows too, the statistics
are taken over the first ``rows`` rows and applied to all. With more than one chunk per way the
statistics of a step would need every chunk at once, which the pipeline never has: such modules
are refused before training unless ``per_chunk_statistics=True``, which computes them per chunk
(GPipe's choice for micro-batches; approximate). In exact passes (inference, the initial history
pass) nothing is approximate.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .layers import Rerouted, active

_BATCH_NORM = torch.nn.modules.batchnorm._BatchNorm


def graph_wide_modules() -> tuple:
    """Module classes whose output at a vertex depends on all vertices' rows."""
    from torch_geometric.nn import norm as pyg_norm
    classes = [torch.nn.modules.instancenorm._InstanceNorm]
    for name in ("InstanceNorm", "GraphNorm", "PairNorm", "MeanSubtractionNorm", "DiffGroupNorm", "GraphSizeNorm"):
        cls = getattr(pyg_norm, name, None)
        if cls is not None:
            classes.append(cls)
    return tuple(classes)


def needs_statistics(module: torch.nn.Module) -> bool:
    """True for modules computing statistics over vertices (in the mode they are in)."""
    from torch_geometric.nn import LayerNorm as PygLayerNorm
    if isinstance(module, _BATCH_NORM):
        return True
    if isinstance(module, PygLayerNorm):
        return module.mode != "node"
    return isinstance(module, graph_wide_modules())


class Statistics:
    """How graph-wide modules compute their statistics in one pass (set by the engine).

    Args:
        group: the process group of the ways of this stage (``None``: one way).
        way_rows: rows of every way in this pass (for gathering; ``None``: one way).
        rows: rows this chunk owns (statistics are taken over the first ``rows`` rows).
        update_running: whether running statistics are updated (not in the initial history pass).
    """

    def __init__(self, group, way_rows: Optional[List[int]], rows: int, update_running: bool = True):
        self.group, self.way_rows, self.rows = group, way_rows, rows
        self.update_running = update_running
        self.inside_gather = False


class StatisticsHooks:
    """Routes the forward of every graph-wide module of ``model`` through the engine while it runs.

    Outside the engine the module's own forward runs unchanged. The module objects are not wrapped:
    an instance attribute ``forward`` is set while installed and removed after.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.patched: Dict[int, torch.nn.Module] = {}

    def install(self) -> None:
        from torch_geometric.nn import BatchNorm as PygBatchNorm
        for _, m in self.model.named_modules():
            if isinstance(m, PygBatchNorm) or not needs_statistics(m) or id(m) in self.patched:
                continue  # PyG's BatchNorm calls the torch BatchNorm inside it, which is patched
            original = type(m).forward
            m.forward = Rerouted(m, _patched(m, original), original)
            self.patched[id(m)] = m

    def remove(self) -> None:
        for m in self.patched.values():
            m.__dict__.pop("forward", None)
        self.patched = {}


def _patched(module: torch.nn.Module, original: Callable):
    def forward(*args, **kwargs):
        ctx = active()
        stats = ctx.statistics if ctx is not None else None
        if stats is None or stats.inside_gather:
            return original(module, *args, **kwargs)
        check = ctx.rows_check
        if check is not None:  # its statistics are the engine's business, not a row-mixing operation
            check.paused += 1
        try:
            if isinstance(module, _BATCH_NORM):
                out = _batch_norm(module, original, stats, *args, **kwargs)
            else:
                out = _gathered(module, original, stats, *args, **kwargs)
        finally:
            if check is not None:
                check.paused -= 1
        if check is not None:
            check.mark(out, 0)
        return out
    return forward


def _batch_norm(module, original, stats: Statistics, x: Tensor) -> Tensor:
    uses_batch = module.training or not module.track_running_stats
    if not uses_batch:
        return original(module, x)
    rows = x.narrow(0, 0, min(stats.rows, x.size(0)))
    dims = [0] + list(range(2, x.dim()))
    per_row = rows[0].numel() // rows.size(1) if rows.size(0) else 1
    n = float((sum(stats.way_rows) if stats.group is not None else rows.size(0)) * per_row)
    s = rows.sum(dims)
    if stats.group is not None:
        s = _AllReduce.apply(s, stats.group)
    shape = [1, -1] + [1] * (x.dim() - 2)
    mean = s / n
    sq = ((rows - mean.view(shape)) ** 2).sum(dims)
    if stats.group is not None:
        sq = _AllReduce.apply(sq, stats.group)
    var = sq / n
    y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + module.eps)
    if module.affine:
        y = y * module.weight.view(shape) + module.bias.view(shape)
    if module.training and module.track_running_stats and stats.update_running:
        with torch.no_grad():
            module.num_batches_tracked.add_(1)
            momentum = module.momentum
            if momentum is None:
                momentum = 1.0 / float(module.num_batches_tracked)
            unbiased = var.detach() * (n / max(n - 1.0, 1.0))
            module.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            module.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
    return y


def _gathered(module, original, stats: Statistics, x: Tensor, *args, **kwargs):
    rows = x.narrow(0, 0, min(stats.rows, x.size(0)))
    full = rows if stats.group is None else _all_gather_rows(rows, stats)

    def same_rows(v):  # other per-vertex arguments (a batch vector) are gathered alike
        if isinstance(v, Tensor) and v.dim() > 0 and v.size(0) == x.size(0):
            v = v.narrow(0, 0, rows.size(0))
            return v if stats.group is None else _all_gather_rows(v, stats)
        return v

    args = tuple(same_rows(a) for a in args)
    kwargs = {k: same_rows(v) for k, v in kwargs.items()}
    stats.inside_gather = True
    try:
        out = original(module, full, *args, **kwargs)
    finally:
        stats.inside_gather = False
    if stats.group is not None:
        from torch.distributed import get_rank
        me = get_rank(stats.group)
        start = sum(stats.way_rows[:me])
        out = out.narrow(0, start, rows.size(0))
    if x.size(0) > rows.size(0):  # rows beyond the chunk keep their (unused) values
        out = torch.cat([out, x.narrow(0, rows.size(0), x.size(0) - rows.size(0)).to(out.dtype)])
    return out


class _AllReduce(torch.autograd.Function):
    """Sum over the group; the gradient of every rank's input is the sum of all ranks' gradients."""

    @staticmethod
    def forward(ctx, t: Tensor, group):
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllGather(torch.autograd.Function):
    """Every rank's (equally sized) tensor, concatenated in rank order; the gradient of a rank's part is
    the sum over ranks of the gradients they give that part."""

    @staticmethod
    def forward(ctx, t: Tensor, group, size: int):
        ctx.group, ctx.n = group, t.size(0)
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        me = dist.get_rank(ctx.group)
        return grad[me * ctx.n:(me + 1) * ctx.n], None, None


def _all_gather_rows(rows: Tensor, stats: Statistics) -> Tensor:
    """All ways' rows in way order (the ways own consecutive new-id ranges), differentiably."""
    biggest = max(stats.way_rows)
    pad = rows.new_zeros((biggest - rows.size(0), *rows.shape[1:]))
    padded = torch.cat([rows, pad])
    full = _AllGather.apply(padded, stats.group, len(stats.way_rows))
    return torch.cat([full[i * biggest:i * biggest + n] for i, n in enumerate(stats.way_rows)])
