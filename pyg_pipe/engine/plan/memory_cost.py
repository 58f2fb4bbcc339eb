"""Peak memory per process: predicted from the first training step, checked against the measured peak.

A pipeline process (one stage of one way, ``R`` rows in its way's ``k`` chunks, the largest ``r``) holds,
beyond the model's parameters and the user's data::

    resident     what the runtime keeps between steps: the chunked graphs, local adjacencies,
                 normalisations, the inputs' rows, history buffers, snapshots, pending gradients
                 (counted: every tensor the runtime reaches, each storage once)
    state        the parameters' gradients and the optimizer's state (counted after the first step)
    activations  keep (``recompute=False``): every chunk's, from its fill to its drain, and the
                 pending cross-chunk gradients G once the first chunk has drained
                                                                  max(a R, a (R - r) + G)
                 replay (``recompute=True``): what a replayed chunk keeps (the values it received)
                 for every chunk, one chunk's activations while it is replayed, and G
                                                                  b R + a r + G
    transient    the drain's working set beyond what the chunk saved: autograd frees a layer's saved
                 tensors as its backward runs, so at most about one layer group's share of a chunk's
                 activations is held twice (``L`` the stage's layer groups; untraced: the
                 layer calls a chunk ran)                                                   a r / L
    other        what the process holds after the first step beyond ``resident + state`` (the batch
                 moved to the device after the start, Python objects, on a CPU the allocator's own
                 share of the resident set): measured then, held the same through later steps

    peak = resident + state + activations + transient + other

``G`` is what the first drain's pending gradients took (a buffer of the history's rows per call site). ``a``
and ``b`` (bytes a row) come from the first training fill (:class:`MemorySample`): the storages
autograd saved for a chunk the fill kept, with what it received, sent and returned (parameters left out),
over its rows; and the storages a replayed chunk kept, over its rows. A first step that keeps every chunk
measures no ``b``: a replayed chunk keeps at most what it received, which a kept chunk's measure includes,
so ``b`` is then taken as the received share of ``a`` (:meth:`MemorySample.replayed_per_row`).

Both settings of ``recompute`` are predicted from one step, so ``recompute="auto"`` reads what keeping
would cost before it keeps (:func:`recompute_choice`, applied by :func:`~..step.chunk.decide_recompute`
before the second step): with ``memory_budget`` ``B``, it keeps if the counted peak with keeping,
``resident + state + keep + transient``, is at most ``B`` (the counted parts: the same on every run, so the
choice is too); without one, if what keeping adds at the peak, ``keep + transient``, fits the device's free
memory after the first step (which already holds the rest) less :data:`MARGIN`. The prediction is checked
against the fit's measured peak (:class:`pyg_pipe.memory.PeakMemory`, net of what the process held when the
strategy started: the same base) at the end of training (``strategy.memory_check``, one line logged).
Streaming (one device) is not covered.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Optional, Set, Tuple

import torch
from torch import Tensor

MB = 2 ** 20
#: the share of the free memory ``recompute="auto"`` leaves free (the allocator's fragmentation, the model's
#: error: measured within 7 % over 96 processes, docs/memory.md)
MARGIN = 0.10


def add_storage(found: Dict[int, int], t: Tensor, exclude: Set[int] = frozenset()) -> None:
    """Adds ``t``'s storage (its bytes, by data pointer) to ``found`` unless excluded; sparse tensors add
    their index and value storages."""
    if t.layout == torch.sparse_csr:
        for part in (t.crow_indices(), t.col_indices(), t.values()):
            add_storage(found, part, exclude)
        return
    if t.is_sparse:
        for part in (t._indices(), t._values()):
            add_storage(found, part, exclude)
        return
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # (tensors without a storage: nested, functional wrappers)
        return
    ptr = st.data_ptr()
    if ptr and ptr not in exclude:
        found[ptr] = max(found.get(ptr, 0), st.nbytes())


def storages(t: Tensor) -> Set[int]:
    """The data pointers of ``t``'s storages."""
    found: Dict[int, int] = {}
    add_storage(found, t)
    return set(found)


