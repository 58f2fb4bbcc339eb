"""One pass of the model over this rank's chunks: the fill and the drain of a training step, and the
exact pass.

**Fill** (the forward of one call of the model in a training step), on the rank of stage ``s``, way
``w``, with the step's chunk order ``o`` (:mod:`.schedule`)::

    for c in o:                                   # clock tick k + s for position k
        run_chunk(c): inputs cut to c (model/inputs.py), values of stage s-1 for c (link.py),
                      the stage's program (program.py) with the layer hooks (layers.py) reading
                      halo rows from the other ways and from history (halo.py, history.py)
        last stage: c's output rows kept; else: values for stage s+1 sent (link.py)
    the whole output shared with every rank (every rank's loss is then the same)

The fill returns a :class:`CallRecord`, every chunk's :class:`ChunkRecord` (its context, what it
received and sent, its output), which the **drain** walks in reverse when the loss's backward
reaches the call: per chunk, the gradients of what it sent (or of its output rows) come in,
autograd runs through the chunk (the halo joins route halo-row gradients to their owners), and the
gradients of what it received go to stage s-1.

**Recomputation** (``recompute``, torchgpipe's ``checkpoint="except_last"``): the fill runs every
chunk but the last of the order without autograd and keeps only what the chunk received from stage
s-1 and the random-number state it started with; the drain runs the chunk again (a *replay*: same
inputs, same random numbers, the halo rows the fill read, :mod:`.halo`) and back-propagates through
it at once. A stage then holds one chunk's activations instead of all of them, for one more forward
per chunk; the results are the same bit for bit. With ``recompute="auto"`` the first step recomputes and
measures the bytes autograd keeps for its last chunk; from the next step on a stage recomputes only if
keeping every chunk's activations would take more than a quarter of the memory its device has free
(:func:`decide_recompute`, once per runtime).

The **exact pass** (inference, and the pass that fills a call's history before its first step) runs
one chunk per way, whole partitions, halo rows exchanged fresh, stage after stage. Both passes run
a chunk with the one :func:`run_chunk`.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..graph.chunks import ChunkedGraph
from ..model.errors import UnsupportedModelError
from ..model.inputs import CallInputs, Localizer, fingerprint
from .context import ChunkContext
from .halo import HaloPass
from .history import CallHistory
from .program import signature
from .rows import RowCheck
from .runtime import Runtime
from .sites import kind_of, same_as_first_chunk, site_keys
from .tree import flatten, unflatten
from .statistics import Statistics, StatisticsHistory


@dataclass
class ChunkRecord:
    """One chunk's run: what the drain needs of it."""

    chunk: int
    ctx: Optional[ChunkContext]
    received: Dict[str, Any]
    sent: Dict[str, Any]
    out: Optional[Tensor]
    activation: Optional[str]
    rng: Optional[Tuple[Tensor, Optional[Tensor]]] = None   # set when the drain replays the chunk
    key: Any = None                                          # the chunk's key on the stage link


@dataclass
class CallRecord:
    """What the fill of one call of the model keeps for its drain."""

    runtime: Runtime
    run: HaloPass
    chunks: List[ChunkRecord]
    localizer: Optional[Localizer] = None
    runner: Any = None
    statistics: Optional[StatisticsHistory] = None  # historical BatchNorm sums (per_chunk_statistics="history")


# ---------------------------------------------------------------------------------------------
# passes
# ---------------------------------------------------------------------------------------------


