"""The engine facade: what the Lightning strategies call. It replaces ``model.forward`` while training.

Every rank runs its part of the rank grid (:mod:`.grid`): stage ``s`` of the model for way ``w``.
A call of the model is

* **training** (grad enabled, in a training step): one GNNPipe step. The fill runs this rank's chunks
  in the order of the schedule (:mod:`.schedule`) in the forward pass, the drain runs them in
  reverse in the backward pass (one autograd Function around both, since Lightning zeroes gradients
  between ``training_step`` and ``backward``). Per chunk: inputs cut to the chunk
  (:mod:`pyg_pipe.model.inputs`), values from the previous stage (:mod:`.link`), the stage's program
  (:mod:`.program`) with the layer hooks (:mod:`.layers`) reading halo rows (:mod:`.halo`) from other
  ways and from history (:mod:`.history`). Then weight gradients are summed where several ranks
  computed parts of them.
* **anything else** (no grad: validation, test, predict): an *exact pass*: one chunk per way (each
  way's whole partition), halo rows exchanged fresh, stage after stage. The same pass fills the
  history before the first training step.

Every rank returns the whole output (the last stage sends its rows to every rank), so the user's
loss and metrics run unchanged and identically everywhere. The model object is not wrapped: an
instance attribute ``forward`` is set while installed and removed after.
"""
from __future__ import annotations

import contextlib
import logging
import time
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..graph.chunks import ChunkedGraph, way_ptr
from ..model.errors import UnsupportedModelError
from ..model.inputs import CallInputs, Localizer
from ..model.split import parameter_stages, split
from ..model.trace import forward_function, trace
from .comm import Comm
from .grid import RankGrid, grid_shape, ways_for_layers
from .halo import HaloExchange
from .history import HistoryStore
from .layers import ChunkContext, LayerHooks, Rerouted, Site
from .link import StageLink
from .plan import (Plan, PipelineConfig, check_resume, choose_sizes, chunk_count, chunk_graphs, partition,
                   stage_groups)
from .program import StageProgram, WholeForward
from .rows import RowCheck
from .schedule import Schedule
from .statistics import Statistics, StatisticsHooks, needs_statistics

log = logging.getLogger("pyg_pipe")

#: modules that build a new graph from vertex values (pooling): refused in every mode
GRAPH_BUILDERS = ("TopKPooling", "SAGPooling", "EdgePooling", "ASAPooling", "PANPooling", "MemPooling",
                  "ClusterPooling")


@dataclass
class _Record:
    """What the fill keeps of one chunk for the drain."""

    chunk: int
    ctx: ChunkContext
    received: Dict[str, Any]
    sent: Dict[str, Any]
    out: Optional[Tensor]
    activation: Optional[str]


class _Fill(torch.autograd.Function):
    """The fill in ``forward``, the drain in ``backward``."""

    @staticmethod
    def forward(ctx, engine: "GNNPipeEngine", anchor: Tensor) -> Tensor:
        ctx.engine = engine
        with torch.enable_grad():
            out, ctx.state = engine._fill()
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.engine._drain(grad, ctx.state)
        ctx.state = None
        return None, None