def reachable(roots: Iterable, exclude: Set[int] = frozenset()) -> Dict[int, int]:
    """Data pointer -> bytes of every tensor reachable from ``roots`` through containers and objects'
    attributes, each storage once, not entering modules (the user's model) or storages in ``exclude``."""
    seen, found, stack = set(), {}, list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            add_storage(found, obj, exclude)
        elif isinstance(obj, (torch.nn.Module, type, str, bytes, int, float, bool, torch.device, torch.dtype)) \
                or callable(obj) and not hasattr(obj, "__dict__"):
            continue
        elif isinstance(obj, dict):
            stack += list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += list(obj)
        elif hasattr(obj, "__dict__"):
            stack += list(vars(obj).values())
        elif hasattr(obj, "__slots__"):
            stack += [getattr(obj, s, None) for s in obj.__slots__]
    return found


@dataclass
class MemorySample:
    """What the first training fill measured (module docstring): bytes and rows of a kept chunk and of the
    replayed ones, and the storages not to count (the user's inputs, the parameters)."""

    kept_bytes: int = 0
    kept_rows: int = 0
    received_bytes: int = 0       # of the kept chunk: what it received from the previous stage
    replayed_bytes: int = 0
    replayed_rows: int = 0
    pending: Optional[int] = None   # bytes of the pending cross-chunk gradients at the end of the first drain
    layers: int = 0                 # layer calls a kept chunk ran (``L`` where the forward is not traced)
    exclude: Set[int] = field(default_factory=set)
    done: bool = False

    def kept(self, rows: int, held: Dict[int, int], received: Dict[int, int]) -> None:
        self.kept_bytes += sum(held.values())
        self.received_bytes += sum(received.values())
        self.kept_rows += rows

    def replayed(self, rows: int, held: Dict[int, int]) -> None:
        self.replayed_bytes += sum(held.values())
        self.replayed_rows += rows

    @property
    def kept_per_row(self) -> float:
        return self.kept_bytes / max(self.kept_rows, 1)

    @property
    def replayed_per_row(self) -> float:
        if self.replayed_rows:
            return self.replayed_bytes / self.replayed_rows
        return self.received_bytes / max(self.kept_rows, 1)


@dataclass(frozen=True)
class MemoryPrediction:
    """The peak of a training step per process, by part (bytes), for keeping and for replaying."""

    resident: int
    state: int
    keep_activations: int
    replay_activations: int
    transient: int
    other: int
    recompute: bool             # what the runtime does after its first step

    def held(self, recompute: Optional[bool] = None) -> int:
        """Activations and pending gradients with ``recompute`` (``None``: the runtime's setting)."""
        recompute = self.recompute if recompute is None else recompute
        return self.replay_activations if recompute else self.keep_activations

    def peak(self, recompute: Optional[bool] = None) -> int:
        return self.resident + self.state + self.held(recompute) + self.transient + self.other

    def state_dict(self) -> dict:
        return {"predicted_peak_bytes": self.peak(), "keep_peak_bytes": self.peak(False),
                "replay_peak_bytes": self.peak(True), "resident_bytes": self.resident, "state_bytes": self.state,
                "activation_bytes": self.held(),
                "transient_bytes": self.transient, "other_bytes": self.other, "recompute": self.recompute}

    def line(self) -> str:
        return (f"pyg_pipe: predicted peak memory of a training step on this process {self.peak() / MB:.0f} MB "
                f"(graph structures and history {self.resident / MB:.0f}, gradients and optimizer state "
                f"{self.state / MB:.0f}, activations and pending gradients {self.held() / MB:.0f} "
                f"({'replayed' if self.recompute else 'kept'}), "
                f"the drain's working set {self.transient / MB:.0f}, the rest of the process {self.other / MB:.0f}); "
                f"keeping every chunk's activations "
                f"{self.peak(False) / MB:.0f} MB, replaying them {self.peak(True) / MB:.0f} MB.")


def activations(sample: MemorySample, way_rows: int, largest_rows: int, groups: int = 1) -> tuple:
    """``(keep, replay, transient)`` bytes of the module docstring's formulas (``groups``: ``L``)."""
    a, b, G = sample.kept_per_row, sample.replayed_per_row, sample.pending or 0
    one = a * largest_rows
    return int(max(a * way_rows, a * (way_rows - largest_rows) + G)), int(b * way_rows + one + G), \
        int(one / max(groups, 1))


