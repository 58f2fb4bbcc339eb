"""The runtime: everything a plan runs with on this rank, built at once from the plan.

==================== ===============================================================================
``chunked``          every input graph cut into the plan's chunks (:mod:`pyg_pipe.graph.chunks`)
``way_chunked``      the same with one chunk per way (exact passes: inference, the history pass; built
                     on first use)
``schedule``         chunk order and freshness (:mod:`..plan.schedule`)
``history``          historical rows per call of the model and call site (:mod:`.history`), in the
                     memory tier the knobs choose (:mod:`.tiers`)
``halo``             the halo exchange among ways (all-to-all or ring, :mod:`.ring`) and with history (:mod:`.halo`)
``link``             values crossing the stage cuts, per chunk (:mod:`.link`)
``tiers``            where history and streamed values sit: device, host or disk (:mod:`.tiers`)
``stores``           streaming only: the values of each call of the model, group by group (:mod:`..step.stream`)
``programs``         what this stage runs per kind of call (:mod:`.program`)
``sites``            the call sites met, per kind of call (:mod:`.sites`)
caches               normalisations and ``cached=True`` layers per chunk, local sparse adjacencies,
                     transposed graphs, the output's shape per kind of call
==================== ===============================================================================

The step (:mod:`..step.pipeline`) runs passes over these; where history lives (another memory tier), how the
link and the exchange are timed, and a staleness meter plug in here, each behind its own object.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Set

import torch
from torch import Tensor

from ...graph.chunks import ChunkedGraph, derived, way_ptr
from ...model.find import refuse_layer_tensors, vertex_tables
from ...model.inputs import CallInputs, graph_edges, node_input_bytes
from ..comm import Comm
from ..config import PipelineConfig
from ..plan.grid import RankGrid
from ..plan.memory_cost import MemorySample
from .halo import HaloExchange
from .history import HistoryStore
from .link import StageLink
from ..plan.plan import Plan
from .program import Programs
from ..plan.schedule import Schedule
from .tiers import Tiers, free_memory
from .staleness import StalenessMeter
from .statistics import StatisticsHistory
from .store import Store
from .timeline import Timeline
from .sites import CallSites


class Runtime:
    """The objects one plan runs with on this rank (see the module docstring).

    Args:
        plan: the decisions.
        grid: this rank's place in the grid.
        comm: the transport.
        config: the knobs.
        module, fn: the user's model and its plain forward function.
        inputs: a call with the plan's graphs (they are chunked here).
    """

    def __init__(self, plan: Plan, grid: RankGrid, comm: Comm, config: PipelineConfig, module: torch.nn.Module,
                 fn: Callable, inputs: CallInputs, timeline: Optional[Timeline] = None,
                 meter: Optional[StalenessMeter] = None):
        self.plan, self.grid, self.comm, self.config, self.module = plan, grid, comm, config, module
        self.timeline = timeline if timeline is not None else Timeline(comm, on=False)  # (:mod:`.timeline`)
        self.meter = meter if meter is not None else StalenessMeter(on=False)        # (:mod:`.staleness`)
        dev = comm.device
        W = plan.ways
        self.chunked = chunk_graphs(inputs.graphs, inputs.num_nodes, plan.perm, plan.ptr, W, dev)
        self._way_chunked: Optional[List[ChunkedGraph]] = self.chunked if plan.num_chunks == W else None
        bounds = way_ptr(plan.ptr, W).tolist()
        self.way_bounds: List[int] = bounds
        self.way_rows: List[int] = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        self.recompute = plan.chunks_per_way > 1 and config.recompute is not False  # (:mod:`..step.pipeline`)
        self.recompute_pending = self.recompute and config.recompute == "auto"  # decided after the first step
        # streaming: keep each chunk's activations from the forward to the backward instead of replaying it
        # (None: decided after the first step, ..step.stream.decide_keep)
        self.stream_keep = {True: False, False: True}.get(config.recompute)
        self.memory = MemorySample()  # what the first training fill held per chunk (..plan.memory_cost)
        self.schedule = Schedule(plan.num_chunks, W, config.shuffle_chunks, config.seed,
                                 config.unbiased_gradients and not config.late_gradients)  # late: nothing dropped
        if config.offload is None and plan.offload is not None:  # (num_chunks="auto" chose it: plan/memory_fit.py)
            self.tiers = Tiers(dev, plan.offload, None, config.offload_dir)
        else:
            self.tiers = Tiers(dev, config.offload, config.offload_budget, config.offload_dir)
        held = boundary(self.chunked, *bounds[grid.way:grid.way + 2])
        self.history = HistoryStore(plan.num_nodes, dev, self.tiers, held if held.numel() < plan.num_nodes else None,
                                    dtype=config.history_dtype)
        self.stores: Dict[int, Store] = {}
        self.captured = None  # streaming on one CUDA device: the captured step (..step.capture.CapturedStep)
        self._statistics: Dict[int, StatisticsHistory] = {}  # call -> historical BatchNorm sums (:mod:`.statistics`)
        self.halo = HaloExchange(grid, comm, self.schedule, config.halo_exchange, config.late_gradients)
        self.link = StageLink(comm, grid.prev, grid.next)
        self.programs = Programs(module, fn, plan.sizes, config.split_points, grid.stage, grid.is_last)
        self.sites = CallSites(comm, grid.stage_group if W > 1 else None)
        self.layer_cache: Dict = {}
        self.direct = None  # streaming: the calls that go rows only after the first step (..step.direct.DirectCalls)
        self.adjacency: Dict = {}
        self.tables = vertex_tables(module, plan.num_nodes)  # tensors with a row per vertex (embedding tables, ...)
        refuse_layer_tensors(module, plan.num_nodes, plan.num_chunks)
        # the inputs' chunk rows (and joined halos) kept across calls, when twice the inputs fit an eighth of the
        # free memory (decided once; results are the same either way, only copies differ)
        self.keep_inputs = 2 * node_input_bytes(inputs) <= free_memory(comm.device) // 8
        self.output_specs: Dict = {}
        self.rows_checked: Set[tuple] = set()  # the kinds of call whose first pass the row check ran (step/checks.py)
        self._derived: Dict = {}
        self.step = self.call = 0  # the training step and call of the model in it (set before each training call)
        self._names: Optional[Dict[int, str]] = None

    def statistics_history(self, call: int) -> Optional[StatisticsHistory]:
        """The historical BatchNorm sums of the ``call``-th call of a step (``per_chunk_statistics="history"``
        with several chunks per way), else ``None``."""
        if self.plan.statistics != "history" or self.plan.chunks_per_way == 1:
            return None
        if call not in self._statistics:
            lgs, cpw = self.chunked[0].chunks, self.plan.chunks_per_way
            mine = list(range(self.grid.way * cpw, (self.grid.way + 1) * cpw))  # this way's chunks, in row order
            offsets = [lgs[k].start - lgs[mine[0]].start for k in mine] + [lgs[mine[-1]].end - lgs[mine[0]].start]
            group = self.grid.stage_group if self.grid.ways > 1 else None
            self._statistics[call] = StatisticsHistory([lg.rows for lg in lgs], mine, offsets, group, self.comm)
        return self._statistics[call]

    @property
    def way_chunked(self) -> List[ChunkedGraph]:
        """The input graphs with one chunk per way (exact passes), built on first use."""
        if self._way_chunked is None:
            plan = self.plan
            bounds = way_ptr(plan.ptr, plan.ways).to(self.comm.device)
            self._way_chunked = [cg.rechunked(bounds, plan.ways) for cg in self.chunked]
        return self._way_chunked

    def release_exact(self) -> None:
        """Drops the inputs' rows the exact passes cut for the one-chunk-per-way graphs (the whole features,
        reordered): kept, they would sit beside every training step's activations; the next exact pass cuts
        them again (one gather). The graphs' local adjacencies and normalisations stay (rebuilding them
        made a 20k-vertex validation pass 1.5x slower)."""
        if self._way_chunked is None or self._way_chunked is self.chunked:
            return
        ids = {id(cg) for cg in self._way_chunked}
        rows = self.adjacency.get("node rows", {})
        for k in [k for k in rows if k[1] in ids]:
            del rows[k]

    def store(self, call: int) -> Store:
        """Streaming: the store of the ``call``-th call of a step (``-1``: inference), reused every step."""
        hit = self.stores.get(call)
        if hit is None:
            hit = self.stores[call] = Store(self.tiers, self.plan.num_nodes)
        return hit

    @property
    def graph(self) -> ChunkedGraph:
        """The primary graph in training chunks."""
        return self.chunked[0]

    def training_graphs(self) -> List[ChunkedGraph]:
        """Every chunked graph of the training chunking: the inputs' and those derived from them."""
        sources = {id(cg) for cg in self.chunked}
        return self.chunked + [cg for (src, _), cg in self._derived.items() if src in sources]

    def derive(self, cg: ChunkedGraph, kind) -> ChunkedGraph:
        """The chunking of a graph derived from ``cg`` at this step (:func:`~pyg_pipe.graph.chunks.derived`)."""
        return derived(self._derived, cg, kind, self.step, self.config.seed)

    @property
    def draws_edges(self) -> bool:
        """Whether the forward draws DropEdge's edges (:mod:`..step.dropedge`): a new graph every step."""
        return any(isinstance(kind, tuple) for _, kind in self._derived)

    @property
    def module_names(self) -> Dict[int, str]:
        """Module object id -> its name in the model (for messages)."""
        if self._names is None:
            self._names = {id(m): n for n, m in self.module.named_modules()}
        return self._names

    def state_dict(self) -> dict:
        """This rank's part of a checkpoint: the call sites and the history."""
        return {"sites": self.sites.state_dict(), "history": self.history.state_dict()}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if not state:
            return
        self.sites.load_state_dict(state.get("sites"))
        if state.get("history"):
            self.history.load_state_dict(state["history"])


def boundary(chunked: List[ChunkedGraph], start: int, end: int) -> Tensor:
    """The vertices (new ids, ascending) whose rows history keeps for a way owning ``start .. end-1``: both
    ends of every edge between two chunks with an end in the way, over every graph (both directions, so
    transposes are covered): the way's rows other chunks read, and the rows its chunks read elsewhere."""
    ids = [torch.empty(0, dtype=torch.long, device=chunked[0].new_src.device)]
    for cg in chunked:
        s, d = cg.new_src, cg.new_dst
        keep = (cg.chunk_of[s] != cg.chunk_of[d]) & (((s >= start) & (s < end)) | ((d >= start) & (d < end)))
        ids += [s[keep], d[keep]]
    return torch.unique(torch.cat(ids))


def chunk_graphs(graphs, num_nodes: int, perm, ptr, ways: int, device) -> List[ChunkedGraph]:
    """Every graph of ``graphs`` cut into the chunks ``ptr`` of the vertex order ``perm``."""
    out = []
    for g in graphs:
        src, dst, _ = graph_edges(g)
        out.append(ChunkedGraph(src.to(device), dst.to(device), num_nodes, perm.to(device), ptr.to(device), ways))
    return out