class GNNPipeEngine:
    """Pipelined, graph-parallel or hybrid execution of one PyG model on this rank.

    Args:
        module: the user's model (its ``forward`` is routed through the engine while installed).
        config: the knobs (:class:`~pyg_pipe.engine.plan.PipelineConfig`).
        comm: this rank's :class:`~pyg_pipe.engine.comm.Comm`.
        num_stages: pipeline stages S (``None``: from the devices and ``ways``; with both ``None``, one
            stage per device, or fewer stages with graph-parallel ways when the model has fewer layers).
        stage: accepted for compatibility; must equal ``rank // ways``.
        ways: graph-parallel ways W per stage (``None``: devices / S).
        min_ways: with both ``None``: the fewest ways to use (2 for ``strategy="gnnpipe_hybrid"``).
    """

    def __init__(self, module: torch.nn.Module, config: PipelineConfig, comm: Comm, num_stages: Optional[int] = None,
                 stage: Optional[int] = None, ways: Optional[int] = 1, min_ways: int = 1):
        config.validate()
        self.module, self.config, self.comm = module, config, comm
        self.requested = (num_stages, ways, stage)
        self.min_ways = min_ways
        self.grid: Optional[RankGrid] = None
        self.plan: Optional[Plan] = None
        self.step = 0
        self.fn = forward_function(module)
        self.layer_hooks, self.stat_hooks = LayerHooks(module), StatisticsHooks(module)
        self.history: Optional[HistoryStore] = None
        self.saved: Optional[dict] = None
        self.stage_hint: Optional[str] = None
        self.plan_seconds = 0.0
        self.notes: List[str] = []
        self._specs: Dict[str, tuple] = {}
        self._inputs: Optional[CallInputs] = None
        self._instance_forward = None
        self._runners: Dict[tuple, tuple] = {}  # per call signature: (this stage's program, all stages)
        self._verify: set = set()
        self._module_names: Optional[Dict[int, str]] = None  # module id -> name, for the row check's errors

    # ------------------------------------------------------------------ grid facts
    @property
    def stage_index(self) -> int:
        return self.grid.stage

    @property
    def num_stages(self) -> int:
        return self.grid.stages

    @property
    def ways(self) -> int:
        return self.grid.ways

    @property
    def owner_ranks(self) -> List[int]:
        return self.grid.owner_ranks

    @property
    def owners(self) -> Dict[str, int]:
        """Parameter / buffer name -> the stage whose copy is authoritative (the first that uses it)."""
        if self.plan is None:
            return {}
        return {n: (min(st) if st else 0) for n, st in self.plan.param_stages.items()}

    # ------------------------------------------------------------------ install / call
    def install(self) -> None:
        """Routes ``module(...)`` through the engine and hooks its layers."""
        self.fn = forward_function(self.module)
        self._instance_forward = self.module.__dict__.get("forward")
        self.module.forward = Rerouted(self.module, self.__call__, self.fn)
        self.layer_hooks.install()
        self.stat_hooks.install()

    def uninstall(self) -> None:
        self.module.__dict__.pop("forward", None)
        if self._instance_forward is not None:
            self.module.forward = self._instance_forward
        self.layer_hooks.remove()
        self.stat_hooks.remove()

    def __call__(self, *args, **kwargs):
        inputs = CallInputs(args, kwargs)
        plan = self._plan_for(inputs)
        training = torch.is_grad_enabled() and self.stage_hint in (None, "train")
        if not training:
            with torch.no_grad():
                return self._exact(plan, inputs, init=False)
        name = inputs.requires_grad()
        if name is not None:
            raise ValueError(f"Input '{name}' of the pipelined model requires grad; pyg_pipe does not back-propagate "
                             f"into the model's inputs. Move the layers that produce it into the model.")
        self._inputs = inputs
        self._refresh_history(plan, inputs)
        anchor = torch.zeros((), device=self.comm.device, requires_grad=True)
        return _Fill.apply(self, anchor)

    # ------------------------------------------------------------------ planning
    def _plan_for(self, inputs: CallInputs) -> Plan:
        if self.plan is not None and self.plan.matches(inputs):
            return self.plan
        t0 = time.perf_counter()
        try:
            self.plan = self._make_plan(inputs)
        finally:
            self.plan_seconds += time.perf_counter() - t0
        return self.plan

    def _make_plan(self, inputs: CallInputs) -> Plan:
        P, rank, dev = self.comm.world_size, self.comm.rank, self.comm.device
        cfg = self.config
        saved = (self.saved or {}).get("plan")
        refuse_graph_builders(self.module)
        S, W, program, groups, forced = self._grid_shape(inputs)
        if self.grid is None:
            self.grid = RankGrid(rank, P, S, W)
        elif (self.grid.stages, self.grid.ways) != (S, W):
            raise UnsupportedModelError("The model's stage count changed between calls; pyg_pipe plans once per model.")
        grid = self.grid
        stage = self.requested[2]
        if stage is not None and stage != grid.stage:
            raise ValueError(f"stage={stage} but rank {rank} of a {S} x {W} grid runs stage {grid.stage}.")
        C = chunk_count(cfg, S, W, inputs.num_nodes) if saved is None else saved["num_chunks"]
        if saved is not None:
            check_resume(saved, S, W, chunk_count(cfg, S, W, inputs.num_nodes), inputs)
            perm, ptr = saved["perm"], saved["ptr"]
        else:
            perm, ptr = partition(cfg, inputs, C, W, rank, grid.rank_of(0, 0), dev)
        chunked = chunk_graphs(inputs, perm, ptr, W, dev)
        way_chunked = chunked if C == W else chunk_graphs(inputs, perm, way_ptr(ptr, W), W, dev)
        plan = Plan(S, W, C, inputs.num_nodes, inputs.num_edges, perm, ptr, list(inputs.graphs), chunked, way_chunked)
        self._check_model(plan)
        if program is not None:
            if forced:
                if len(groups) != S:
                    raise UnsupportedModelError(
                        f"The forward is split into {len(groups)} parts by its split points, but the pipeline has "
                        f"{S} stages; mark {S - 1} split points (pipe_split() / split_points) or use {len(groups)} "
                        f"stages.")
                sizes = [1] * S
            elif saved is not None and saved.get("sizes"):
                sizes = list(saved["sizes"])
            else:
                sizes = choose_sizes(cfg, groups, S, lambda: self._profile(program, groups, inputs), rank,
                                     grid.rank_of(0, 0), dev)
            plan.program, plan.sizes = program, sizes
            plan.stage_list = split(program, groups, sizes)
            plan.param_stages = parameter_stages(self.module, plan.stage_list)
            self._runners = {_signature(self.module, inputs): (StageProgram(program, plan.stage_list[grid.stage],
                                                                            self.fn, grid.is_last), plan.stage_list)}
        else:
            plan.param_stages = {n: {0} for n, _ in list(self.module.named_parameters())
                                 + list(self.module.named_buffers())}
            self._runners = {}
        mine = (self.saved or {}).get("rank")
        if mine:
            plan.sites = dict(mine["sites"])
            self._verify = set(plan.sites)  # the first pass of each mode checks it meets the saved call sites
        self.schedule = Schedule(C, W, cfg.shuffle_chunks, cfg.seed, cfg.unbiased_gradients)
        self.history = HistoryStore(inputs.num_nodes, dev)
        resumed = bool(mine and mine.get("history"))
        if resumed:
            self.history.load_state_dict(mine["history"])
        self.halo = HaloExchange(grid, self.comm, self.schedule, self.history)
        self.link = StageLink(self.comm, grid.prev, grid.next)
        self._specs = {}
        self.plan = plan
        if C > W and not resumed:
            with torch.no_grad():
                self._exact(plan, inputs, init=True)
        if C > W:
            tensors = inputs.edge_tensors()
            plan.edge_inputs = tuple((id(t), t._version) for t in tensors) + (_checksum(tensors),)
        self.saved = None
        return plan

    def _runner(self, plan: Plan, inputs: CallInputs):
        """What this stage runs for a call: the forward itself (one stage), or this stage's part of the
        program traced for this call's mode (train / eval) and kinds of arguments (a traced forward
        bakes ``self.training`` and ``None`` arguments in), with the plan's stage split."""
        return self._program(plan, inputs)[0]

    def _activation_of_next(self, plan: Plan, inputs: CallInputs) -> Optional[str]:
        """The value feeding the next stage's first layer (its traffic counts as stage activations)."""
        stages = self._program(plan, inputs)[1]
        return stages[self.grid.stage + 1].activation if stages and self.grid.next is not None else None

    def _program(self, plan: Plan, inputs: CallInputs) -> tuple:
        if plan.program is None:
            return WholeForward(self.module, self.fn), None
        key = _signature(self.module, inputs)
        hit = self._runners.get(key)
        if hit is None:
            program = trace(self.module, inputs.args, inputs.kwargs)
            groups, forced = stage_groups(program, self.config.split_points)
            if len(groups) != (len(plan.sizes) if forced else sum(plan.sizes)):
                raise UnsupportedModelError(
                    f"{type(self.module).__name__} runs {len(groups)} pipeline units for this call but "
                    f"{sum(plan.sizes)} for the first one (in {'training' if self.module.training else 'eval'} "
                    f"mode, or with other arguments given); pyg_pipe needs the same layers in every call.")
            stages = split(program, groups, plan.sizes)
            hit = self._runners[key] = (StageProgram(program, stages[self.grid.stage], self.fn, self.grid.is_last),
                                        stages)
        return hit

    def _refresh_history(self, plan: Plan, inputs: CallInputs) -> None:
        """New per-edge inputs (edge weights, attributes, adjacency values) on the same graph change what
        layers compute everywhere, degrees included: history is refilled by an exact pass, as at the
        start, so the chunked step sees them at once (new node features, by contrast, reach history
        chunk by chunk, as the algorithm intends)."""
        if plan.chunks_per_way == 1:
            return
        tensors = inputs.edge_tensors()
        key = tuple((id(t), t._version) for t in tensors)
        if key == plan.edge_inputs[:len(key)] and len(key) == len(plan.edge_inputs) - 1:
            return
        digest = _checksum(tensors)
        if plan.edge_inputs and digest != plan.edge_inputs[-1]:
            with torch.no_grad():
                self._exact(plan, inputs, init=True)
            self.history.snapshot = {}  # the T2 anchor is renewed too
        plan.edge_inputs = key + (digest,)

    def _grid_shape(self, inputs: CallInputs):
        """``(S, W, program, groups, forced)``: the grid for this model and, when S > 1, its traced
        program cut into layer groups (``forced``: cut at the user's split points)."""
        P = self.comm.world_size
        S, W = grid_shape(P, self.requested[0], self.requested[1], self.min_ways)
        explicit = self.requested[0] is not None
        if S == 1:
            return S, W, None, None, False
        program = trace(self.module, inputs.args, inputs.kwargs)
        groups, forced = stage_groups(program, self.config.split_points)
        L = len(groups)
        if L >= S or forced:
            return S, W, program, groups, forced
        if explicit:
            raise UnsupportedModelError(
                f"The model has {L} message-passing layers but the pipeline has {S} stages; every stage needs at least "
                f"one layer. Use at most {L} stages, strategy='gnnpipe_hybrid' (stages x graph-parallel ways), or a "
                f"deeper model.")
        S2, W2 = ways_for_layers(P, L, W)
        note = (f"pyg_pipe: the model has {L} message-passing layers for {P} devices: running {S2} pipeline "
                f"stage{'s' if S2 > 1 else ''} x {W2} graph-parallel ways.")
        self.notes.append(note)
        log.info(note)
        if S2 == 1:
            return S2, W2, None, None, False
        return S2, W2, program, groups, forced

    def _check_model(self, plan: Plan) -> None:
        """Refusals decided by structure, before any step: the same on every rank."""
        for name, m in self.module.named_modules():
            if plan.chunks_per_way > 1 and needs_statistics(m) and not self.config.per_chunk_statistics:
                raise UnsupportedModelError(
                    f"Module '{name}' ({type(m).__name__}) normalises with statistics over all vertices, but with "
                    f"{plan.chunks_per_way} chunks per way the pipeline never holds all vertices at once. Use "
                    f"num_chunks={plan.ways} (exact; one chunk per way), opt into per-chunk statistics "
                    f"(per_chunk_statistics=True, approximate, as GPipe does for micro-batches), or a per-vertex norm "
                    f"(torch.nn.LayerNorm, torch_geometric.nn.LayerNorm(mode='node')).")

    def _profile(self, program, groups, inputs: CallInputs) -> List[float]:
        """Seconds each layer group takes in one no-grad pass over the whole graph on this rank (the
        cost model of ``balance="time"``); measured once per plan, on one rank."""
        N = inputs.num_nodes
        whole = chunk_graphs(inputs, torch.arange(N), torch.tensor([0, N]), 1, self.comm.device)
        loc = Localizer(inputs, whole)
        lg = whole[0].chunks[0]
        ctx = ChunkContext(whole[0], lg, None, loc.resolver(0, lambda cg, kind: cg), Statistics(None, None, N, False),
                           {}, [])
        from ..model.split import Stage
        everything = Stage(0, [n for g in groups for n in g], [], [program.output.args[0].name], None)
        runner = StageProgram(program, everything, self.fn, True)
        costs = []
        with torch.no_grad(), ctx:
            args, kwargs = loc.localize(0, ctx)
            env = runner.bind(args, kwargs)
            for group in groups:
                t0 = time.perf_counter()
                for node in group:
                    env[node.name] = runner._eval(node, env)
                    for value in runner._release.get(node.name, ()):  # no-grad: values die after their last use
                        env.pop(value, None)
                costs.append(time.perf_counter() - t0)
        return costs

    # ------------------------------------------------------------------ passes
    def _context(self, plan: Plan, cgs: List[ChunkedGraph], c: int, localizer: Localizer, one_per_way: bool,
                 init: bool = False) -> ChunkContext:
        grid = self.grid
        lg = cgs[0].chunks[c]
        if one_per_way and grid.ways > 1:
            bounds = way_ptr(plan.ptr, grid.ways).tolist()
            stats = Statistics(grid.stage_group, [b - a for a, b in zip(bounds[:-1], bounds[1:])], lg.rows,
                               update_running=not init)
        else:
            stats = Statistics(None, None, lg.rows, update_running=not init)
        derive = plan.derive
        return ChunkContext(cgs[0], lg, self.halo, localizer.resolver(c, derive), stats, plan.cache, [])

    def _exact(self, plan: Plan, inputs: CallInputs, init: bool) -> Tensor:
        """One chunk per way, halo rows fresh, stage after stage; ``init`` also fills the history."""
        grid = self.grid
        cgs = plan.way_chunked
        w = grid.way
        self.comm.counting = False
        self.halo.begin(torch.zeros(grid.ways, dtype=torch.long), read_history=False, write_history=init)
        localizer = Localizer(inputs, cgs, plan.adjacency)
        ctx = self._context(plan, cgs, w, localizer, one_per_way=True, init=init)
        runner = self._runner(plan, inputs)
        stage = getattr(runner, "stage", None)
        key = (f"exact:{w}", _signature(self.module, inputs))
        with ctx:
            args, kwargs = localizer.localize(w, ctx)
            received = self.link.recv(key, stage.inputs, False) if stage is not None and grid.prev is not None else {}
            check = self._rows_check(plan, ctx, received)
            with check if check is not None else contextlib.nullcontext():
                sent, out = runner.run(args, kwargs, received)
        self._check_sites(ctx.sites, plan, None)
        if grid.next is not None:
            self.link.send(key, sent, self._activation_of_next(plan, inputs))
        lg = cgs[0].chunks[w]
        full = self._share_output(plan, out, lg.start, lg.end, "exact")
        self.comm.flush()
        if check is not None:
            self._rows_verdict(plan, check)
        return full[cgs[0].inv]

    def _rows_check(self, plan: Plan, ctx: ChunkContext, received: Dict[str, Any]) -> Optional[RowCheck]:
        """A check for operations that combine vertex rows outside layers (:mod:`.rows`), on the first
        pass of each mode of a plan that cuts the graph (the same pass on every rank)."""
        if plan.num_chunks == 1 or ("train" if self.module.training else "eval") in plan.rows_checked:
            return None
        if self._module_names is None:
            self._module_names = {id(m): n for n, m in self.module.named_modules()}
        cut = f"num_chunks={plan.num_chunks}" + (f" over {plan.ways} graph-parallel ways" if plan.ways > 1 else "")
        check = ctx.rows_check = RowCheck(ctx.lg.rows, self._module_names, cut)
        check.mark(list(received.values()))
        return check

    def _rows_verdict(self, plan: Plan, check: RowCheck) -> None:
        """After the checked pass: every rank raises the same error if any rank found an operation."""
        plan.rows_checked.add("train" if self.module.training else "eval")
        check.verdict()

    def _fill(self):
        """The forward of one training step: this rank's chunks in the step's order (see :mod:`.schedule`)."""
        plan, grid = self.plan, self.grid
        step = self.step
        clock = self.schedule.clocks(step)
        use_history = plan.chunks_per_way > 1
        if use_history:
            self.history.begin_step(step, self.config.snapshot_period)
        self.halo.begin(clock, read_history=use_history, write_history=use_history)
        localizer = Localizer(self._inputs, plan.chunked, plan.adjacency)
        span = way_ptr(plan.ptr, grid.ways)[grid.way:grid.way + 2].tolist()
        self.comm.counting = True
        records: List[_Record] = []
        runner = self._runner(plan, self._inputs)
        run = {"mine": None, "sites": None, "span": span, "runner": runner,
               "next": self._activation_of_next(plan, self._inputs), "rows": None}
        for c in self.schedule.order(step, grid.way):
            records.append(self._forward_chunk(plan, c, localizer, run))
        full = self._share_output(plan, run["mine"], span[0], span[1], "train")
        self.comm.flush()
        self.comm.counting = False
        if isinstance(run["rows"], RowCheck):
            self._rows_verdict(plan, run["rows"])
        return full[plan.graph.inv], (records, clock)

    def _forward_chunk(self, plan: Plan, c: int, localizer: Localizer, run: dict) -> _Record:
        """One chunk through this rank's stage: inputs cut to the chunk, values from the previous stage,
        the stage's program, values to the next stage (or the output rows, on the last stage)."""
        grid = self.grid
        runner = run["runner"]
        stage = getattr(runner, "stage", None)
        ctx = self._context(plan, plan.chunked, c, localizer, one_per_way=plan.chunks_per_way == 1)
        with ctx:
            args, kwargs = localizer.localize(c, ctx)
            received = self.link.recv(c, stage.inputs, True) if stage is not None and grid.prev is not None else {}
            check = None
            if run["rows"] is None:  # the pass's first chunk: checked (every chunk makes the same calls)
                check = run["rows"] = self._rows_check(plan, ctx, received) or False
            with check or contextlib.nullcontext():
                sent, out = runner.run(args, kwargs, received)
        run["sites"] = self._check_sites(ctx.sites, plan, run["sites"])
        lg, span = ctx.lg, run["span"]
        if grid.is_last:
            out = _check_output(out, lg.rows)
            if run["mine"] is None:
                run["mine"] = out.new_empty((span[1] - span[0], *out.shape[1:]))
            run["mine"][lg.start - span[0]:lg.end - span[0]] = out.detach()
        else:
            self.link.send(c, sent, run["next"])
        return _Record(c, ctx, received, sent, out if grid.is_last else None, stage.activation if stage else None)

    def _drain(self, grad: Tensor, state) -> None:
        """The backward of one training step: the chunks in reverse order, then the weight gradients
        summed where several ranks hold parts of them."""
        records, clock = state
        plan, grid = self.plan, self.grid
        use_history = plan.chunks_per_way > 1
        self.halo.begin(clock, read_history=use_history, write_history=use_history)
        self.halo.prepare(plan.training_graphs())
        self.comm.counting = True
        grad_new = grad[plan.graph.perm] if grid.is_last else None
        if not grid.is_last:
            self.link.expect_grads(records[-1].sent)
        for i, rec in enumerate(reversed(records)):
            self._backward_chunk(plan, rec, grad_new, first=i == 0)
        self.comm.flush()
        self._reduce_gradients(plan)
        self.comm.counting = False
        self.history.clear_grads()
        self.step += 1

    def _backward_chunk(self, plan: Plan, rec: _Record, grad_new: Optional[Tensor], first: bool) -> None:
        """One chunk's backward: gradients of what it sent (or of its output rows), then the gradients
        of what it received back to the previous stage."""
        grid = self.grid
        lg = rec.ctx.lg
        with rec.ctx:
            if grid.is_last:
                roots = [rec.out] if rec.out.requires_grad else []
                grads = [grad_new[lg.start:lg.end].to(rec.out.dtype)] if roots else []
            else:
                roots, grads = self.link.recv_grads(rec.chunk, rec.sent)
            if roots:
                torch.autograd.backward(roots, grads)
        if grid.prev is not None:
            self.link.send_grads(rec.chunk, rec.received, rec.activation, first=first)

    # ------------------------------------------------------------------ output and gradients
    def _share_output(self, plan: Plan, mine: Optional[Tensor], start: int, end: int, mode: str) -> Tensor:
        """The whole output (new vertex order) on every rank: each last-stage way sends its rows."""
        grid, comm = self.grid, self.comm
        S = grid.stages
        spec = self._specs.get(mode)
        if spec is None:
            if grid.is_last:
                mine = _check_output(mine, end - start)
                spec = (tuple(mine.shape[1:]), mine.dtype)
                if grid.way == 0:
                    for r in range(comm.world_size):
                        if r // grid.ways != S - 1:
                            comm.send_object(spec, r)
            else:
                spec = comm.recv_object(grid.rank_of(S - 1, 0))
            self._specs[mode] = spec
        shape, dtype = spec
        full = torch.empty((plan.num_nodes, *shape), dtype=dtype, device=comm.device)
        bounds = way_ptr(plan.ptr, grid.ways).tolist()
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

    def _reduce_gradients(self, plan: Plan) -> None:
        """Sums weight gradients where several ranks computed parts of them: parameters used by several
        stages over all ranks, a stage's own parameters over its ways."""
        grid = self.grid
        params = dict(self.module.named_parameters())
        shared = [n for n in params if len(plan.param_stages.get(n, ())) > 1]
        own = [n for n in params if plan.param_stages.get(n, {0}) == {grid.stage}]
        if shared and self.comm.world_size > 1:
            self._all_reduce([params[n] for n in shared], None, self.comm.world_size, self.comm.rank == 0)
        if grid.ways > 1 and own:
            self._all_reduce([params[n] for n in own], grid.stage_group, grid.ways, grid.way == 0)

    def _all_reduce(self, params: List[torch.nn.Parameter], group, size: int, first: bool) -> None:
        ref = next((p.grad for p in params if p.grad is not None), None)
        dtype = ref.dtype if ref is not None else params[0].dtype
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype)
                          for p in params])
        self.comm.all_reduce(flat, group, size, first)
        off = 0
        for p in params:
            n = p.numel()
            if p.grad is not None:
                p.grad.copy_(flat[off:off + n].view_as(p.grad))
            elif group is None:  # shared: every rank updates it identically
                p.grad = flat[off:off + n].view_as(p).clone()
            off += n

    def _check_sites(self, sites: List[Site], plan: Plan, reference: Optional[List[str]]) -> List[str]:
        """The call sites of one chunk's run, checked against the pass's first chunk (``reference``):
        every chunk of a pass must make the same layer calls, since the ways exchange at each of them.
        The first run of each mode also checks that the ways of the stage agree. Returns the keys."""
        keys = [f"{s.key}:{','.join(s.sources)}:{int(s.clean)}" for s in sites]
        if reference is not None:
            if keys != reference:
                first = next((i for i, (a, b) in enumerate(zip(reference, keys)) if a != b),
                             min(len(reference), len(keys)))
                raise UnsupportedModelError(
                    f"The forward made different propagate calls for different chunks (call {first}: "
                    f"{reference[first] if first < len(reference) else 'none'} for one chunk, "
                    f"{keys[first] if first < len(keys) else 'none'} for another): its control flow depends on the "
                    f"data. pyg_pipe needs the same layer calls for every chunk of a step.")
            return keys
        mode = "train" if self.module.training else "eval"
        if mode in self._verify:
            self._verify.discard(mode)
            if keys != plan.sites[mode]:
                raise UnsupportedModelError(
                    "The model makes other layer calls than when the checkpoint was saved (the model or its "
                    "arguments changed); resume with the same model, or start a new run without ckpt_path.")
        if mode not in plan.sites:
            plan.sites[mode] = keys
            if self.grid.ways > 1:
                digest = zlib.crc32("\n".join(keys).encode())
                both = torch.tensor([digest, -digest], dtype=torch.float64, device=self.comm.device)
                dist.all_reduce(both, op=dist.ReduceOp.MIN, group=self.grid.stage_group)
                if float(both[0]) != -float(both[1]):
                    raise UnsupportedModelError(
                        "The ways of a pipeline stage made different propagate calls in the same forward (their "
                        "control flow depends on their part of the graph); pyg_pipe needs the same calls on every "
                        "way.")
        return keys

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """For checkpoints: ``plan`` (the same on every rank) and ``rank`` (this rank's call sites and
        history)."""
        if self.plan is None:
            return {}
        return {"plan": self.plan.state(),
                "rank": {"sites": dict(self.plan.sites),
                         "history": self.history.state_dict() if self.history else None}}

    def load_state_dict(self, state: dict) -> None:
        """Resumes from :meth:`state_dict`: the next plan reuses the saved one (and checks it still fits)."""
        if not state:
            return
        self.saved = state
        if self.plan is not None:  # already planned: re-plan on the next call, from the saved state
            self.plan = None


