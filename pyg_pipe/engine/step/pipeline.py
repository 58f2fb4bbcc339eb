"""One pass of the model over this rank's chunks: the fill and the drain of a training step, and the
exact pass.

**Fill** (the forward of one call of the model in a training step), on the rank of stage ``s``, way
``w``, with the step's chunk order ``o`` (:mod:`..plan.schedule`)::

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
inputs, same random numbers, the halo rows the fill read, :mod:`..runtime.halo`) and back-propagates through
it at once. A stage then holds one chunk's activations instead of all of them, for one more forward
per chunk; the results are the same bit for bit. With ``recompute="auto"`` the first step recomputes and
measures what a kept chunk and a replayed one hold (:func:`sample_memory`); from the next step on a stage
keeps every chunk's activations if the memory model's peak with keeping fits ``memory_budget`` or the
device's free memory (:func:`decide_recompute`, once per runtime; :mod:`..plan.memory_cost`).

The **exact pass** (inference, and the pass that fills a call's history before its first step) runs
one chunk per way, whole partitions, halo rows exchanged fresh, stage after stage. Both passes run
a chunk with the one :func:`~.chunk.run_chunk` (:mod:`.chunk`).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from ...model.inputs import CallInputs, fingerprint
from ...model.localize import Localizer
from ..runtime.halo import HaloPass
from ..runtime.history import CallHistory
from ..runtime.program import signature
from ..runtime.runtime import Runtime
from ..runtime.sites import kind_of, same_as_first_chunk, site_keys
from ..runtime.staleness import SampledRows
from ..runtime.statistics import StatisticsHistory
from ..tree import unpack_rows
from .checks import call_kind, check_output, row_check, verdict
from .chunk import (ChunkRecord, SavedBytes, decide_recompute, drain_chunk, input_storages, rng_state, run_chunk,
                    same_rng, sample_memory, share_output)


@dataclass
class CallRecord:
    """What the fill of one call of the model keeps for its drain."""

    runtime: Runtime
    run: HaloPass
    chunks: List[ChunkRecord]
    localizer: Optional[Localizer] = None
    runner: Any = None
    statistics: Optional[StatisticsHistory] = None  # historical BatchNorm sums (per_chunk_statistics="history")
    structure: Any = None                           # how the model's output unpacks (tree.unpack_rows)


# ---------------------------------------------------------------------------------------------
# passes
# ---------------------------------------------------------------------------------------------


def fill(rt: Runtime, inputs: CallInputs, step: int, call: int) -> Tuple[Tensor, CallRecord]:
    """The forward of the ``call``-th call of the model in training step ``step`` (module docstring)."""
    plan, grid = rt.plan, rt.grid
    history = rt.history.of(call)
    use_history = plan.chunks_per_way > 1
    if rt.recompute_pending and rt.memory.pending is not None:  # (a strategy decides it after the optimizer step)
        decide_recompute(rt)
    replay = rt.recompute
    rt.release_exact()
    if use_history:
        history.begin_step(step, rt.config.snapshot_period, keep_start=True,  # replays read the start rows
                           smoothing=rt.config.smoothing)
    run = rt.halo.begin(history, rt.schedule.clocks(step), use_history, use_history)
    localizer = Localizer(inputs, rt.chunked, rt.adjacency, rt.tables, rt.keep_inputs)
    localizer.call = rt.call
    sig = signature(rt.module, inputs)
    kind = call_kind(rt, inputs, sig)
    runner, activation = rt.programs.runner(inputs), rt.programs.next_activation(inputs)
    start, end = rt.way_bounds[grid.way], rt.way_bounds[grid.way + 1]
    rt.comm.counting, rt.comm.boundary_dtype = True, rt.config.boundary_dtype
    chunks: List[ChunkRecord] = []
    reference, mine, check, structure = None, None, None, None
    order = rt.schedule.order(step, grid.way)
    stat_history = rt.statistics_history(call)
    measure = not rt.memory.done  # the first training fill: what a chunk holds (..plan.memory_cost)
    if measure:
        rt.memory.exclude = input_storages(rt.module, inputs)
    ahead = rt.config.overlap and grid.prev is not None
    watching = use_history and rt.meter.on and rt.meter.random is None  # (the first step: whether the fill draws
    if watching:                                                        # random numbers, staleness.py)
        rt.meter.watch(rng_state(rt.comm.device))
    for i, c in enumerate(order):
        if reference is None:  # every chunk of the plan's first pass is checked (each runs to its end)
            check = row_check(rt, rt.chunked[0].chunks[c].rows, kind)
        elif check is not None:
            check.next_chunk(rt.chunked[0].chunks[c].rows)
        keep = not replay or i == len(order) - 1  # the last chunk's drain comes next: nothing to save by replaying
        rng = None if keep else rng_state(rt.comm.device)
        with torch.enable_grad() if keep else torch.no_grad(), \
                SavedBytes(measure and keep, rt.memory.exclude) as saved, rt.timeline.chunk("fill", c, i == 0):
            rec = run_chunk(rt, run, localizer, rt.chunked, c, runner, ("train", sig, c), plan.chunks_per_way == 1,
                            init=False, check=check, train=True, protect=not keep,
                            next_key=("train", sig, order[i + 1]) if ahead and i + 1 < len(order) else None,
                            statistics=stat_history, last=i == len(order) - 1)
        if measure:
            sample_memory(rt, rec, saved if keep else None, rt.chunked[0].chunks[c].rows)
        keys = site_keys(rec.ctx.sites)
        if reference is None:
            reference = keys
            rt.sites.record(kind_of(rt.module.training, sig), keys)
        else:
            same_as_first_chunk(keys, reference)
        lg = rec.ctx.lg
        if grid.is_last:
            out, structure = check_output(rec.out, lg.rows, rt), rec.structure
            if mine is None:
                mine = out.new_empty((end - start, *out.shape[1:]))
            mine[lg.start - start:lg.end - start] = out.detach()
        else:
            rt.link.send(("train", sig, c), rec.sent, activation)
        if rng is not None:  # the drain replays it: keep what it received and its random state only
            rec = ChunkRecord(c, None, rec.received, {}, None, rec.activation, rng, rec.key)
        chunks.append(rec)
    with rt.timeline.chunk("fill", -1, True, "output"):  # stages before the last wait here: the bubble
        full = share_output(rt, mine, start, end, ("train", sig), structure)
    rt.comm.flush()
    rt.comm.counting, rt.comm.boundary_dtype = False, None
    rt.memory.done = True
    if check is not None:
        verdict(rt, check, kind)
    if use_history:  # every row written, with this step's weights: how far the stale reads were (staleness.py)
        if watching:
            rt.meter.watched(rng_state(rt.comm.device))
        rt.meter.measure(run)
        if stat_history is not None and rt.meter.on and not rt.meter.random:  # (random: dropout noise, as above)
            stat_history.measure(rt.meter, rt.module_names)
        history.written = step
    return full[rt.graph.inv], CallRecord(rt, run, chunks, localizer, runner, stat_history,
                                          rt.output_specs[("train", sig)][2])


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
    if rt.memory.pending is None:  # the first drain: what the pending cross-chunk gradients took (..plan.memory_cost)
        h = record.run.history
        rt.memory.pending = h.pending.peak + sum(g.numel() * g.element_size() for g in h.grads.values()
                                               if g.device == rt.comm.device)
    record.run.history.clear_grads()


def exact(rt: Runtime, inputs: CallInputs, history: Optional[CallHistory] = None,
          statistics: Optional[StatisticsHistory] = None) -> Any:
    """One chunk per way, halo rows fresh, stage after stage; with ``history``, also fills it (and
    ``statistics``, the historical BatchNorm sums of every chunk). Returns the model's output, whole."""
    grid = rt.grid
    cgs, w = rt.way_chunked, grid.way
    init = history is not None
    rt.comm.counting = False
    run = rt.halo.begin(history, torch.zeros(grid.ways, dtype=torch.long), False, init)
    sig = signature(rt.module, inputs)
    lg = cgs[0].chunks[w]
    kind = call_kind(rt, inputs, sig)
    check = row_check(rt, lg.rows, kind)
    localizer = Localizer(inputs, cgs, rt.adjacency, rt.tables, rt.keep_inputs)
    rec = run_chunk(rt, run, localizer, cgs, w, rt.programs.runner(inputs),
                    ("exact", sig, w), True, init=init, check=check, train=False,
                    statistics=statistics if init else None)
    rt.sites.record(kind_of(rt.module.training, sig), site_keys(rec.ctx.sites))
    if grid.next is not None:
        rt.link.send(("exact", sig, w), rec.sent, rt.programs.next_activation(inputs))
    full = share_output(rt, rec.out, lg.start, lg.end, ("exact", sig), rec.structure)
    rt.comm.flush()
    if check is not None:
        verdict(rt, check, kind)
    return unpack_rows(full[cgs[0].inv], rt.output_specs[("exact", sig)][2])


