"""What the hooks see while one chunk runs: its local graph, where its halo rows come from, its inputs,
and the layer calls in progress.

The engine enters a :class:`ChunkContext` around every run of the user's forward on one chunk (and
around that chunk's backward, where checkpointed layers run again). The hooks on PyG's layers
(:mod:`.step.layers`), the degree completion (:mod:`.step.degrees`) and the graph-wide statistics
(:mod:`.runtime.statistics`) read it with :func:`current`; outside the engine :func:`current` is ``None`` and
every hook leaves the model alone.

This is the engine's ground floor: it imports nothing of the engine. The context is a process-wide
stack rather than a ``contextvars.ContextVar`` because autograd may run a chunk's backward, and the
layers recomputed in it, on a device thread that a context variable set on the calling thread would
not reach.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional, Protocol, Tuple

import torch
from torch import Tensor

from ..model.errors import UnsupportedModelError

_STACK: List["ChunkContext"] = []
_NOTHING = nullcontext()  # reusable: entering it does nothing


def _show(owner: torch.nn.Module, attr: str, rows: Tensor, whole: Tensor) -> None:
    (owner._parameters if attr in owner._parameters else owner._buffers)[attr] = rows
    if isinstance(owner, torch.nn.Embedding):  # (a lookup by ids still reads the whole table)
        owner.__dict__["forward"] = lambda ids: torch.nn.functional.embedding(
            ids, whole, owner.padding_idx, owner.max_norm, owner.norm_type, owner.scale_grad_by_freq, owner.sparse)


def _hide(owner: torch.nn.Module, attr: str, whole: Tensor) -> None:
    (owner._parameters if attr in owner._parameters else owner._buffers)[attr] = whole
    if isinstance(owner, torch.nn.Embedding):
        owner.__dict__.pop("forward", None)


def leading_rows(t: Tensor, dim: int, n: int) -> Tensor:
    """The first ``n`` entries of ``t`` along ``dim``: ``t`` itself when it has no more (a narrow to the whole extent
    would add a slice to the autograd graph, whose backward zero-fills a gradient of ``t``'s size and copies it in)."""
    return t if t.size(dim) == n else t.narrow(dim, 0, n)


def current() -> Optional["ChunkContext"]:
    """The context of the chunk running now, or ``None`` outside the engine."""
    return _STACK[-1] if _STACK else None


def autocast_state(device: torch.device) -> tuple:
    """The autocast settings in force now (mixed precision: Lightning's ``precision="bf16-mixed"``), for the
    device's type and the CPU: what a fill ran under, which its drain's recomputations must run under too."""
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in dict.fromkeys((device.type,
                                                                                                          "cpu")))


@contextmanager
def autocast_as(state: tuple):
    """Runs the block under the autocast settings ``state`` (:func:`autocast_state`)."""
    with ExitStack() as stack:
        for device_type, enabled, dtype in state:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        yield


def in_backward() -> bool:
    """True while autograd runs a backward pass (a layer called now is a recomputation, not the forward)."""
    return torch._C._current_graph_task_id() != -1


class HaloSource(Protocol):
    """Where a call site's halo rows come from in this pass (:class:`.runtime.halo.HaloPass`)."""

    def join(self, key: str, cg, lg, t: Tensor, vdim: int) -> Tensor:
        """``t`` (``lg.num_local`` rows along ``vdim``) with its halo rows replaced by the true ones."""