def predict(runtime, parameters: Iterable[Tensor], optimizers: Iterable = (), in_use: Optional[int] = None) \
        -> MemoryPrediction:
    """The prediction for ``runtime`` after its first training step (module docstring): ``parameters``, the
    model's (their storages are the model's own; their gradients are counted), ``optimizers``, whose state
    is counted; ``in_use``, what the process holds now net of the base the peak is measured from
    (:meth:`pyg_pipe.memory.PeakMemory.in_use`; ``None``: no ``other`` part)."""
    sample: MemorySample = runtime.memory
    params = list(parameters)
    exclude = set(sample.exclude)
    for p in params:
        exclude |= storages(p)
    state: Dict[int, int] = {}
    for p in params:
        if p.grad is not None:
            add_storage(state, p.grad, exclude)
    for opt in optimizers:
        for s in getattr(opt, "state", {}).values():
            for v in (s.values() if isinstance(s, dict) else ()):
                if isinstance(v, Tensor) and v.numel() > 1:
                    add_storage(state, v, exclude)
    resident = reachable([runtime], exclude | set(state))
    plan = runtime.plan
    w = runtime.grid.way
    lgs = runtime.chunked[0].chunks[w * plan.chunks_per_way:(w + 1) * plan.chunks_per_way]
    groups = plan.sizes[runtime.grid.stage] if plan.sizes is not None else max(sample.layers, 1)
    keep, replay, transient = activations(sample, runtime.way_rows[w], max(lg.rows for lg in lgs), groups)
    counted = sum(resident.values()) + sum(state.values())
    other = max(0, in_use - counted) if in_use is not None else 0
    return MemoryPrediction(sum(resident.values()), sum(state.values()), keep, replay, transient, other,
                            bool(runtime.recompute))


def chunks_to_replay(sample: MemorySample, way_rows: int, per_way: int, ways: int, room: int) -> str:
    """Where replaying does not fit ``room`` bytes: the fewest chunks (doubling the plan's ``per_way``) whose
    replay would, from this step's measures: with ``k`` chunks of ``R / k`` rows a way replaying adds
    ``b R + 2 a R / k + G`` (its activations and the drain's working set); or why no count does. A lower
    bound: more chunks also widen the halos, so the history grows (measured: a 16-layer GCNII on a 20k-vertex
    community graph, 8 -> 32 chunks, 140 -> 147 MB, and 38 MB predicted this way against 42 MB)."""
    a, b, G = sample.kept_per_row, sample.replayed_per_row, sample.pending or 0
    floor = b * way_rows + G
    if floor >= room:
        return (f" No chunk count fits: what every chunk keeps when replayed and the pending gradients alone "
                f"take {floor / MB:.0f} MB; offload='host' moves the history off the device, more devices split "
                f"the graph further.")
    k = per_way
    while k < way_rows and floor + 2 * a * way_rows / k > room:
        k *= 2
    need = floor + 2 * a * way_rows / k
    if need > room:
        return " No chunk count fits; more devices split the graph further."
    return (f" It needs at least num_chunks={k * ways} ({k} a way), where replaying would add about "
            f"{need / MB:.0f} MB (predicted from this step; more chunks also widen the halos and the history, so "
            f"take more), or offload='host' to move the history off the device, or more devices.")


def recompute_choice(prediction: MemoryPrediction, budget: Optional[int], free: int,
                     suggest: Optional[Callable[[int], str]] = None) -> Tuple[bool, str]:
    """``recompute="auto"`` (module docstring): ``(replay, the line that says why)``. ``budget``: the
    ``memory_budget`` knob (bytes) or ``None``; ``free``: the device's free memory now (bytes); ``suggest``:
    given the room (bytes), what would fit when replaying does not (:func:`chunks_to_replay`)."""
    fixed = prediction.resident + prediction.state
    need = {r: prediction.held(r) + prediction.transient for r in (False, True)}
    if budget is not None:
        room = budget - fixed
        against = (f"memory_budget={budget / MB:.0f} MB less {fixed / MB:.0f} MB of graph structures, history, "
                   f"gradients and optimizer state")
    else:
        room, against = int(free * (1 - MARGIN)), f"{1 - MARGIN:.0%} of the {free / MB:.0f} MB free"
    replay = need[False] > room
    line = (f"pyg_pipe: recompute='auto': {'replaying' if replay else 'keeping'} the chunks' activations from the "
            f"next step: keeping them adds {need[False] / MB:.0f} MB at the peak, replaying them "
            f"{need[True] / MB:.0f} MB; there is room for {max(room, 0) / MB:.0f} MB ({against}).")
    if need[True] > room:
        line += " Replaying does not fit either." + (suggest(room) if suggest is not None else
                                                     " More chunks (num_chunks) hold fewer rows at once, "
                                                     "offload='host' moves the history off the device, more "
                                                     "devices split the graph further.")
    return replay, line
