"""Graph-wide statistics on chunks: BatchNorm with the statistics of every way, other norms gathered.

Most of a GNN is per vertex row, but some modules reduce over all vertices (:mod:`pyg_pipe.model.norms`):
BatchNorm (mean and variance over the rows), InstanceNorm, GraphNorm, PairNorm,
``torch_geometric.nn.LayerNorm`` in graph mode, ... A way holds only its rows, so these modules are
run by the engine:

* **BatchNorm** (``torch.nn`` BatchNorm1d/2d/3d, also inside PyG's ``BatchNorm`` and inside layers
  such as GIN's MLP) uses the statistics of all ways, as ``torch.nn.SyncBatchNorm`` does: the sums of
  the rows of every way are all-reduced (the mean first, then the centred squares), autograd goes
  through the all-reduce, and the running statistics are updated with the global mean and the
  unbiased global variance, so they equal one process's.
* **other graph-wide modules** run on the rows of all ways, gathered (``all_gather``, differentiable):
  exact, and as costly as one copy of their input per way.

Only the rows a chunk owns count. Inside a layer, where vertex tensors carry halo rows too, the
statistics are taken over the chunk's rows (the first ``rows``) and applied to all. Inside a layer's
``message`` or ``edge_update`` (a BatchNorm in EdgeConv's or PointNetConv's MLP) the rows are the
layer's edges: the statistics count the edges into the chunk's vertices, which over all ways are
every edge exactly once, as on one device (the local graph's extra self loops of halo vertices do not
count). With more than one chunk per way the statistics of a step would need every chunk at once,
which the pipeline never has: such modules are refused before training unless
``per_chunk_statistics=True``, which computes them per chunk (GPipe's choice for micro-batches;
approximate), or, for the norms computed from sums (BatchNorm, GraphNorm, InstanceNorm, graph-mode LayerNorm,
PairNorm, MeanSubtractionNorm, GraphSizeNorm), ``per_chunk_statistics="history"``. In exact passes (inference, the
history pass) nothing is approximate.

The state these hooks read — how one run computes statistics, and the historical sums of
``per_chunk_statistics="history"`` — is :mod:`..runtime.statistics`.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
from torch import Tensor
from torch_geometric.nn import GraphNorm, GraphSizeNorm, InstanceNorm, LayerNorm, PairNorm

from ...model.errors import UnsupportedModelError
from ...model.norms import BATCH_NORM, needs_statistics, takes_historical_statistics
from ..context import current
from ..reroute import Rerouted
from ..runtime.statistics import Statistics


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
        ctx = current()
        stats = ctx.statistics if ctx is not None else None
        if stats is None or stats.inside_gather:
            return original(module, *args, **kwargs)
        inv = ctx.stack[-1] if ctx.stack and ctx.stack[-1].in_edges else None
        with ctx.engine_work():  # its statistics are the engine's business, not a row-mixing operation
            if isinstance(module, BATCH_NORM):
                out = _batch_norm(module, original, stats, inv, *args, **kwargs)
            elif stats.history is not None and inv is None and takes_historical_statistics(module):
                if (args[1] if len(args) > 1 else kwargs.get("batch")) is None:
                    out = _historical_norm(module, stats, args[0] if args else kwargs["x"])
                else:
                    _refuse(ctx, f"{type(module).__name__} was given a batch vector; per_chunk_statistics='history' "
                                 f"covers one graph (batch=None). Use per_chunk_statistics=True or one chunk per way.")
                    out = original(module, *args, **kwargs)  # (the pass goes on to its end; every rank then raises)
            elif inv is not None:
                _refuse(ctx, f"{type(module).__name__} runs inside the message function of layer '{inv.name}' "
                             f"with statistics over the edges; pyg_pipe completes BatchNorm there, not this norm. "
                             f"Use a BatchNorm or a per-row norm (torch.nn.LayerNorm) in the message MLP.")
                out = original(module, *args, **kwargs)  # (the pass goes on to its end; every rank then raises)
            else:
                if stats.prime is not None and takes_historical_statistics(module):  # exact pass: its sums
                    x = args[0]
                    stats.prime.record(stats.site(module), x.narrow(0, 0, min(stats.rows, x.size(0))), [0])
                out = _gathered(module, original, stats, *args, **kwargs)
        if ctx.observer is not None and inv is None:
            ctx.observer.returned(out, 0)
        return out
    return forward


def _refuse(ctx, message: str) -> None:
    """Refuses the model: after the pass on every rank where the pass is checked (the first of each mode, which
    the plan's first step always is: no rank stops while another waits for it), else now."""
    if ctx is None or ctx.observer is None:
        raise UnsupportedModelError(message)
    ctx.observer.refuse(message)


def _batch_norm(module, original, stats: Statistics, inv, x: Tensor) -> Tensor:
    uses_batch = module.training or not module.track_running_stats
    if not uses_batch:
        return original(module, x)
    dims = [0] + list(range(2, x.dim()))
    shape = [1, -1] + [1] * (x.dim() - 2)
    per_row = x[0].numel() // x.size(1) if x.size(0) else 1
    if inv is None and stats.history is not None:
        return _historical_batch_norm(module, stats, x, dims, shape, per_row)
    if inv is not None and (stats.history is not None or stats.prime is not None):  # (prime: the pass filling it)
        _refuse(current(), f"A BatchNorm in the message function of layer '{inv.name}' normalises over edges; "
                           f"per_chunk_statistics='history' (the default with several chunks per way) covers "
                           f"BatchNorm over vertex rows. Use per_chunk_statistics=True (each chunk's own edges, "
                           f"approximate) or one chunk per way.")
        if stats.history is not None:  # (a pass that goes on to its end: each chunk's own statistics meanwhile)
            return original(module, x)
    if inv is None:  # vertex rows: the chunk's are the first ``rows``
        rows = x.narrow(0, 0, min(stats.rows, x.size(0)))
        weight = None
        n = float((sum(stats.way_rows) if stats.group is not None else rows.size(0)) * per_row)
        s = rows.sum(dims)
        if stats.prime is not None:
            stats.prime.record(stats.site(module), rows, dims)
        if stats.group is not None:
            s = _AllReduce.apply(s, stats.comm, stats.group)
    else:  # edge rows: those into the chunk's vertices
        dst = inv.destinations()
        if dst.numel() != x.size(0):
            raise UnsupportedModelError(
                f"A BatchNorm in layer '{inv.name}' normalises {x.size(0)} rows while the layer's edges are "
                f"{dst.numel()}; pyg_pipe takes statistics inside message() over the layer's edges only.")
        weight = (dst < inv.lg.rows).to(x.dtype).view(-1, *([1] * (x.dim() - 1)))
        rows = x
        both = torch.cat([(x * weight).sum(dims), weight.sum().reshape(1) * per_row])
        if stats.group is not None:
            both = _AllReduce.apply(both, stats.comm, stats.group)
        s, n = both[:-1], both[-1]
    mean = s / n
    centred = (rows - mean.view(shape)) ** 2
    sq = (centred if weight is None else centred * weight).sum(dims)
    if stats.group is not None:
        sq = _AllReduce.apply(sq, stats.comm, stats.group)
    var = sq / n
    y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + module.eps)
    if module.affine:
        y = y * module.weight.view(shape) + module.bias.view(shape)
    if module.training and module.track_running_stats and stats.moves_running():
        with torch.no_grad():
            module.num_batches_tracked.add_(1)
            momentum = module.momentum
            if momentum is None:
                momentum = 1.0 / float(module.num_batches_tracked)
            factor = n / (n - 1.0).clamp(min=1.0) if isinstance(n, Tensor) else n / max(n - 1.0, 1.0)
            unbiased = var.detach() * factor
            module.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            module.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
    return y