def fill(rt: Runtime, inputs: CallInputs, step: int, call: int) -> Tuple[Tensor, CallRecord]:
    """The forward of the ``call``-th call of the model in training step ``step`` (module docstring)."""
    plan, grid = rt.plan, rt.grid
    history = rt.history.of(call)
    use_history = plan.chunks_per_way > 1
    replay = rt.recompute
    if use_history:
        history.begin_step(step, rt.config.snapshot_period, keep_start=True,  # replays read the start rows
                           smoothing=rt.config.smoothing)
    run = rt.halo.begin(history, rt.schedule.clocks(step), use_history, use_history)
    localizer = Localizer(inputs, rt.chunked, rt.adjacency)
    sig = signature(rt.module, inputs)
    runner, activation = rt.programs.runner(inputs), rt.programs.next_activation(inputs)
    start, end = rt.way_bounds[grid.way], rt.way_bounds[grid.way + 1]
    rt.comm.counting, rt.comm.boundary_dtype = True, rt.config.boundary_dtype
    chunks: List[ChunkRecord] = []
    reference, mine, check = None, None, None
    order = rt.schedule.order(step, grid.way)
    stat_history = rt.statistics_history(call)
    measure = replay and rt.recompute_pending
    ahead = rt.config.overlap and grid.prev is not None
    for i, c in enumerate(order):
        if reference is None:  # the pass's first chunk is checked (every chunk makes the same calls)
            check = _row_check(rt, rt.chunked[0].chunks[c].rows)
        keep = not replay or i == len(order) - 1  # the last chunk's drain comes next: nothing to save by replaying
        rng = None if keep else _rng_state(rt.comm.device)
        with torch.enable_grad() if keep else torch.no_grad(), _SavedBytes(measure and keep) as saved, \
                rt.timeline.chunk("fill", c, i == 0):
            rec = run_chunk(rt, run, localizer, rt.chunked, c, runner, ("train", sig, c), plan.chunks_per_way == 1,
                            init=False, check=check if reference is None else None, train=True, protect=not keep,
                            next_key=("train", sig, order[i + 1]) if ahead and i + 1 < len(order) else None,
                            statistics=stat_history, last=i == len(order) - 1)
        if measure and keep:
            decide_recompute(rt, saved.bytes, rt.chunked[0].chunks[c].rows)
        keys = site_keys(rec.ctx.sites)
        if reference is None:
            reference = keys
            rt.sites.record(kind_of(rt.module.training, sig), keys)
        else:
            same_as_first_chunk(keys, reference)
        lg = rec.ctx.lg
        if grid.is_last:
            out = _check_output(rec.out, lg.rows)
            if mine is None:
                mine = out.new_empty((end - start, *out.shape[1:]))
            mine[lg.start - start:lg.end - start] = out.detach()
        else:
            rt.link.send(("train", sig, c), rec.sent, activation)
        if rng is not None:  # the drain replays it: keep what it received and its random state only
            rec = ChunkRecord(c, None, rec.received, {}, None, rec.activation, rng, rec.key)
        chunks.append(rec)
    with rt.timeline.chunk("fill", -1, True, "output"):  # stages before the last wait here: the bubble
        full = share_output(rt, mine, start, end, ("train", sig))
    rt.comm.flush()
    rt.comm.counting, rt.comm.boundary_dtype = False, None
    if check is not None:
        _verdict(rt, check)
    if use_history:  # every row written, with this step's weights: how far the stale reads were (:mod:`.staleness`)
        rt.meter.measure(run)
        if stat_history is not None and rt.meter.on:
            stat_history.measure(rt.meter, rt.module_names)
        history.written = step
    return full[rt.graph.inv], CallRecord(rt, run, chunks, localizer, runner, stat_history)


def drain(grad: Tensor, record: CallRecord) -> None:
    """The backward of one call's fill: its chunks in reverse order (module docstring)."""
    rt = record.runtime
    grid = rt.grid
    record.run.prepare(rt.training_graphs())
    rt.comm.counting, rt.comm.boundary_dtype = True, rt.config.boundary_dtype
    grad_new = grad[rt.graph.perm] if grid.is_last else None
    order = record.chunks[::-1]
    ahead = rt.config.overlap and not grid.is_last
    for i, rec in enumerate(order):
        key = rec.key
        with rt.timeline.chunk("drain", rec.chunk, i == 0):
            if i == 0 and not grid.is_last:  # sent with the next stage's first gradients: the bubble's wait
                rt.link.expect_grads(record.chunks[-1].sent)
            if rec.rng is not None:
                rec = _replay(record, rec)
            drain_chunk(rt, rec, key, grad_new, first=i == 0,
                        next_key=order[i + 1].key if ahead and i + 1 < len(order) else None)
    rt.comm.flush()
    rt.comm.counting, rt.comm.boundary_dtype = False, None
    record.run.history.clear_grads()