def refuse_graph_builders(module: torch.nn.Module) -> None:
    """Refuses modules that build a new graph from the vertices' values (pooling), naming the module."""
    for name, m in module.named_modules():
        if type(m).__name__ in GRAPH_BUILDERS:
            raise UnsupportedModelError(
                f"Module '{name}' ({type(m).__name__}) builds a new graph from the vertices' values (pooling); "
                f"pyg_pipe cuts one fixed graph into chunks and cannot follow graphs built during the forward. "
                f"Train this model on one device (no pyg_pipe strategy).")


def _signature(module: torch.nn.Module, inputs: CallInputs) -> tuple:
    """What a traced program depends on besides tensor values: the module's mode, and which arguments
    are ``None``, tensors, ``Data`` (with which attributes) or Python values (baked in by tracing)."""
    from torch_geometric.data import Data

    def kind(v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return repr(v)
        if isinstance(v, Tensor):
            return "tensor"
        if isinstance(v, Data):
            return "data:" + ",".join(sorted(v.keys()))
        if isinstance(v, (tuple, list)):
            return tuple(kind(x) for x in v)
        return type(v).__name__

    return (module.training, tuple(kind(a) for a in inputs.args),
            tuple(sorted((k, kind(v)) for k, v in inputs.kwargs.items())))


def _checksum(tensors: List[Tensor]) -> tuple:
    """Sums of the values (plain and position-weighted): tells new values from the same ones."""
    out = []
    for t in tensors:
        v = t.detach().reshape(-1).double()
        pos = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device) % 997
        out.append((round(float(v.sum()), 9), round(float((v * pos).sum()), 6)))
    return tuple(out)