def _historical_sums(module, stats: Statistics, x: Tensor, dims, per_row: int):
    """The whole graph's ``(Σ x, Σ x²)`` [2, d] per feature and the rows counted ``n`` (a float; a device
    scalar when summed over the ways): this chunk's sums with autograd, the other chunks' from their latest
    run (module docstring)."""
    hist = stats.history
    rows = x.narrow(0, 0, min(stats.rows, x.size(0)))
    own = torch.stack([rows.sum(dims), (rows * rows).sum(dims)])
    site = stats.site(module)
    others, n = hist.others(site, stats.chunk, own.detach(), float(rows.size(0) * per_row), stats.replay, per_row)
    total = _Shared.apply(own, others, hist, site, stats.chunk)
    if hist.group is not None:  # the ways' chunks at this clock, each with its way's history
        both = _AllReduce.apply(torch.cat([total.reshape(-1), total.new_tensor([n])]), hist.comm, hist.group)
        total, n = both[:-1].view_as(total), both[-1]
    return total, n


def _historical_batch_norm(module, stats: Statistics, x: Tensor, dims, shape, per_row: int,
                           counts: bool = True) -> Tensor:
    """BatchNorm of a chunk with the whole graph's statistics, other chunks' sums historical (module docstring);
    also PyG's InstanceNorm on one graph (the same statistics over the vertices; ``counts=False``: it moves its
    running statistics as ``F.instance_norm`` does, without counting batches)."""
    total, n = _historical_sums(module, stats, x, dims, per_row)
    mean = total[0] / n
    var = (total[1] / n - mean * mean).clamp(min=0)
    y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + module.eps)
    if module.affine:
        y = y * module.weight.view(shape) + module.bias.view(shape)
    if module.training and module.track_running_stats and stats.last and stats.moves_running():
        with torch.no_grad():  # once per step: in the last chunk of the order, whose sums are all this step's
            if counts:
                module.num_batches_tracked.add_(1)
            momentum = module.momentum
            if momentum is None:
                momentum = 1.0 / float(module.num_batches_tracked)
            module.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            factor = n / (n - 1.0).clamp(min=1.0) if isinstance(n, Tensor) else n / max(n - 1.0, 1.0)
            module.running_var.mul_(1 - momentum).add_(var * factor, alpha=momentum)
    return y