def exact(rt: Runtime, inputs: CallInputs, history: Optional[CallHistory] = None,
          statistics: Optional[StatisticsHistory] = None) -> Tensor:
    """One chunk per way, halo rows fresh, stage after stage; with ``history``, also fills it (and
    ``statistics``, the historical BatchNorm sums of every chunk)."""
    grid = rt.grid
    cgs, w = rt.way_chunked, grid.way
    init = history is not None
    rt.comm.counting = False
    run = rt.halo.begin(history, torch.zeros(grid.ways, dtype=torch.long), False, init)
    sig = signature(rt.module, inputs)
    lg = cgs[0].chunks[w]
    check = _row_check(rt, lg.rows)
    rec = run_chunk(rt, run, Localizer(inputs, cgs, rt.adjacency), cgs, w, rt.programs.runner(inputs),
                    ("exact", sig, w), True, init=init, check=check, train=False,
                    statistics=statistics if init else None)
    rt.sites.record(kind_of(rt.module.training, sig), site_keys(rec.ctx.sites))
    if grid.next is not None:
        rt.link.send(("exact", sig, w), rec.sent, rt.programs.next_activation(inputs))
    full = share_output(rt, rec.out, lg.start, lg.end, ("exact", sig))
    rt.comm.flush()
    if check is not None:
        _verdict(rt, check)
    return full[cgs[0].inv]


def prepare_history(rt: Runtime, inputs: CallInputs, call: int, step: int = 0) -> None:
    """Before a training call of step ``step``: its history is filled by an exact pass the first time,
    again when the per-edge inputs (edge weights, attributes, adjacency values) on the same graph
    changed, since they change what layers compute everywhere, degrees included (new node features, by
    contrast, reach history chunk by chunk, as the algorithm intends), and when a staleness bound asks
    for it: ``max_age`` (the step would read rows more updates old) or ``max_staleness`` (the last
    step's drift passed it; :meth:`pyg_pipe.engine.engine.GNNPipeEngine` decides over all ranks)."""
    if rt.plan.chunks_per_way == 1 or rt.plan.streaming:
        return
    history = rt.history.of(call)
    tensors = inputs.edge_tensors()
    refill = False
    if not (history.initialised and _same_objects(history.edge_inputs, tensors)):
        digest = tuple(fingerprint(t) for t in tensors)
        refill = not history.initialised or bool(history.edge_inputs and digest != history.edge_inputs[-1])
        history.edge_inputs = tuple((weakref.ref(t), t._version) for t in tensors) + (digest,)
    if not refill and (history.refresh_due or (rt.config.max_age is not None
                                               and history.age_at(step, rt.config.snapshot_period)
                                               > rt.config.max_age)):
        refill = True
        rt.meter.refreshes += 1
    if refill:
        with torch.no_grad():
            exact(rt, inputs, history, rt.statistics_history(call))
        history.renew()  # the T2 anchor is renewed too
        history.initialised = True
        history.refresh_due = False


def _same_objects(seen: tuple, tensors: List[Tensor]) -> bool:
    """Whether ``tensors`` are the very objects of the last call, unchanged in place (alive, same version):
    then their values are the same and the digest need not be taken again. Held by weak reference, as an
    ``id`` alone is reused once a tensor is freed (a sparse input's values, taken anew each call, die at
    once): matching a new tensor by a reused ``id`` would skip a refill on one rank and not another."""
    if not seen or len(seen) - 1 != len(tensors):
        return False
    return all(ref() is t and version == t._version for (ref, version), t in zip(seen[:-1], tensors))


# ---------------------------------------------------------------------------------------------
# one chunk
# ---------------------------------------------------------------------------------------------