def prepare_history(rt: Runtime, inputs: CallInputs, call: int, step: int = 0) -> None:
    """Before a training call of step ``step``: its history is filled by an exact pass the first time,
    again when the per-edge inputs (edge weights, attributes, adjacency values) on the same graph
    changed, since they change what layers compute everywhere, degrees included (new node features, by
    contrast, reach history chunk by chunk, as the algorithm intends), and when a staleness bound asks
    for it: ``max_age`` (the step would read rows more updates old) or ``max_staleness`` (the last
    step's drift passed it; :meth:`..engine.GNNPipeEngine` decides over all ranks)."""
    rt.step, rt.call = step, call
    if rt.plan.chunks_per_way == 1 or rt.plan.streaming:
        return
    history = rt.history.of(call)
    if rt.meter.probe_due(step):
        probe(rt, inputs, history, call)
    holders = inputs.edge_tensors(holders=True)
    refill = False
    if not (history.initialised and _same_objects(history.edge_inputs, holders)):
        digest = tuple(fingerprint(t) for t in inputs.edge_tensors())
        refill = not history.initialised or bool(history.edge_inputs and digest != history.edge_inputs[-1])
        history.edge_inputs = tuple((weakref.ref(t), t._version) for t in holders) + (digest,)
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


def probe(rt: Runtime, inputs: CallInputs, history: CallHistory, call: int) -> None:
    """The staleness meter's probe (:mod:`..runtime.staleness`: a model that draws random numbers): the
    exact pass with every module in eval mode, without gradients, writing no history, each site's rows
    sampled; the modules' modes and the random state are left as they were."""
    sampled = SampledRows(history, rt.meter.SAMPLE)
    modes = [(m, m.training) for m in rt.module.modules()]
    dev = rt.comm.device
    try:
        rt.module.eval()
        with torch.no_grad(), same_rng(rng_state(dev), dev):
            exact(rt, inputs, sampled)
    finally:
        for m, mode in modes:
            m.training = mode
    rt.meter.probed(call, sampled.rows)


