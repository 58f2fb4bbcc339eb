"""The engine facade: what the Lightning strategies call. It replaces ``model.forward`` while installed, and the
model's other methods that call its layers (a link predictor's ``encode``, :func:`~pyg_pipe.model.find.layer_methods`).

Every rank runs its part of the rank grid (:mod:`.plan.grid`): stage ``s`` of the model for way ``w``.
A call of the model is

* **training** (grad enabled, and inside a training step when the strategy says where steps are): a fill
  (:func:`.step.pipeline.fill`) in the forward pass and its drain (:func:`.step.pipeline.drain`) in the backward pass,
  one autograd Function around both, since Lightning zeroes gradients between ``training_step`` and
  ``backward``. Each call of the model in a step is numbered and has its own history, so a model run twice in
  one step (contrastive methods) is computed as twice on one device; at the end of the backward pass the weight
  gradients are summed once over the ranks that computed parts of them (:mod:`.runtime.weights`).
* **anything else** (validation, test, predict): an exact pass (:func:`.step.pipeline.exact`).

On one device with several chunks (or an offload tier) the model is **streamed** instead (:mod:`.step.stream`, NGra):
every layer group over all chunks in turn, exact, with the values between groups in the memory tiers; the same
autograd Function carries its forward and backward.

**Which method.** ``forward`` is distributed, and so is any other method of the model whose code calls its layers,
when it is called with a graph (``z = model.encode(x, edge_index)`` in PyG's link prediction; the decoder then runs
unchanged on the whole ``z``). A call made while another is running (``forward`` calling ``self.encode``, the engine
tracing) runs as written, inside the outer one. One method is distributed per model: the first one called; the
layers run through another later are refused by name.

The first call with a graph makes a plan (:mod:`.plan.plan`) and its runtime (:mod:`.runtime.runtime`); later calls
with the same graph reuse them. Every rank returns the whole output, so the user's loss and metrics run unchanged and
identically everywhere. The first call of each mode checks the module state it changed (:mod:`.step.state`). The
model object is not wrapped: an instance attribute ``forward`` is set while installed and removed after."""
from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

import torch
from torch import Tensor

from ..model.errors import UnsupportedModelError
from ..model.find import layer_methods, routes_forward, takes_graph, tensor_attributes, uncompiled
from ..model.inputs import CallInputs
from ..model.trace import as_layer_call, forward_function
from .step import pipeline as steps
from .step.checks import same_loss
from .step import capture, dropedge, state, stream
from .collector import older_objects_frozen
from .comm import Comm
from .context import autocast_as, autocast_state, current, in_backward
from .runtime.staleness import StalenessMeter
from .runtime.timeline import Timeline
from .config import PipelineConfig
from .plan.grid import RankGrid
from .step.layers import LayerHooks
from .reroute import Rerouted, caller
from .tree import unpack_rows
from .plan.plan import Plan, make_plan
from .plan.shape import Shape, decide_shape
from .plan.grid_cost import regrid
from .pass_memory import measuring_passes
from .profile import layer_costs, release
from .runtime.runtime import Runtime
from .step.norms import StatisticsHooks
from .runtime.weights import GradientSum

#: plans (and their runtimes) kept for recent graphs: a model may be called on several (an augmented copy of
#: the graph in the same step, another graph for validation); the primary one, trained on, is always kept
KEEP_RUNTIMES = 4


class _Fill(torch.autograd.Function):
    """The fill in ``forward``, the drain in ``backward``."""

    @staticmethod
    def forward(ctx, engine: "GNNPipeEngine", runtime: Runtime, inputs: CallInputs, call: int, anchor: Tensor):
        ctx.engine = engine
        ctx.autocast = autocast_state(engine.comm.device)  # mixed precision: the drain recomputes under it too
        with older_objects_frozen():  # (the collector's passes skip the process's older objects: .collector)
            if runtime.plan.streaming:  # (captured as CUDA graphs where it can be: step/capture.py)
                out, ctx.record = capture.forward(runtime, inputs, call, engine.config.cuda_graphs)
            else:
                with torch.enable_grad():
                    out, ctx.record = steps.fill(runtime, inputs, engine.step, call)
        engine._structure = ctx.record.structure  # the output is packed into one tensor (tree.pack_rows)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        engine, record = ctx.engine, ctx.record
        ctx.record = None
        with autocast_as(ctx.autocast), older_objects_frozen():
            engine._drained(grad, record)
        return None, None, None, None, None