def _historical_norm(module, stats: Statistics, x: Tensor) -> Tensor:
    """A norm computed from the whole graph's per-feature sums ``S = Σ x``, ``Q = Σ x²`` over ``n`` rows, on one
    graph (PyG's own formulas, with ``μ = S/n`` and ``q = Σ_f Q_f / n``):

    * GraphNorm (``α`` its mean scale): ``out = w·(x − α·μ) / √(Q/n − (2α − α²)·μ² + ε) + b``;
    * LayerNorm, graph mode (one mean and spread over all entries, ``m = Σ_f S_f / (n·d)``):
      ``out = w·(x − m) / (√(q/d − m²) + ε) + b``;
    * PairNorm: ``out = s·(x − μ) / √(ε + q − ‖μ‖²)`` (or divided by each row's own norm);
    * MeanSubtractionNorm: ``out = x − μ``;  GraphSizeNorm: ``out = x / √n``;
    * InstanceNorm: BatchNorm's (:func:`_historical_batch_norm`)."""
    if isinstance(module, InstanceNorm):  # (in training; with running statistics in eval it runs per row)
        return _historical_batch_norm(module, stats, x, [0], [1, -1], 1, counts=False)
    total, n = _historical_sums(module, stats, x, [0], 1)
    mean = total[0] / n
    if isinstance(module, GraphNorm):
        alpha = module.mean_scale
        var = (total[1] / n - (2 * alpha - alpha * alpha) * mean * mean).clamp(min=0)
        return module.weight * (x - alpha * mean) / (var + module.eps).sqrt() + module.bias
    if isinstance(module, LayerNorm):
        d = x.size(-1)
        m = total[0].sum() / (n * d)
        var = (total[1].sum() / (n * d) - m * m).clamp(min=0)
        out = (x - m) / (var.sqrt() + module.eps)
        return out * module.weight + module.bias if module.weight is not None and module.bias is not None else out
    if isinstance(module, PairNorm):
        x = x - mean
        if module.scale_individually:
            return module.scale * x / (module.eps + x.norm(2, -1, keepdim=True))
        spread = (total[1].sum() / n - (mean * mean).sum()).clamp(min=0)
        return module.scale * x / (module.eps + spread).sqrt()
    if isinstance(module, GraphSizeNorm):
        return x * (n ** -0.5 if isinstance(n, float) else n.rsqrt())
    return x - mean  # MeanSubtractionNorm


