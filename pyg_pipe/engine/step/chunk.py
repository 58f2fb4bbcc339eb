"""One chunk through this rank's stage, forward (:func:`run_chunk`) and backward (:func:`drain_chunk`), and
what the passes around it share: the whole output gathered on every rank, and the recomputation decision.

Both the fill and the exact pass (:mod:`.pipeline`) run a chunk with :func:`run_chunk`; a replay (the
drain recomputing a chunk) runs it again with what the fill received."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ...graph.chunks import ChunkedGraph
from ...model.localize import Localizer
from ..context import ChunkContext
from ..runtime.halo import HaloPass
from ..runtime.runtime import Runtime
from ..runtime.statistics import Statistics, StatisticsHistory
from ..tree import flatten, pack_rows, unflatten
from .checks import check_output, run_checked
from .rows import RowCheck
from ..plan.memory_cost import add_storage, chunks_to_replay, predict, recompute_choice, storages

log = logging.getLogger(__name__)


@dataclass
class ChunkRecord:
    """One chunk's run: what the drain needs of it."""

    chunk: int
    ctx: Optional[ChunkContext]
    received: Dict[str, Any]
    sent: Dict[str, Any]
    out: Optional[Tensor]                                    # the last stage's output, packed (tree.pack_rows)
    activation: Optional[str]
    rng: Optional[Tuple[Tensor, Optional[Tensor]]] = None   # set when the drain replays the chunk
    key: Any = None                                          # the chunk's key on the stage link
    structure: Any = None                                    # how to unpack ``out`` (None: one tensor)


def run_chunk(rt: Runtime, run: HaloPass, localizer: Localizer, cgs: List[ChunkedGraph], c: int, runner,
              link_key, one_per_way: bool, init: bool, check: Optional[RowCheck], train: bool,
              received: Optional[Dict[str, Any]] = None, protect: bool = False, next_key=None,
              statistics: Optional[StatisticsHistory] = None, last: bool = False) -> ChunkRecord:
    """Chunk ``c`` of the chunking ``cgs`` through this rank's stage: inputs cut to the chunk, values
    from the previous stage, the stage's program. ``check``: the row check watches this run.
    ``received``: a replay (module docstring), with the values the fill received. ``protect``: the
    program gets copies of the received values (a replay needs them intact, and a reversible block
    frees its input's storage). ``next_key``: the receives of the chunk run next are posted as soon as
    this chunk's arrived (:mod:`..runtime.link`, overlap). ``statistics``: historical BatchNorm sums of the call
    (:mod:`.norms`); ``last``: the chunk runs last in its way's order (it moves running statistics)."""
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
        sent, out = run_checked(rt, check, runner, args, kwargs, given)
    out, structure = pack_rows(out, lg.rows)
    return ChunkRecord(c, ctx, received, sent, out, stage.activation if stage is not None else None, key=link_key,
                       structure=structure)


class SavedBytes:
    """Counts the storages autograd saves for the backward inside the block (when ``on``), each once, leaving
    out those in ``exclude`` (the parameters', the user's inputs): ``storages`` (data pointer -> bytes).

    ``no_backward``: the graph recorded is never run backward (a measuring pass), so what is saved is kept
    detached. A pack hook handing back the tensor itself makes a saved output (``relu`` saves its result) hold
    its own ``grad_fn``: a cycle through autograd's C++ nodes that Python's collector cannot see, broken only
    by a backward. Without one, the pass's activations stayed alive for the whole run (33 tensors, 43 MB on the
    measuring rank of a 16-layer GCNII, 2026-11-29)."""

    def __init__(self, on: bool, exclude=frozenset(), no_backward: bool = False):
        self.on, self.exclude, self.storages, self._hooks = on, exclude, {}, None
        self.no_backward = no_backward

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, t: Tensor):
        add_storage(self.storages, t, self.exclude)
        return t.detach() if self.no_backward else t

    def __enter__(self) -> "SavedBytes":
        if self.on:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
        return False