class GNNPipeEngine:
    """Pipelined, graph-parallel or hybrid execution of one PyG model on this rank.

    Args:
        module: the user's model (its ``forward`` is routed through the engine while installed).
        config: the knobs (:class:`~.config.PipelineConfig`).
        comm: this rank's :class:`~.comm.Comm`.
        num_stages: pipeline stages S (``None``: from the devices and ``ways``; one a device, or fewer with ways).
        ways: graph-parallel ways W per stage (``None``: devices / S).
        min_ways: with both ``None``: the fewest ways to use (2 for ``strategy="gnnpipe_hybrid"``).
    """

    def __init__(self, module: torch.nn.Module, config: PipelineConfig, comm: Comm, num_stages: Optional[int] = None,
                 ways: Optional[int] = 1, min_ways: int = 1):
        config.validate()
        module = uncompiled(module)
        self.module, self.config, self.comm = module, config, comm
        self.requested, self.min_ways = (num_stages, ways), min_ways
        self.grid: Optional[RankGrid] = None
        self.runtime: Optional[Runtime] = None      # the primary runtime: the graph training steps start on
        self.step = 0
        self.setup_seconds = 0.0                    # planning and history passes
        self.notes: List[str] = []
        self.layer_hooks = LayerHooks(module, self._outside, lambda: self.plan)  # (the plan: refusals that need it)
        self.stat_hooks = StatisticsHooks(module)
        self._fn = as_layer_call(module, forward_function(module))
        self._shape: Optional[Shape] = None
        self._sizes: Optional[tuple] = None
        self.chunk_choice: Optional[tuple] = None   # num_chunks="auto" by an earlier engine: (count, step s, offload)
        # grid="auto": (stages, ways), measured once (or by an earlier engine)
        self.grid_choice: Optional[tuple] = None
        self.grid_report = None                     # ... and on the rank that measured, every candidate's prediction
        self._runtimes: List[Runtime] = []
        self._saved: Optional[dict] = None
        self._instance_forward = None
        self._grads: Optional[GradientSum] = None
        self._calls = 0                             # training calls of the model in this step
        self._ending: Optional[int] = None          # the backward pass whose end is queued
        self._steps_only = self._in_step = False
        self._structure = None                      # how the last training call's output unpacks
        self._methods: Dict[str, object] = {}       # the other methods routed (name -> plain function)
        self._entry: Optional[str] = None           # the method distributed: the first one called
        self._depth = 0                             # > 0 while a routed call runs (calls inside run as written)
        self._state_checked: set = set()            # the modes whose first call compared the modules' state
        self.timeline = Timeline(comm, on=comm.device.type == "cpu", keep=config.timeline_trace is not None)
        self.meter = StalenessMeter(on=config.staleness_meter)
    # ------------------------------------------------------------------ facts
    @property
    def plan(self) -> Optional[Plan]:
        return self.runtime.plan if self.runtime is not None else None

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
        return self.plan.owners if self.plan is not None else {}

    # ------------------------------------------------------------------ install / steps
    def install(self) -> None:
        """Routes ``module(...)`` through the engine and hooks its layers."""
        forward = forward_function(self.module)
        self._fn = self._fn if self._entry not in (None, "forward") else as_layer_call(self.module, forward)
        self._instance_forward = self.module.__dict__.get("forward")
        self._methods = self._methods or layer_methods(self.module)
        if routes_forward(self.module, forward, self._methods):  # (not when it reaches the layers through those)
            self.module.forward = Rerouted(self.module, functools.partial(self._routed, "forward", forward), forward)
        for name, fn in self._methods.items():
            self.module.__dict__[name] = Rerouted(self.module, functools.partial(self._routed, name, fn), fn)
        self.layer_hooks.install()
        self.stat_hooks.install()
        dropedge.install(self.module)

    def uninstall(self) -> None:
        for name in ("forward", *self._methods):
            self.module.__dict__.pop(name, None)
        if self._instance_forward is not None:
            self.module.forward = self._instance_forward
        self.layer_hooks.remove()
        self.stat_hooks.remove()
        dropedge.uninstall()

    def steps_only(self) -> None:
        """From now on only calls inside :meth:`training_step` train (others are exact passes), as the
        strategies want: a forward with gradients in a validation hook must not step the pipeline."""
        self._steps_only = True

    @contextmanager
    def training_step(self, step: Optional[int] = None) -> Iterator[None]:
        """Marks a training step (``step``: its number, else the engine counts backward passes)."""
        if step is not None:
            self.step = step
        self._calls = 0
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    def _outside(self, name: str, layer: torch.nn.Module) -> None:
        """A layer of the model ran without the engine. Inside a training step with gradients (under a
        strategy) that is a layer the user calls past the methods the engine routes (from the training step
        itself, or through a method not handed the graph): every process would train it on the whole graph,
        undistributed. Refused."""
        if layer is self.module or not (self._steps_only and self._in_step and torch.is_grad_enabled()):
            return  # (the model itself a layer: the user's call, routed through the engine)
        raise UnsupportedModelError(
            f"Layer '{name}' ({type(layer).__name__}) ran in a training step outside the methods of "
            f"{type(self.module).__name__} that pyg_pipe distributes (it was called through "
            f"{caller(self.module)}). pyg_pipe distributes the module's forward, or another method of it that "
            f"calls the layers and is handed the graph (edge_index, adj_t or a Data), such as encode(x, "
            f"edge_index); this layer would train undistributed on every process. Call the layers through such a "
            f"method of {type(self.module).__name__}, or pass model='<attribute>' to the strategy to name the "
            f"submodule whose forward runs them (a GAE's 'model.encoder').")

    # ------------------------------------------------------------------ calls
    def _routed(self, name: str, fn, *args, **kwargs):
        """A call of the routed method ``name`` (plain function ``fn``): distributed when it is the outermost
        one and, for a method other than forward, handed a graph; else run as written."""
        if self._depth or current() is not None or in_backward() or (
                name != "forward" and not takes_graph(args, kwargs)):
            return fn(self.module, *args, **kwargs)
        if self._entry is None:
            self._entry, self._fn = name, as_layer_call(self.module, fn)
        elif name != self._entry:
            cls = type(self.module).__name__
            raise UnsupportedModelError(
                f"{cls}.{name} runs the message-passing layers, but pyg_pipe already distributes {cls}.{self._entry} "
                f"(the first method called with the graph); it distributes one method per model. Call the layers "
                f"through one method: e.g. call model.{self._entry}(...) in every step, or make {name} call "
                f"self.{self._entry}(...).")
        before = tensor_attributes(self.module)
        self._depth += 1
        try:
            out = self(*args, **kwargs)
        finally:
            self._depth -= 1
        stored = [k for k, v in tensor_attributes(self.module).items() if before.get(k) is not v]
        if stored:  # a value stored on the model by each chunk: the last chunk's would be read after
            cls = type(self.module).__name__
            raise UnsupportedModelError(
                f"{cls}.{name} stores tensors on the model ({', '.join('self.' + k for k in stored)}); pyg_pipe runs "
                f"{name} once per chunk, so what a later call reads there would be one chunk's rows, not the whole "
                f"graph's. Return them from {name} instead (a tuple or dict of per-vertex tensors), or move "
                f"{name}'s layers into a submodule and pass model='<its attribute>' to the strategy.")
        return out

    def __call__(self, *args, **kwargs):
        key = (self.module.training, torch.is_grad_enabled() and (self._in_step or not self._steps_only))  # (a fill)
        if key in self._state_checked:
            return self._call(args, kwargs)
        out = state.checked(self.module, self.comm, key[1], lambda: self._runtime_for(CallInputs(args, kwargs)),
                            lambda: self._call(args, kwargs))
        self._state_checked.add(key)
        return out

    def _call(self, args, kwargs):
        inputs = CallInputs(args, kwargs)
        runtime = self._runtime_for(inputs)
        if not (torch.is_grad_enabled() and (self._in_step or not self._steps_only)):
            with torch.no_grad():
                if runtime.plan.streaming:
                    out, record = stream.forward(runtime, inputs, False, runtime.store(-1))
                    return unpack_rows(out, record.structure)
                return steps.exact(runtime, inputs)
        inputs.refuse_grad(type(self.module).__name__)
        call, self._calls = self._calls, self._calls + 1
        if call == 0:
            self.runtime = runtime  # the primary plan: the graph steps train on (saved in checkpoints)
        t0 = time.perf_counter()
        steps.prepare_history(runtime, inputs, call, self.step)  # an exact pass when the call's history needs one
        self.setup_seconds += time.perf_counter() - t0
        anchor = torch.zeros((), device=self.comm.device, requires_grad=True)
        return unpack_rows(_Fill.apply(self, runtime, inputs, call, anchor), self._structure)

    def _drained(self, grad: Tensor, record) -> None:
        """A call's drain, its weight-gradient parts collected; the first queues the end of the backward pass."""
        task = torch._C._current_graph_task_id()
        if self._ending != task:  # once per backward pass (a pass that failed queued nothing that ran)
            self._ending = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self.grid.ways > 1:
            same_loss(self.comm, grad)
        with self._grads.collecting():
            if isinstance(record, (stream.StreamRecord, capture.Replay)):
                capture.backward(grad, record)
            else:
                steps.drain(grad, record)

    def _end_backward(self) -> None:
        """The backward pass is over: weight gradients summed over their ranks, the step ends."""
        self._ending = None
        self.comm.counting = True
        try:
            self._grads.reduce()
        finally:
            self.comm.counting = False
        self.step += 1
        self._calls = 0
        self.timeline.end_step()
        self.meter.decide(self.comm, self.config.snapshot_period)  # (once: did any rank's forward draw random numbers)
        self.meter.end_step()
        self._bound_drift()

    def _bound_drift(self) -> None:
        """``max_staleness``: when the largest drift measured this step on any rank passed the bound, every
        history of every plan is refilled by an exact pass before the next step (one all-reduce of one number
        a step; the same decision on every rank). With probes (:mod:`.runtime.staleness`: dropout), when the
        last probe's drift per update times the age of the rows the next step would read passes it."""
        bound, rt, meter = self.config.max_staleness, self.runtime, self.meter
        if bound is None or rt is None or rt.plan.chunks_per_way == 1 or rt.plan.streaming:
            return
        drift = torch.tensor([meter.rate if meter.random else meter.last_drift], dtype=torch.float64,
                             device=self.comm.device)
        self.comm.all_reduce(drift, None, "the staleness bound", op="max")
        drift = float(drift)
        for runtime in self._runtimes:
            for history in runtime.history.calls.values():
                age = history.age_at(self.step, self.config.snapshot_period) if meter.random else 1
                if drift * age > bound:
                    history.refresh_due = True

    # ------------------------------------------------------------------ planning
    def _runtime_for(self, inputs: CallInputs) -> Runtime:
        """The runtime of the plan for ``inputs``' graph: a recent one, or a new plan (kept among the
        ``KEEP_RUNTIMES`` most recent, the primary one always)."""
        for rt in self._runtimes:
            if rt.plan.matches(inputs):
                if rt is not self._runtimes[0]:
                    self._runtimes.remove(rt)
                    self._runtimes.insert(0, rt)
                return rt
        t0 = time.perf_counter()
        try:
            rt = self._plan(inputs)
        finally:
            self.setup_seconds += time.perf_counter() - t0
        self._runtimes.insert(0, rt)
        if self.runtime is None:
            self.runtime = rt
        del self._runtimes[KEEP_RUNTIMES:]
        if self.runtime not in self._runtimes:
            self._runtimes.append(self.runtime)
        return rt

    def _plan(self, inputs: CallInputs) -> Runtime:
        comm = self.comm
        if self._shape is None:
            self._shape = decide_shape(self.module, inputs, comm.world_size, *self.requested, self.min_ways,
                                       self.config.split_points, self.config.streaming
                                       if self.config.streams(comm.world_size) else False, fn=self._fn)
            if self.config.grid == "auto" and self.requested in ((None, None), (None, 1)) and self.min_ways == 1:
                self._shape, self.grid_choice, self.grid_report = regrid(
                    self._shape, self.module, self._fn, self.config, inputs, comm, (self._saved or {}).get("plan"),
                    self.grid_choice, self.notes)
            self.notes += [n for n in self._shape.notes if n not in self.notes]
            self.grid = RankGrid(comm.rank, comm.world_size, self._shape.stages, self._shape.ways)
        shape, grid = self._shape, self.grid
        saved = self._saved or {}
        probe = (self.module, self._fn, shape.program, shape.groups, inputs, comm.device)  # (timed on a chunk)
        plan = make_plan(self.module, self.config, shape, inputs, comm, grid.rank_of(0, 0), sizes=self._sizes,
                         costs=lambda perm, ptr: layer_costs(*probe, chunking=(perm, ptr)), saved=saved.get("plan"),
                         notes=self.notes, chosen=self.chunk_choice, **measuring_passes(probe))
        release(comm.device)  # (what the measuring passes left)
        self._sizes = plan.sizes
        if self._grads is None:
            self._grads = GradientSum(self.module, plan.param_stages, grid, comm)
        rt = Runtime(plan, grid, comm, self.config, self.module, self._fn, inputs, self.timeline, self.meter)
        if shape.program is not None:
            rt.programs.seed(inputs, shape.program)
        rt.load_state_dict(saved.get("rank"))
        self._saved = None
        return rt

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """For checkpoints: ``plan`` (the same on every rank) and ``rank`` (this rank's call sites and
        history)."""
        if self.runtime is None:
            return {}
        return {"plan": self.plan.state(), "rank": self.runtime.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resumes from :meth:`state_dict`: the next plan reuses the saved one (and checks it still fits)."""
        if not state:
            return
        self._saved = state
        # planned already: plan again on the next call, from the saved decisions
        self.runtime, self._runtimes, self._sizes, self._grads = None, [], None, None