class _Shared(torch.autograd.Function):
    """``own + others`` (a chunk's sums plus the other chunks' latest); its backward adds to the gradient
    of ``own`` the other chunks' gradients with respect to the same sums.

    In one process a graph-wide sum ``T`` feeds every row's output, so ``dL/dT`` collects all of them; a
    chunk sees only its own outputs' part ``G_c``. The others' ``G`` come from their latest backward
    (this step's for chunks drained before, the previous step's otherwise), as the forward's sums do:
    ``dL/d own = G_c + Σ_{c' ≠ c} G_{c'}``. At lr = 0, from the second step, this is one process's
    gradient whenever ``G`` is. Without it (the statistics as constants) BatchNorm loses its invariance
    to shifts and rescalings of its input and training drifts apart (docs/convergence.md). One mechanism
    for every norm computed from these sums (BatchNorm, GraphNorm).
    """

    @staticmethod
    def forward(ctx, own, others, hist, site, chunk):
        ctx.hist, ctx.site, ctx.chunk = hist, site, chunk
        return own + others

    @staticmethod
    def backward(ctx, g):
        hist = ctx.hist
        buf, seen = hist._slot(hist.grad_sums, hist.grad_seen, ctx.site, g)
        return g + hist._exchange(buf, seen, ctx.chunk, g), None, None, None, None


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
    # running statistics the module moves itself (InstanceNorm) stay put in a pass that must not move them
    kept = [] if stats.moves_running() else [(b, b.clone()) for n, b in module.named_buffers(recurse=False)
                                             if n.startswith("running_")]
    stats.inside_gather = True
    try:
        out = original(module, full, *args, **kwargs)
    finally:
        stats.inside_gather = False
        with torch.no_grad():
            for b, v in kept:
                b.copy_(v)
    if stats.group is not None:
        me = stats.comm.rank_in(stats.group)
        start = sum(stats.way_rows[:me])
        out = out.narrow(0, start, rows.size(0))
    if x.size(0) > rows.size(0):  # rows beyond the chunk keep their (unused) values
        out = torch.cat([out, x.narrow(0, rows.size(0), x.size(0) - rows.size(0)).to(out.dtype)])
    return out


class _AllReduce(torch.autograd.Function):
    """Sum over the group; the gradient of every rank's input is the sum of all ranks' gradients."""

    @staticmethod
    def forward(ctx, t: Tensor, comm, group):
        ctx.comm, ctx.group = comm, group
        out = t.clone()
        comm.all_reduce(out, group, "graph-wide statistics")
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone()
        ctx.comm.all_reduce(grad, ctx.group, "graph-wide statistics (backward)")
        return grad, None, None


class _AllGather(torch.autograd.Function):
    """Every rank's (equally sized) tensor, concatenated in rank order; the gradient of a rank's part is
    the sum over ranks of the gradients they give that part."""

    @staticmethod
    def forward(ctx, t: Tensor, comm, group):
        ctx.comm, ctx.group, ctx.n = comm, group, t.size(0)
        return torch.cat(comm.all_gather(t.contiguous(), group, "graph-wide statistics"))

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, ctx.group, "graph-wide statistics (backward)")
        me = ctx.comm.rank_in(ctx.group)
        return grad[me * ctx.n:(me + 1) * ctx.n], None, None


def _all_gather_rows(rows: Tensor, stats: Statistics) -> Tensor:
    """All ways' rows in way order (the ways own consecutive new-id ranges), differentiably."""
    biggest = max(stats.way_rows)
    pad = rows.new_zeros((biggest - rows.size(0), *rows.shape[1:]))
    full = _AllGather.apply(torch.cat([rows, pad]), stats.comm, stats.group)
    return torch.cat([full[i * biggest:i * biggest + n] for i, n in enumerate(stats.way_rows)])
