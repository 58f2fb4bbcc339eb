"""``num_chunks="auto"`` under a memory budget: the first step made to fit before it runs.

The time model (:mod:`.chunk_cost`) picks the fewest chunks near the fastest step. Under a budget
(:func:`memory_room`: ``memory_budget``, or on an accelerator the least free memory of the ranks less
:data:`~.memory_cost.MARGIN`) the first step's counted peak per process is then estimated before it
(:func:`~.first_step.first_step_peak`: the candidate partition's structures and history rows counted, the
rest from one training pass of the model over a chunk, :func:`~..pass_memory.training_pass_memory`), and::

    k = the time model's chunks a way
    while the estimate at k does not fit and 2k <= min(64, N / W):   k = 2k, partition again
    fits at some k                     -> the first such k (the fewest: the least stale history)
    else, the history in host memory   -> the fewest k whose estimate fits with the history, its snapshots
       fits at some k (offload unset)     and pending gradients in the ``"host"`` tier (chosen here, said in
                                          the line, saved with the plan; results are the same in every tier)
    else                               -> the time model's k, and a warning naming the fixes

More chunks shrink a replayed chunk's activations (``a R / k``) but not what every chunk keeps (``b R``) nor
the history, which grows with the chunks' boundaries: past some count nothing more fits. Keeping the
activations (``recompute=False``) holds ``a R`` whatever ``k``: the count is not changed then, and the line
says so. The estimate is the widest stage's (:func:`~.first_step.stage_shares`: the stage split is made before
this, on the time model's chunks). Measured (docs/memory.md): 0.95 - 0.96 of the widest stage's counted peak in
the memory model after the same step, on 2 and 4 processes.

The memory is measured before the time model times anything: its larger probe runs the whole model over
``N / (2 S W)`` rows, half a stage's activations, and where that would take more than half the room the probe
chunks are made smaller (:func:`probe_scale`), so that choosing the plan is not what runs out of memory.

Everything is measured and estimated on one rank and broadcast (:func:`~.decide.root_decides`); the other ranks
take the same decisions from the broadcast numbers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ...graph.chunks import way_ptr
from .chunk_cost import MAX_PER_WAY, PROBES
from .decide import root_decides
from .first_step import PassMemory, chunking_bytes, first_step_peak, fresh_reads, history_rows, stage_shares
from .memory_cost import MB

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fitted:
    """What :func:`fit_memory` decided."""

    chunks: int
    perm: Tensor
    ptr: Tensor
    peak: Optional[int] = None         # the estimated first step's counted peak (bytes); None without a budget
    offload: Optional[str] = None      # "host" where only the history off the device fits


def memory_room(config, comm) -> Optional[int]:
    """The bytes the counted parts of a step may take on every process (:mod:`.memory_cost`): ``memory_budget``,
    or on an accelerator the least free memory over the ranks less :data:`~.memory_cost.MARGIN`; ``None`` on a
    CPU without a budget (the processes share the machine's memory: nothing to fit the count to)."""
    from ..runtime.tiers import free_memory
    from .memory_cost import MARGIN
    if config.memory_budget is not None:
        return int(config.memory_budget)
    if comm.device.type == "cpu":
        return None
    free = comm.all_gather_objects(free_memory(comm.device), "reading each device's free memory")
    return int(min(free) * (1 - MARGIN))


def measure_memory(pass_memory: Callable[[tuple, tuple], object], num_nodes: int, stages: int, ways: int, comm,
                   root: int) -> PassMemory:
    """:class:`~.first_step.PassMemory` from ``pass_memory`` (:func:`~..pass_memory.training_pass_memory` on the
    chunkings it is given) on ``root``, on the smaller probe chunk of the time model (``N / (8 S W)`` rows: a
    quarter of what its larger one holds), broadcast."""
    N = num_nodes
    C = min(N, ways * PROBES[1] * stages)
    probe = torch.linspace(0, N, C + 1).round().long()
    order = torch.arange(N)
    kept = []

    def measure() -> Tensor:
        kept.append(pass_memory((order, probe), (order, way_ptr(probe, ways))))
        return torch.tensor(kept[0].as_list(), dtype=torch.float64)
    measured = root_decides(measure, torch.zeros(6, dtype=torch.float64), comm, root, "measuring a chunk's memory")
    # the rank that measured keeps where the bytes were, group by group: it makes the estimate (fit_memory)
    return kept[0] if kept else PassMemory(*measured.tolist())


def probe_scale(m, room: int, num_nodes: int, stages: int, ways: int, notes: Optional[List[str]] = None) -> int:
    """How many times smaller the time model's probe chunks must be (a power of 2) for its larger pass, which
    holds the whole model's activations over ``N / (2 S W)`` rows (``m.saved`` a row), to take at most half of
    ``room``: on a device that the graph nearly fills, timing must not be what runs out of memory (said in a
    line when it does)."""
    rows = num_nodes / (PROBES[0] * stages * ways)
    scale = 1
    while m.saved * rows / scale > room / 2 and rows / scale > 1:
        scale *= 2
    if scale > 1:
        line = (f"pyg_pipe: num_chunks='auto': timing the model on chunks {scale}x smaller than usual (a pass of the "
                f"whole model over {rows:.0f} rows would hold about {m.saved * rows / MB:.0f} MB, more than half the "
                f"room for {room / MB:.0f} MB).")
        log.info(line)
        if notes is not None and line not in notes:
            notes.append(line)
    return scale


def _copies(config) -> int:
    """Buffers of every history row on the device: the buffer, T2's snapshot, the smoothed rows, the late gradients
    (none with an offload tier)."""
    return 0 if config.offload is not None else \
        1 + (config.snapshot_period is not None) + (config.smoothing is not None) + bool(config.late_gradients)


def first_step_estimate(m, config, inputs, stages: int, ways: int, per_way: int, perm: Tensor, ptr: Tensor,
                        shares=None, with_offload: bool = False):
    """``(on, off)``: :func:`~.first_step.first_step_peak` of the chunking ``(perm, ptr)`` (``per_way`` chunks a
    way) under ``config`` (its tier, copies and replay), and with the history in the host tier (``off``; the same as
    ``on`` unless ``with_offload``). With one chunk a way nothing is read from history (graph-parallel ways
    exchange their halos fresh: no rows held), and with one stage too nothing is replayed (the step keeps its
    activations, as one device's does)."""
    structures, edges = chunking_bytes(inputs.graphs, perm, ptr, ways)
    rows = history_rows(inputs.graphs, perm, ptr, ways) if per_way > 1 else 0
    pending = fresh_reads(inputs.graphs, perm, ptr) if rows and ways == 1 and not config.late_gradients else None
    replay = config.recompute != False and (per_way > 1 or stages > 1)  # noqa: E712
    on = first_step_peak(m, inputs.num_nodes, stages, ways, per_way, structures, edges, rows, _copies(config),
                         replay, offloaded=config.offload is not None, shares=shares, pending_rows=pending)
    off = first_step_peak(m, inputs.num_nodes, stages, ways, per_way, structures, edges, rows, 0, replay,
                          offloaded=True, shares=shares) if with_offload else on
    return on, off


def fit_memory(m, room: Optional[int], config, inputs, stages: int, ways: int, chunks: int, perm: Tensor,
               ptr: Tensor, partition: Callable[[int], Tuple[Tensor, Tensor]], comm, root: int,
               notes: Optional[List[str]] = None, split: Optional[Tuple[Sequence[int], Sequence[float]]] = None) \
        -> Fitted:
    """The module docstring's rule for ``chunks`` (the time model's count) cut as ``(perm, ptr)``, under ``room``
    bytes (:func:`memory_room`; ``None``: nothing to fit); ``m``: :func:`measure_memory`'s measures;
    ``partition(count)`` cuts the graph again; ``split``: the stages' layer groups and parameter bytes, so that the
    widest stage is estimated (``None``: the mean one; :func:`~.first_step.stage_shares`)."""
    if room is None or stages == 1:
        return Fitted(chunks, perm, ptr)
    N = inputs.num_nodes
    replay = config.recompute != False  # noqa: E712 - "auto" replays the first step, True every step
    may_offload = replay and config.offload is None
    cap = max(1, min(MAX_PER_WAY, N // ways))
    first = k = chunks // ways
    cuts = {k: (perm, ptr)}
    peaks: Dict[int, Tuple[int, int]] = {}   # chunks a way -> the estimate with the history on the device / in the tier
    said: Dict[int, object] = {}             # (root) chunks a way -> the estimate's parts
    while True:
        def estimate() -> Tensor:  # (on root, which measured: ``m`` has the detail there)
            shares = stage_shares(m, *split) if split is not None else None
            on, off = first_step_estimate(m, config, inputs, stages, ways, k, *cuts[k], shares, may_offload)
            said[k] = on
            return torch.tensor([on.peak, off.peak], dtype=torch.float64)
        got = root_decides(estimate, torch.zeros(2, dtype=torch.float64), comm, root,
                           "estimating the first step's memory").tolist()
        peaks[k] = (int(got[0]), int(got[1]))
        if peaks[k][0] <= room or k * 2 > cap or not replay:
            break
        k *= 2
        cuts[k] = partition(k * ways)
    offload = None
    if peaks[k][0] <= room:
        line = f"it fits{f' (the {first * ways} chunks the time model chose would not)' if k != first else ''}."
    elif any(off <= room for _, off in peaks.values()) and may_offload:
        k = min(j for j, (_, off) in peaks.items() if off <= room)
        offload = "host"
        line = (f"no count up to {max(peaks) * ways} fits with the history on the device; with the history, its "
                f"snapshots and pending gradients in host memory (offload='host', chosen here: the same results) "
                f"{k * ways} chunks are estimated at {peaks[k][1] / MB:.0f} MB, which fits.")
    elif not replay:
        k, line = first, "it does not fit; recompute='auto' or True replays the activations, which more chunks shrink."
    else:
        k = first
        tier = min(off for _, off in peaks.values())
        line = (f"it does not fit, nor would any count up to {max(peaks) * ways} (the smallest estimate "
                f"{min(on for on, _ in peaks.values()) / MB:.0f} MB"
                f"{f', with the history in host memory {tier / MB:.0f} MB' if may_offload else ''}); more devices "
                f"split the graph further.")
    fits = offload is not None or peaks[k][0] <= room
    if said:
        est = said[k]
        widest = f" (stage {est.stage}, the widest)" if split is not None and stages > 1 else ""
        line = (f"pyg_pipe: num_chunks='auto': the first step with {k * ways} chunks is estimated at "
                f"{peaks[k][0] / MB:.0f} MB a process{widest} (structures and history {est.resident / MB:.0f}, "
                f"gradients and optimizer state {est.state / MB:.0f}, activations "
                f"{(est.activations + est.transient) / MB:.0f}, "
                f"{'replayed' if replay else 'kept'}) against room for {room / MB:.0f} MB: " + line)
        (log.info if fits else log.warning)(line)
        if notes is not None:
            notes.append(line)
    perm, ptr = cuts[k]
    return Fitted(k * ways, perm, ptr, peaks[k][1] if offload else peaks[k][0], offload)