def _same_objects(seen: tuple, tensors: List[Tensor]) -> bool:
    """Whether ``tensors`` are the very objects of the last call, unchanged in place (alive, same version):
    then their values are the same and the digest need not be taken again. A sparse adjacency is the adjacency
    itself, whose version counter its values and indices share (its values come out as a new tensor each call:
    compared by those, it was digested again every step, a conversion and a pass over its edges with the
    host reading each sum). Held by weak reference, as an ``id`` alone is reused once a tensor is freed: matching
    a new tensor by a reused ``id`` would skip a refill on one rank and not another."""
    if not seen or len(seen) - 1 != len(tensors):
        return False
    return all(ref() is t and version == t._version for (ref, version), t in zip(seen[:-1], tensors))


# ---------------------------------------------------------------------------------------------
# one chunk
# ---------------------------------------------------------------------------------------------


def _replay(record: CallRecord, rec: ChunkRecord) -> ChunkRecord:
    """The chunk's fill again, with autograd (module docstring)."""
    rt = record.runtime
    dev = rt.comm.device
    with same_rng(rec.rng, dev), torch.enable_grad():
        return run_chunk(rt, record.run, record.localizer, rt.chunked, rec.chunk, record.runner, None, False,
                         init=False, check=None, train=True, received=rec.received, statistics=record.statistics)