def run_chunk(rt: Runtime, run: HaloPass, localizer: Localizer, cgs: List[ChunkedGraph], c: int, runner,
              link_key, one_per_way: bool, init: bool, check: Optional[RowCheck], train: bool,
              received: Optional[Dict[str, Any]] = None, protect: bool = False, next_key=None,
              statistics: Optional[StatisticsHistory] = None, last: bool = False) -> ChunkRecord:
    """Chunk ``c`` of the chunking ``cgs`` through this rank's stage: inputs cut to the chunk, values
    from the previous stage, the stage's program. ``check``: the row check watches this run.
    ``received``: a replay (module docstring), with the values the fill received. ``protect``: the
    program gets copies of the received values (a replay needs them intact, and a reversible block
    frees its input's storage). ``next_key``: the receives of the chunk run next are posted as soon as
    this chunk's arrived (:mod:`.link`, overlap). ``statistics``: historical BatchNorm sums of the call
    (:mod:`.statistics`); ``last``: the chunk runs last in its way's order (it moves running statistics)."""
    grid = rt.grid
    lg = cgs[0].chunks[c]
    replay = received is not None
    prime = statistics if one_per_way else None  # an exact pass fills the historical sums of every chunk
    if statistics is not None and not one_per_way:
        stats = Statistics(rt.comm, None, None, lg.rows, update_running=not init, replay=replay, history=statistics,
                           chunk=c, last=last)
    elif one_per_way and grid.ways > 1:
        stats = Statistics(rt.comm, grid.stage_group, rt.way_rows, lg.rows, update_running=not init, replay=replay,
                           prime=prime)
    else:
        stats = Statistics(rt.comm, None, None, lg.rows, update_running=not init, replay=replay, prime=prime)
    ctx = ChunkContext(cgs[0], lg, run, localizer.resolver(c, rt.derive), stats, rt.layer_cache, check, replay)
    stage = runner.stage
    with ctx:
        args, kwargs = localizer.localize(c, ctx)
        if received is None:
            received = rt.link.recv(link_key, stage.inputs, train) if stage is not None and grid.prev is not None \
                else {}
            if next_key is not None and stage is not None:
                rt.link.prefetch(next_key, stage.inputs)
        given = {k: _copied(v) for k, v in received.items()} if protect else received
        if check is None:
            sent, out = runner.run(args, kwargs, given)
        else:
            check.returned(list(given.values()))
            with check:
                sent, out = runner.run(args, kwargs, given)
    return ChunkRecord(c, ctx, received, sent, out, stage.activation if stage is not None else None, key=link_key)


def _replay(record: CallRecord, rec: ChunkRecord) -> ChunkRecord:
    """The chunk's fill again, with autograd (module docstring)."""
    rt = record.runtime
    dev = rt.comm.device
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), torch.enable_grad():
        torch.set_rng_state(rec.rng[0])
        if rec.rng[1] is not None:
            torch.cuda.set_rng_state(rec.rng[1], dev)
        return run_chunk(rt, record.run, record.localizer, rt.chunked, rec.chunk, record.runner, None, False,
                         init=False, check=None, train=True, received=rec.received, statistics=record.statistics)


class _SavedBytes:
    """Counts the bytes autograd saves for the backward inside the block (when ``on``)."""

    def __init__(self, on: bool):
        self.on, self.bytes, self._hooks = on, 0, None

    def _pack(self, t: Tensor):
        self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self) -> "_SavedBytes":
        if self.on:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
        return False


def decide_recompute(rt: Runtime, saved_bytes: int, rows: int) -> None:
    """``recompute="auto"``: after the first step's last chunk kept ``saved_bytes`` for ``rows`` rows, keep
    every chunk's activations from now on if all of them (scaled to the way's rows) fit a quarter of the
    memory the device has free; else go on recomputing. Decided once; results are the same either way."""
    from .tiers import free_memory
    way_rows = rt.way_rows[rt.grid.way]
    estimate = saved_bytes * way_rows / max(rows, 1)
    rt.recompute = estimate > free_memory(rt.comm.device) // 4
    rt.recompute_pending = False