class Observer(Protocol):
    """Watches the user's operations on one chunk (:class:`.step.rows.RowCheck`)."""

    def returned(self, value: Any, vdim: Optional[int]) -> None:
        """``value`` (a tensor or nested tuples of them), returned by a layer or a graph-wide module, has
        one row per vertex of the chunk along ``vdim`` (``None``: along its first dimension of that size)."""

    def layer_returned(self, value: Any, vdim_of: Callable, reverse: bool) -> None:
        """What a layer returned: tensors with a row per vertex of the chunk (``vdim_of(t)``: along which dimension),
        and, with ``return_attention_weights=True``, its local edge list and a row per edge of it."""

    def paused(self):
        """A context manager: the operations run inside are the engine's, not the user's."""

    def refuse(self, message: str) -> None:
        """A refusal found while the pass runs: raised on every rank once the pass is over."""

    def python_op(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        """A step of a traced program ran Python's own arithmetic (``operator.truediv``, ...): ``out`` is what it
        made of ``args``."""


@dataclass
class Invocation:
    """One call of one ``MessagePassing`` module on the current chunk.

    ``rows_only``: the layer computes the chunk's rows only, on the row graph (its sources get their halo
    rows at each propagate); otherwise its node tensors carry ``[rows | halo]`` (:mod:`.step.layers`).

    ``graphs`` maps each graph the call was handed (local ``edge_index`` / ``adj_t``, or row graph) and each
    graph derived from one of them (:meth:`derive`) to its chunking ``(cg, lg)``: a layer may be given
    several graphs (``SignedConv``'s positive and negative edges, a graph and its transpose), each with a
    halo of its own. ``cg, lg`` are the first graph's.

    ``in_edges`` is set while the layer computes per-edge values (its ``message`` / ``edge_update``),
    whose rows follow ``edge_graph``, the graph of the propagate call (:meth:`destinations`), so
    graph-wide statistics computed there count the chunk's own edges (:mod:`.runtime.statistics`).
    """

    name: str
    index: int
    cg: Any
    lg: Any
    clean: bool
    parent: Optional["Invocation"] = None
    graphs: Dict[int, Tuple[Any, Any, Any, bool]] = field(default_factory=dict)
    calls: int = 0
    norms: int = 0
    propagated: bool = False
    edge_graph: Any = None
    in_edges: bool = False
    rows_only: bool = False
    reverse: bool = False     # the layer aggregates at edge_index[0] (flow="target_to_source")
    extended: tuple = ()      # a clean whole-local-graph call: its node arguments as extended (..step.direct)
    restore: Dict[str, Any] = field(default_factory=dict)
    pairs: Dict[int, tuple] = field(default_factory=dict)   # pairs made for propagate -> (pair, rows) (..step.update)

    @property
    def several(self) -> bool:
        """Whether the call was handed graphs of more than one chunking (each with its own halo)."""
        return len({id(h[1]) for h in self.graphs.values()}) > 1

    def handed(self, graph) -> bool:
        """Whether ``graph`` is one of the graphs the call was handed (not one derived in the layer)."""
        hit = self.graphs.get(id(graph))
        return hit is not None and hit[0] is graph and hit[3]

    def chunking(self, graph, what: str = "propagate") -> Tuple[Any, Any]:
        """``(cg, lg)`` of a graph the layer uses: one it was handed or one derived from those; any other
        graph is taken for the call's only chunking, and refused where it was handed several graphs of a
        chunking that cuts the graph (a structural decision: the same for every chunk of the pass)."""
        hit = self.graphs.get(id(graph))
        if hit is not None and hit[0] is graph:
            return hit[1], hit[2]
        if self.several and self.cg.num_chunks > 1:
            raise UnsupportedModelError(
                f"Layer '{self.name}' was given several graphs and calls {what} with a graph it built from one "
                f"of them inside the layer (self loops added or removed, edges filtered), so pyg_pipe cannot tell "
                f"whose halo it reads. Build that graph in the data pipeline and pass it to the layer, or give "
                f"each graph a layer of its own.")
        return self.cg, self.lg

    def derive(self, graph, source) -> None:
        """``graph``, built in the layer from ``source`` (PyG's normalisers add self loops), has the same
        chunking."""
        if graph is not source and isinstance(graph, Tensor):
            cg, lg = self.chunking(source, "a normaliser")
            self.graphs[id(graph)] = (graph, cg, lg, False)

    def destinations(self) -> Tensor:
        """The destination (local vertex id) of every per-edge row of the current propagate call, in
        the order PyG computes messages."""
        g = self.edge_graph
        if isinstance(g, Tensor) and g.layout == torch.strided:
            return g[0] if self.reverse else g[1]
        if type(g).__name__ == "SparseTensor":
            return g.storage.row()
        from torch_geometric.utils import to_edge_index
        return to_edge_index(g)[0][0]

    def mark_propagated(self) -> None:
        inv = self
        while inv is not None:
            inv.propagated = True
            inv = inv.parent


@dataclass(frozen=True)
class Site:
    """A call site met by a run: its key (``module#invocation.call``), the source arguments exchanged
    there, and whether they were clean (the model's own inputs: no exchange)."""

    key: str
    sources: Tuple[str, ...]
    clean: bool


class ChunkContext:
    """What the hooks need while one chunk (or one way's whole partition) runs.

    Args:
        cg: the chunked primary graph.
        lg: the chunk's local view of it.
        halo: where halo rows come from (``None`` when the chunk is the whole graph: no halo).
        graphs: resolves graph arguments: ``graphs.resolve(tensor) -> (cg, lg, local graph) or None``.
        statistics: graph-wide statistics for this run (:class:`.runtime.statistics.Statistics`).
        cache: per-chunk store for ``cached=True`` layers and normalisations of unchanged inputs.
        observer: the row check on a plan's first pass (:mod:`.step.rows`), else ``None``.
        replay: the run recomputes a chunk's fill in its drain (halo rows are read as the fill read them).
    """

    def __init__(self, cg, lg, halo: Optional[HaloSource], graphs, statistics, cache: Dict,
                 observer: Optional[Observer] = None, replay: bool = False):
        self.cg, self.lg = cg, lg
        self.replay = replay
        self.task = torch._C._current_graph_task_id()  # the autograd pass this run's forward belongs to
        self.halo, self.graphs, self.statistics = halo, graphs, statistics
        self.cache = cache
        self.observer = observer
        self.sites: List[Site] = []
        self.clean: Dict[int, Tuple[Tensor, int, Callable]] = {}
        self.extended: Dict[int, Tuple[Tensor, Tensor, int]] = {}
        self.edge_inputs: Dict[int, Tuple[Tensor, int, Tensor, Any]] = {}
        self.stack: List[Invocation] = []
        self.counts: Dict[str, int] = {}
        self.clean_calls: Dict[Tuple[str, int], bool] = {}
        self.tables: List[Tuple[torch.nn.Module, str, Tensor, Tensor]] = []
        self._versions: Dict[int, int] = {}  # the version of each table's rows when shown (a write in place is refused)
        self.drops = 0  # DropEdge calls made so far in this run (:mod:`.step.dropedge`)
        self.direct = None  # streaming: the calls that propagate their clean inputs (:mod:`.step.direct`)

    def __enter__(self) -> "ChunkContext":
        _STACK.append(self)
        for owner, attr, rows, whole in self.tables:
            _show(owner, attr, rows, whole)
        return self

    def __exit__(self, kind, *exc) -> None:
        _STACK.remove(self)
        for owner, attr, _, whole in reversed(self.tables):
            _hide(owner, attr, whole)
        changed = [(o, a) for o, a, rows, _ in self.tables
                   if rows._version != self._versions.get(id(rows), rows._version)]
        if changed and kind is None:  # (the rows shown were a copy: what the forward wrote there would be lost)
            o, a = changed[0]
            raise UnsupportedModelError(
                f"{type(o).__name__}.{a} has one row per vertex, and the forward changed it in place; pyg_pipe shows "
                f"each chunk a copy of its rows there, so the change would not reach the model. Keep per-vertex "
                f"state the forward writes outside the model (return it), or train on one device.")

    def swap_table(self, owner: torch.nn.Module, attr: str, rows: Tensor, whole: Tensor, copied: bool = True) -> None:
        """While this context is entered, ``owner``'s tensor ``attr`` with a row per vertex (an embedding table's
        ``weight``, a per-vertex parameter or buffer) shows the chunk's ``rows`` (read as ``table.weight``, as LightGCN
        reads it); calling an embedding table (``table(ids)``) still looks the ids up in the whole table ``whole``.
        ``copied``: ``rows`` is a copy (not an alias of ``whole``): the forward writing into it is refused at exit."""
        self.tables.append((owner, attr, rows, whole))
        if copied:
            self._versions[id(rows)] = rows._version
        _show(owner, attr, rows, whole)

    def recomputing(self) -> bool:
        """True while a layer of this run is recomputed in a backward pass (checkpointing, reversible
        blocks), not run by the run's own forward (which may itself run inside a backward: a replay)."""
        return torch._C._current_graph_task_id() != self.task

    def engine_work(self) -> ContextManager:
        """Marks the operations run inside as the engine's own (the observer does not judge them)."""
        return _NOTHING if self.observer is None else self.observer.paused()

    # ------------------------------------------------------------------ inputs, registered by the localiser
    def add_clean(self, local: Tensor, extend: Callable, whole: Optional[Callable[[], Tensor]] = None) -> None:
        """``local`` is an input's chunk rows; ``extend(cg, lg)`` gives its rows beyond them. ``whole``: for an input
        whose ``[rows | halo]`` for this context's chunk comes as one tensor (streaming's values read from the
        store), the function that makes it; the tensor it returns is handed out at every extension of ``local``
        instead of a join of ``local`` and ``extend``'s rows."""
        self.clean[id(local)] = (local, local._version, extend)
        if whole is not None:
            self.extended[id(local)] = (local, whole, None)

    def clean_extended(self, t: Tensor, lg) -> Optional[Tensor]:
        """The registered ``[rows | halo]`` of the clean input ``t`` for this context's chunk ``lg``, else ``None``."""
        hit = self.extended.get(id(t))
        if hit is None or lg is not self.lg or hit[0] is not t:
            return None
        if hit[2] is None:  # made at the first extension
            whole = hit[1]()
            hit = self.extended[id(t)] = (t, whole, whole._version)
        return hit[1] if hit[1]._version == hit[2] else None

    def add_edge_input(self, local: Tensor, whole: Tensor, cg=None) -> None:
        """``local`` holds the chunk's local edges of the edge input ``whole``, cut with the chunked graph
        ``cg`` (``None``: the primary graph's)."""
        self.edge_inputs[id(local)] = (local, local._version, whole, self.cg if cg is None else cg)

    def is_clean(self, t: Tensor) -> bool:
        hit = self.clean.get(id(t))
        return hit is not None and hit[0] is t and hit[1] == t._version

    def clean_rows(self, t: Tensor) -> Callable:
        """The halo-row provider of a clean input (found by storage for a recomputation's detached copy)."""
        hit = self.clean.get(id(t))
        if hit is None or hit[0] is not t:
            hit = next((h for h in self.clean.values() if h[0].data_ptr() == t.data_ptr()
                        and h[0].shape == t.shape), None)
            if hit is None:
                raise UnsupportedModelError("pyg_pipe: a layer recomputed during backward received an input it did "
                                            "not receive in the forward.")
        return hit[2]

    def edge_input(self, t: Tensor) -> Optional[Tensor]:
        """The whole-graph edge input ``t`` was cut from, or ``None`` (computed in the model)."""
        hit = self.edge_inputs.get(id(t))
        return hit[2] if hit is not None and hit[0] is t and hit[1] == t._version else None

    def edge_chunking(self, t: Tensor):
        """The chunked graph whose local edges the edge input ``t`` holds, or ``None`` (computed in the model)."""
        hit = self.edge_inputs.get(id(t))
        return hit[3] if hit is not None and hit[0] is t and hit[1] == t._version else None