def sample_memory(rt: Runtime, rec: "ChunkRecord", saved: Optional[SavedBytes], rows: int) -> None:
    """The first training fill's measure of what chunk ``rec`` holds until its drain (:mod:`..plan.memory_cost`):
    kept (``saved``: what autograd saved, with what it received, sent and returned) or replayed (what it
    received)."""
    sample, exclude = rt.memory, rt.memory.exclude
    received: dict = {}
    for t in flatten(rec.received)[0]:
        if isinstance(t, Tensor):
            add_storage(received, t, exclude)
    if saved is None:
        sample.replayed(rows, received)
        return
    held = dict(saved.storages)
    for t in flatten(rec.sent)[0] + ([rec.out] if rec.out is not None else []):
        if isinstance(t, Tensor):
            add_storage(held, t, exclude)
    held.update(received)
    sample.kept(rows, held, received)
    if rec.ctx is not None:  # the layer calls the chunk ran (the groups of an untraced forward, for the transient)
        sample.layers = max(sample.layers, sum(rec.ctx.counts.values()))


def input_storages(module: torch.nn.Module, inputs) -> set:
    """The storages a chunk's measure leaves out: the call's inputs (the user's data) and ``module``'s parameters."""
    out: set = set()
    for t in flatten((inputs.args, inputs.kwargs))[0] + list(module.parameters()):
        if isinstance(t, Tensor):
            out |= storages(t)
    return out


def decide_recompute(rt: Runtime, prediction=None) -> str:
    """``recompute="auto"``, once the first step (fill, drain and, with a strategy, the optimizer step) has
    run: replay the chunks from the next step on unless the predicted peak of keeping them fits the budget
    (:func:`~..plan.memory_cost.recompute_choice`). ``prediction``: the strategy's (it counts the optimizer
    state); else made here. Returns the line that says why (logged). Results are the same either way."""
    from ..runtime.tiers import free_memory
    if prediction is None:
        prediction = predict(rt, rt.module.parameters())
    per_way, ways = rt.plan.chunks_per_way, rt.grid.ways
    rt.recompute, line = recompute_choice(
        prediction, rt.config.memory_budget, free_memory(rt.comm.device),
        lambda room: chunks_to_replay(rt.memory, rt.way_rows[rt.grid.way], per_way, ways, room))
    rt.recompute_pending = False
    line = line.replace("pyg_pipe:", f"pyg_pipe rank {rt.comm.rank}:", 1)
    log.info(line)
    return line


def _copied(value):
    leaves, structure = flatten(value)
    return unflatten([t.clone() for t in leaves], structure)


def rng_state(device: torch.device) -> Tuple[Tensor, Optional[Tensor]]:
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


def share_output(rt: Runtime, mine: Optional[Tensor], start: int, end: int, key, structure=None) -> Tensor:
    """The whole output (new vertex order, packed: :func:`~..tree.pack_rows`) on every rank: each last-stage
    way sends its rows. ``rt.output_specs[key]`` then holds its trailing shape, dtype and ``structure``."""
    grid, comm = rt.grid, rt.comm
    S = grid.stages
    spec = rt.output_specs.get(key)
    if spec is None:  # the output's trailing shape, dtype and structure, told once per kind of call
        if grid.is_last:
            mine = check_output(mine, end - start, rt)
            spec = (tuple(mine.shape[1:]), mine.dtype, structure)
            if grid.way == 0:
                for r in range(comm.world_size):
                    if r // grid.ways != S - 1:
                        comm.send_object(spec, r)
        else:
            spec = comm.recv_object(grid.rank_of(S - 1, 0))
        rt.output_specs[key] = spec
    shape, dtype, _ = spec
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


class same_rng:
    """Runs a block with a saved random state (``None``: as it is), leaving the outer state unchanged."""

    def __init__(self, state, device: torch.device):
        self.state, self.device = state, device

    def __enter__(self):
        if self.state is None:
            return
        self._fork = torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [])
        self._fork.__enter__()
        torch.set_rng_state(self.state[0])
        if self.state[1] is not None:
            torch.cuda.set_rng_state(self.state[1], self.device)

    def __exit__(self, *exc):
        if self.state is not None:
            self._fork.__exit__(*exc)
        return False
