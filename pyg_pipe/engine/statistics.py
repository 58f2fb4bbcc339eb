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
approximate), or, for BatchNorm, ``per_chunk_statistics="history"``. In exact passes (inference, the
history pass) nothing is approximate.

**Historical statistics** (``per_chunk_statistics="history"``; BatchNorm on vertex rows, PyG's GraphNorm
on one graph): statistics are sums, so the whole graph's can be assembled the way history assembles a
layer's input. For a norm's call site and chunk ``c`` of a way running several chunks::

    s_c = Σ_{v in c} x_v,   q_c = Σ_{v in c} x_v²           (this run)
    S   = s_c + Σ_{c' ≠ c, seen} s_{c'}^{hist}               (the other chunks' latest sums, constants)
    Q   = q_c + Σ_{c' ≠ c, seen} q_{c'}^{hist},   n = rows of c and of the seen chunks
    mean = S / n,   var = Q / n − mean²                      (S, Q, n all-reduced over the ways, if several)
    GraphNorm: out = x − α·mean,   var = Q / n − (2α − α²)·mean²

then ``s_c, q_c`` replace chunk ``c``'s entry. Chunks earlier in the step's order contribute this step's
sums, later ones the previous step's, and the exact pass that fills history fills these sums too: at
lr = 0 every chunk normalises with exactly the whole graph's statistics (as one process does) from the
first step. The backward goes through the whole graph's sums too: the loss's gradient with respect to
``S`` and ``Q`` collects every chunk's outputs, so each chunk adds the other chunks' parts from their
latest backward (:class:`_Shared`; without them training drifts apart, measured in
docs/convergence.md). A replay (recompute in the drain) reads what its fill read. The running
statistics move once per step, in the chunk that runs last in the way's order, whose sums are all from
this step (one process's update whenever the model's inputs to the norm are exact, as at lr = 0). The
variance is taken as ``E[x²] − mean²``: fine for normalised activations, less accurate than the
two-pass form where a feature's mean is far larger than its spread. Not covered: BatchNorm inside a
layer's ``message`` (statistics over edges), GraphNorm with a batch vector and the other graph-wide
norms (refused), NGra streaming (refused); the sums are not checkpointed (after a resume the exact pass
assembles the forward's again; the backward's start over).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch_geometric.nn import GraphNorm

from ..model.errors import UnsupportedModelError
from ..model.norms import BATCH_NORM, needs_statistics
from .context import current
from .reroute import Rerouted


class Statistics:
    """How graph-wide modules compute their statistics in one run.

    Args:
        comm: the transport (:class:`pyg_pipe.engine.comm.Comm`) for the all-reduces among ways.
        group: the process group of the ways of this stage (``None``: one way, nothing exchanged).
        way_rows: rows of every way in this pass (``None``: one way).
        rows: rows this chunk owns (statistics over vertex tensors take the first ``rows`` rows).
        update_running: whether running statistics are updated (not in the history pass).
        replay: the run is a replay of a chunk's fill (:mod:`.step`), whose forward moved them already;
            a layer recomputed inside it during backward (checkpointing) moves them, as in one process.
    """

    def __init__(self, comm, group, way_rows: Optional[List[int]], rows: int, update_running: bool = True,
                 replay: bool = False, history: Optional["StatisticsHistory"] = None, chunk: int = -1,
                 last: bool = False, prime: Optional["StatisticsHistory"] = None):
        self.comm, self.group, self.way_rows, self.rows = comm, group, way_rows, rows
        self.update_running, self.replay = update_running, replay
        self.history, self.chunk, self.last = history, chunk, last  # historical statistics (module docstring)
        self.prime = prime  # an exact pass of the whole way fills these historical sums of every chunk
        self.calls: Dict[int, int] = {}
        self.inside_gather = False

    def site(self, module: torch.nn.Module) -> Tuple[int, int]:
        """``(id(module), k)`` for the module's ``k``-th call in this chunk's run."""
        k = self.calls.get(id(module), 0)
        self.calls[id(module)] = k + 1
        return id(module), k

    def moves_running(self) -> bool:
        """Whether a norm run now updates its running statistics."""
        if not self.update_running:
            return False
        ctx = current()
        return not (self.replay and ctx is not None and not ctx.recomputing())


class StatisticsHistory:
    """The latest sums ``(s_c, q_c)`` of every chunk of this way at every BatchNorm call site, and what each
    chunk's fill read (for its replay); see the module docstring. ``chunk_rows[c]``: rows of chunk ``c``
    (global chunk ids; only this way's are used); ``way_chunks``: this way's chunks, in row order, and
    ``offsets``: where each starts in the way's rows (and where the last ends)."""

    def __init__(self, chunk_rows: List[int], way_chunks: List[int], offsets: List[int], group=None, comm=None):
        self.chunk_rows, self.way_chunks, self.offsets = chunk_rows, way_chunks, offsets
        self.group, self.comm = group, comm
        self.sums: Dict[Tuple[int, int], Tensor] = {}       # site -> [C, 2, d], zeros where not seen
        self.seen: Dict[Tuple[int, int], List[bool]] = {}   # site -> [C] (host: no device read)
        self.read: Dict[Tuple[Tuple[int, int], int], Tuple[Tensor, float]] = {}  # (site, chunk) -> others, n
        self.grad_sums: Dict[Tuple[int, int], Tensor] = {}     # site -> [C, 2, d] of the backward (Σ g, Σ g·u)
        self.grad_seen: Dict[Tuple[int, int], List[bool]] = {}

    def _slot(self, store: Dict, flags: Dict, site: Tuple[int, int], like: Tensor) -> Tuple[Tensor, List[bool]]:
        """The site's [C, 2, d] buffer in ``store`` (zeros, nothing seen, when new) and its seen flags."""
        buf = store.get(site)
        if buf is None or buf.shape[1:] != like.shape:
            buf = like.new_zeros((len(self.chunk_rows), *like.shape))
            store[site], flags[site] = buf, [False] * len(self.chunk_rows)
        return buf, flags[site]

    @staticmethod
    def _exchange(buf: Tensor, seen: List[bool], chunk: int, own: Tensor) -> Tensor:
        """The sum of the other chunks' seen entries; then ``own`` becomes ``chunk``'s entry."""
        others = buf.sum(0) - buf[chunk] if seen[chunk] else buf.sum(0)
        buf[chunk] = own.detach()
        seen[chunk] = True
        return others

    def record(self, site: Tuple[int, int], rows: Tensor, dims) -> None:
        """An exact pass's rows of the whole way: every chunk's sums, so the first training step starts from
        exact statistics, as history starts from exact embeddings."""
        with torch.no_grad():
            own = [torch.stack([rows[a:b].sum(dims), (rows[a:b] * rows[a:b]).sum(dims)])
                   for a, b in zip(self.offsets[:-1], self.offsets[1:])]
            buf, seen = self._slot(self.sums, self.seen, site, own[0])
            for c, o in zip(self.way_chunks, own):
                self._exchange(buf, seen, c, o)

    def measure(self, meter, names: Dict[int, str]) -> None:
        """After a fill: for every site, the other chunks' sums each chunk read against their values now
        (all of this step), into the staleness meter as ``statistics:<module name>#<call>``."""
        for site, buf in self.sums.items():
            total = buf.sum(0)
            diff = fresh = None
            for (key, c), (others, _) in self.read.items():
                if key != site:
                    continue
                d = (others - (total - buf[c])).pow(2).sum()
                diff = d if diff is None else diff + d
                f = total.pow(2).sum()
                fresh = f if fresh is None else fresh + f
            if diff is not None:
                meter.add(f"statistics:{names.get(site[0], '?')}#{site[1]}", diff, fresh)

    def others(self, site: Tuple[int, int], chunk: int, own: Tensor, own_n: float, replay: bool,
               per_row: int) -> Tuple[Tensor, float]:
        """The other chunks' latest sums (constants) and all rows counted: ``(others, n)``; ``own`` [2, d]
        (``s_c``, ``q_c``) becomes the chunk's entry. A replay gets what its fill got."""
        key = (site, chunk)
        if replay and key in self.read:
            others, n_others = self.read[key]
        else:
            buf, seen = self._slot(self.sums, self.seen, site, own)
            n_others = float(sum(r for c, (r, s) in enumerate(zip(self.chunk_rows, seen)) if s and c != chunk)
                             * per_row)
            others = self._exchange(buf, seen, chunk, own)
            self.read[key] = (others, n_others)
        return others, own_n + n_others


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
            elif stats.history is not None and inv is None and isinstance(module, GraphNorm):
                out = _historical_graph_norm(module, stats, *args, **kwargs)
            elif inv is not None:
                raise UnsupportedModelError(
                    f"{type(module).__name__} runs inside the message function of layer '{inv.name}' with "
                    f"statistics over the edges; pyg_pipe completes BatchNorm there, not this norm. Use a "
                    f"BatchNorm or a per-row norm (torch.nn.LayerNorm) in the message MLP.")
            else:
                if stats.prime is not None and isinstance(module, GraphNorm):  # exact pass: its sums, per chunk
                    x = args[0]
                    stats.prime.record(stats.site(module), x.narrow(0, 0, min(stats.rows, x.size(0))), [0])
                out = _gathered(module, original, stats, *args, **kwargs)
        if ctx.observer is not None and inv is None:
            ctx.observer.returned(out, 0)
        return out
    return forward


def _batch_norm(module, original, stats: Statistics, inv, x: Tensor) -> Tensor:
    uses_batch = module.training or not module.track_running_stats
    if not uses_batch:
        return original(module, x)
    dims = [0] + list(range(2, x.dim()))
    shape = [1, -1] + [1] * (x.dim() - 2)
    per_row = x[0].numel() // x.size(1) if x.size(0) else 1
    if inv is None and stats.history is not None:
        return _historical_batch_norm(module, stats, x, dims, shape, per_row)
    if inv is not None and stats.history is not None:
        raise UnsupportedModelError(
            f"A BatchNorm in the message function of layer '{inv.name}' normalises over edges; "
            f"per_chunk_statistics='history' covers BatchNorm over vertex rows. Use per_chunk_statistics=True "
            f"(each chunk's own edges, approximate) or one chunk per way.")
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


def _historical_batch_norm(module, stats: Statistics, x: Tensor, dims, shape, per_row: int) -> Tensor:
    """BatchNorm of a chunk with the whole graph's statistics, other chunks' sums historical (module docstring)."""
    total, n = _historical_sums(module, stats, x, dims, per_row)
    mean = total[0] / n
    var = (total[1] / n - mean * mean).clamp(min=0)
    y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + module.eps)
    if module.affine:
        y = y * module.weight.view(shape) + module.bias.view(shape)
    if module.training and module.track_running_stats and stats.last and stats.moves_running():
        with torch.no_grad():  # once per step: in the last chunk of the order, whose sums are all this step's
            module.num_batches_tracked.add_(1)
            momentum = module.momentum
            if momentum is None:
                momentum = 1.0 / float(module.num_batches_tracked)
            module.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            factor = n / (n - 1.0).clamp(min=1.0) if isinstance(n, Tensor) else n / max(n - 1.0, 1.0)
            module.running_var.mul_(1 - momentum).add_(var * factor, alpha=momentum)
    return y


def _historical_graph_norm(module, stats: Statistics, x: Tensor, batch=None, batch_size=None) -> Tensor:
    """PyG's GraphNorm on one graph from the whole graph's sums: with ``μ = S/n`` and ``α`` its mean scale,
    ``out = x − α·μ`` and ``var = mean(out²) = Q/n − (2α − α²)·μ²``."""
    if batch is not None:
        raise UnsupportedModelError(
            "GraphNorm was given a batch vector; per_chunk_statistics='history' covers one graph (batch=None). "
            "Use per_chunk_statistics=True or one chunk per way.")
    total, n = _historical_sums(module, stats, x, [0], 1)
    mean = total[0] / n
    alpha = module.mean_scale
    var = (total[1] / n - (2 * alpha - alpha * alpha) * mean * mean).clamp(min=0)
    return module.weight * (x - alpha * mean) / (var + module.eps).sqrt() + module.bias


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
    stats.inside_gather = True
    try:
        out = original(module, full, *args, **kwargs)
    finally:
        stats.inside_gather = False
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