def _check_output(out, rows: int) -> Tensor:
    if not isinstance(out, Tensor) or out.dim() == 0 or out.size(0) != rows:
        what = f"a {type(out).__name__}" if not isinstance(out, Tensor) else f"shape {tuple(out.shape)}"
        raise UnsupportedModelError(
            f"The pipelined model must return one tensor with a row per vertex; its forward returned {what} for a "
            f"chunk of {rows} vertices. Return the node embeddings or logits only (compute auxiliary losses outside "
            f"the model).")
    return out


def sync_module_state(module: torch.nn.Module, owners: Dict[str, int], ranks: Sequence[int], group=None) -> None:
    """Copies every parameter and buffer from the rank of the stage that owns it to all ranks.

    Used before checkpoints and at the end of ``fit`` so that every rank (and so the user's model in
    the main process, whichever launcher ran) holds the whole trained model.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    tensors = dict(module.named_parameters())
    tensors.update(dict(module.named_buffers()))
    by_stage: Dict[int, List[Tensor]] = {}
    for name, t in tensors.items():
        by_stage.setdefault(owners.get(name, 0), []).append(t)
    with torch.no_grad():
        for s, ts in sorted(by_stage.items()):
            for dtype in sorted({t.dtype for t in ts}, key=str):
                same = [t for t in ts if t.dtype == dtype]
                flat = torch.cat([t.detach().reshape(-1) for t in same])
                dist.broadcast(flat, ranks[s], group=group)
                off = 0
                for t in same:
                    t.copy_(flat[off:off + t.numel()].view_as(t))
                    off += t.numel()