def _copied(value):
    leaves, structure = flatten(value)
    return unflatten([t.clone() for t in leaves], structure)


def _rng_state(device: torch.device) -> Tuple[Tensor, Optional[Tensor]]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def drain_chunk(rt: Runtime, rec: ChunkRecord, key, grad_new: Optional[Tensor], first: bool, next_key=None) -> None:
    """One chunk's backward: the gradients of what it sent (or of its output rows), autograd through the
    chunk, then the gradients of what it received back to the previous stage. ``key``: the chunk's key on
    the stage link; ``next_key``: the chunk drained next, whose gradients' receives are posted before this
    chunk's backward runs (overlap)."""
    grid = rt.grid
    lg = rec.ctx.lg
    with rec.ctx:
        if grid.is_last:
            roots = [rec.out] if rec.out.requires_grad else []
            grads = [grad_new[lg.start:lg.end].to(rec.out.dtype)] if roots else []
        else:
            roots, grads = rt.link.recv_grads(key, rec.sent)
            if next_key is not None:
                rt.link.prefetch_grads(next_key)
        if roots:
            torch.autograd.backward(roots, grads)
    if grid.prev is not None:
        rt.link.send_grads(rec.chunk, rec.received, rec.activation, first=first)


def share_output(rt: Runtime, mine: Optional[Tensor], start: int, end: int, key) -> Tensor:
    """The whole output (new vertex order) on every rank: each last-stage way sends its rows."""
    grid, comm = rt.grid, rt.comm
    S = grid.stages
    spec = rt.output_specs.get(key)
    if spec is None:  # the output's trailing shape and dtype, told once per kind of call
        if grid.is_last:
            mine = _check_output(mine, end - start)
            spec = (tuple(mine.shape[1:]), mine.dtype)
            if grid.way == 0:
                for r in range(comm.world_size):
                    if r // grid.ways != S - 1:
                        comm.send_object(spec, r)
        else:
            spec = comm.recv_object(grid.rank_of(S - 1, 0))
        rt.output_specs[key] = spec
    shape, dtype = spec
    full = torch.empty((rt.plan.num_nodes, *shape), dtype=dtype, device=comm.device)
    bounds = rt.way_bounds
    if grid.is_last:
        full[start:end] = mine
        for r in range(comm.world_size):
            if r != comm.rank:
                comm.send(mine, r, "output")
    for w in range(grid.ways):
        src = grid.rank_of(S - 1, w)
        if src != comm.rank:
            a, b = bounds[w], bounds[w + 1]
            full[a:b] = comm.recv((b - a, *shape), dtype, src)
    return full


def _row_check(rt: Runtime, rows: int) -> Optional[RowCheck]:
    """A check for operations that combine vertex rows outside layers (:mod:`.rows`), on the first
    pass of each mode of a plan that cuts the graph (the same pass on every rank)."""
    plan = rt.plan
    if plan.num_chunks == 1 or ("train" if rt.module.training else "eval") in rt.rows_checked:
        return None
    cut = f"num_chunks={plan.num_chunks}" + (f" over {plan.ways} graph-parallel ways" if plan.ways > 1 else "")
    return RowCheck(rows, rt.module_names, cut)


def _verdict(rt: Runtime, check: RowCheck) -> None:
    """After the checked pass: every rank raises the same error if any rank found an operation."""
    rt.rows_checked.add("train" if rt.module.training else "eval")
    check.verdict(rt.comm)


def _check_output(out, rows: int) -> Tensor:
    if not isinstance(out, Tensor) or out.dim() == 0 or out.size(0) != rows:
        what = f"a {type(out).__name__}" if not isinstance(out, Tensor) else f"shape {tuple(out.shape)}"
        raise UnsupportedModelError(
            f"The pipelined model must return one tensor with a row per vertex; its forward returned {what} for a "
            f"chunk of {rows} vertices. Return the node embeddings or logits only (compute auxiliary losses outside "
            f"the model).")
    return out
