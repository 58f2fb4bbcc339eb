"""Passes over a chunk that measure the model and change nothing: the cost model of ``balance="time"``
(seconds each layer group takes in one no-grad pass over a chunk, :func:`layer_costs`), and the seconds of a
whole training pass over a chunk that ``num_chunks="auto"`` fits (:func:`training_pass_seconds`; over one chunk
a way, a layer group at a time, :func:`grouped_pass_seconds`; :mod:`.plan.chunk_cost`). What such a pass holds
is measured in :mod:`.pass_memory`.

Measured once per model, on one rank, in no-grad passes of the traced program over the first chunk of
the plan's chunking, run as the pipeline runs a chunk: the layer hooks cut the inputs to the chunk, a
layer reading the model's inputs computes the chunk's rows and their halo, every other layer the
chunk's rows, its sources joined to halo rows (zeros here: the pass times the layers, not their
values). What a chunk costs in the pipeline is what balances its stages: the first layer of PyG's
``GCN`` (it reads the input features, so it computes the halo rows too) took 2.1 - 2.3 x a mean
layer of a 32-layer GCN on a chunk of a 20,000-vertex graph cut in 32, against 0.9 - 1.25 x over the
whole graph, and the 8-stage split became ``[3, 4, 4, 4, 4, 4, 4, 5]`` instead of ``[4] * 8``. The
planner (:func:`.plan.choose_sizes`) broadcasts the result and splits the stages by
it, and the split is saved with the plan, never measured again. The passes change nothing: the
module's buffers (running statistics) are put back and the random number generators are forked, so
the ranks' random streams stay as they were.

One group's time in one pass is noisy: a 32-layer GCNII on a 20,000-vertex graph, measured four
times on a quiet 2-core machine over the whole graph with two passes each (the smaller time kept),
as this model did before, was split into 8 stages as ``[4, 4, 3, 6, 6, 3, 2, 4]`` once and
``[3, 4, 5, 5, 4, 4, 4, 3]`` another time, although 30 of its 32 groups are the same computation: a
stage given 6 such groups sets the pace of the whole pipeline at 1.5 x a balanced one. So the model
is made robust twice over:

* every step of the program is timed, ``PASSES`` passes over the chunk, and its cost is the smallest
  of its times: other work on the machine only ever adds time (a step of a millisecond descheduled
  once takes ten), and so does work done once and cached in the first pass (a layer's graph
  normalisation, the allocator's first requests); a median of five still let three slowed samples
  make PyG's GCN's first layer look 5 x dearer than it is on a loaded machine;
* steps that compute the same thing (:func:`step_signature`: the module's class and the shapes of
  its parameters and buffers, or the function or method called; which forward arguments it reads;
  the shapes of what it returns) get one cost, over all their times: the structure says they cost
  the same. A group's cost is the sum of its steps', so the groups at the ends, which hold one layer
  like the others plus the model's input and output steps, are as steady as the rest.

The same split measured as above came out ``[4, 4, 4, 4, 4, 4, 4, 4]`` every time (four times over
the whole graph, six over a chunk, some of them while other work ran).
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx

from ..graph.chunks import derived
from ..model.find import refuse_layer_tensors, vertex_tables
from ..model.inputs import CallInputs
from ..model.localize import Localizer
from ..model.split import Stage
from ..model.trace import Program
from .context import ChunkContext, leading_rows
from .runtime.program import StageProgram
from .runtime.runtime import chunk_graphs
from .runtime.statistics import Statistics
from .tree import flatten


#: passes of the cost model (the first one pays for what is cached: the smallest time leaves it out)
PASSES = 5
#: training passes timed for ``num_chunks="auto"`` (a whole pass, not one step: less noise per sample)
TRAINING_PASSES = 3


class _ChunkProbe:
    """The first chunk of a chunking, set up as the pipeline runs a chunk, for passes that measure the model
    on it and change nothing: :meth:`passes` forks the random number generators and puts the module's
    buffers (running statistics) back afterwards."""

    def __init__(self, module: torch.nn.Module, fn: Callable, program: Program, groups: list, inputs: CallInputs,
                 device, chunking: Optional[Tuple[Tensor, Tensor]], halo=None):
        self.module, self.device = module, device
        N = inputs.num_nodes
        perm, ptr = chunking if chunking is not None else (torch.arange(N), torch.tensor([0, N]))
        refuse_layer_tensors(module, N, ptr.numel() - 1)  # (before a pass over a cut graph could fail on one)
        self.cgs = chunk_graphs(inputs.graphs, N, perm, ptr, 1, device)
        self.localizer = Localizer(inputs, self.cgs, tables=vertex_tables(module, N))
        self.lg = self.cgs[0].chunks[0]
        self.halo = (halo or _Fillers()) if self.lg.halo.numel() else None
        self.derived: Dict[tuple, object] = {}
        self.cache: Dict = {}  # one chunk, pass after pass: what its layers cache (normalisations) is cached once
        self.steps = [n for g in groups for n in g]
        self.runner = StageProgram(program, Stage(0, self.steps, [], [n.name for n in program.output.all_input_nodes],
                                                  None), fn, True)
        self.cut = f"num_chunks={ptr.numel() - 1}" if ptr.numel() > 2 else None

    @contextmanager
    def refusing(self):
        """Measuring passes that fail are judged by the row check (:mod:`.step.rows`): a forward the check refuses
        by itself (a degree computed from the edges outside the layers, a read of neighbour rows outside propagate)
        can fail inside a pass over a cut graph (an index out of bounds); then one checked pass over the chunk turns
        the failure into the refusal the first training pass would give, named. Only on failure: a checked pass
        before every measuring one raised the plan's peak memory (docs/benchmarks.md), and a forward that passes
        the measuring passes is checked in every chunk of the first training pass anyway. The same on every rank:
        every rank measures the whole model on the same first chunk."""
        try:
            yield
        except Exception as exc:
            from ..model.errors import UnsupportedModelError
            if self.cut is None or isinstance(exc, UnsupportedModelError):
                raise
            refusal = self._check_rows(self.cut)
            if refusal is None:
                raise
            raise UnsupportedModelError(refusal) from exc

    def _check_rows(self, cut: str) -> Optional[str]:
        """What the row check refuses in one no-grad pass over the chunk, or None. (What it only finds, an
        operation over all rows, is left to the training pass: graph-wide norms are the engine's there.)"""
        from ..model.errors import UnsupportedModelError
        from .step.rows import RowCheck
        lg = self.lg
        check = RowCheck(lg.rows, {id(m): n for n, m in self.module.named_modules()}, cut)
        ctx = ChunkContext(self.cgs[0], lg, self.halo, self.localizer.resolver(0, self._derive),
                           Statistics(None, None, None, lg.rows, False), self.cache, check)
        # (what it caches, the measuring passes would cache: no second copy)
        try:
            with self.passes(), torch.no_grad(), ctx:
                env = self.runner.bind(*self.localizer.localize(0, ctx))
                with check:
                    for node in self.steps:
                        env[node.name] = self.runner.step(node, env)
                        for value in self.runner.release_after(node):  # no grad: values die after their last use
                            env.pop(value, None)
        except UnsupportedModelError as exc:  # a finding the chunk's rows cannot even run (``x @ W`` with W's rows
            return check.refusal or str(exc)   # cut): refused as the training pass would
        except Exception:  # (the check keeps indices in bounds; a failure it does not refuse is the caller's)
            pass
        return check.refusal

    def _derive(self, cg, kind):  # graphs derived from the inputs (transposes, DropEdge's), as the runtime derives them
        return derived(self.derived, cg, kind)

    def inputs(self):
        """A chunk context to enter and the call's arguments localized to the chunk in it."""
        lg = self.lg
        ctx = ChunkContext(self.cgs[0], lg, self.halo, self.localizer.resolver(0, self._derive),
                           Statistics(None, None, None, lg.rows, False), self.cache)
        return ctx, lambda: self.localizer.localize(0, ctx)

    @contextmanager
    def passes(self, params: Sequence[Tensor] = ()):
        """Passes that change nothing: the random streams forked, the buffers and ``params``' gradients put back."""
        cuda = torch.device(self.device).type == "cuda"
        buffers = {name: b.clone() for name, b in self.module.named_buffers()}
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            with torch.random.fork_rng(devices=[self.device] if cuda else []):
                yield
        finally:
            with torch.no_grad():
                for name, b in self.module.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])
            for p, g in zip(params, grads):
                p.grad = g


def release(device) -> None:
    """What the measuring passes leave behind once the plan is made: the fused kernels' cached transposes (and CSRs)
    of the probes' chunk graphs (each entry keeps its graph alive; the training graphs' are rebuilt at their first
    backward) and, on a CPU, the memory malloc keeps after the probes' frees. Measured before it (16-layer GCNII,
    20k vertices, 2 processes, ``grid="auto"``): rank 0 held 86 MB more after planning than with
    ``grid="pipeline"`` and peaked at 487 against 390 MB; with it, at 411 (that run chose 16 chunks) against 385.
    A later run through Lightning still peaked 100 MB higher: most of that was
    :func:`~.pass_memory.training_pass_memory` keeping its activations (fixed 2026-11-29, docs/gnnpipe.md)."""
    from ..memory import trim
    from ..ops import clear_cache
    clear_cache()
    if torch.device(device).type == "cpu":
        trim()


def layer_costs(module: torch.nn.Module, fn: Callable, program: Program, groups: list, inputs: CallInputs,
                device, passes: int = None, chunking: Optional[Tuple[Tensor, Tensor]] = None) -> List[float]:
    """Seconds per layer group of ``program`` (cut into ``groups``) for the call ``inputs``: the sum of its
    steps' costs, each the smallest time over ``passes`` passes (default :data:`PASSES`) of every step with
    its signature (module docstring). ``chunking``: the plan's ``(perm, ptr)``; the passes then run its first
    chunk as the pipeline runs a chunk (else the whole graph as one chunk)."""
    passes = PASSES if passes is None else passes
    cuda = torch.device(device).type == "cuda"
    probe = _ChunkProbe(module, fn, program, groups, inputs, device, chunking)
    steps = probe.steps
    times: Dict[str, List[float]] = {n.name: [] for n in steps}
    shapes: Dict[str, tuple] = {}
    with probe.refusing(), probe.passes(), torch.no_grad():
        for _ in range(passes):
            ctx, localize = probe.inputs()
            with ctx:
                _timed_pass(probe.runner, steps, localize(), times, shapes, device if cuda else None)
    cost = pooled([times[n.name] for n in steps], [step_signature(program, n, shapes[n.name]) for n in steps])
    each = dict(zip((n.name for n in steps), cost))
    return [sum(each[n.name] for n in g) for g in groups]


def training_pass_seconds(module: torch.nn.Module, fn: Callable, program: Program, groups: list,
                          inputs: CallInputs, device, passes: int = TRAINING_PASSES,
                          chunking: Optional[Tuple[Tensor, Tensor]] = None, halo=None) -> float:
    """Seconds of one training pass of the whole model over the first chunk of ``chunking``, as the pipeline
    runs a chunk: the forward with autograd recording, then the backward from the outputs (a gradient of ones)
    to the parameters, through the layer hooks; the smallest time over ``passes`` passes (the pass's compute), or
    with a ``halo`` exchanged the median (a step pays the typical wait at its exchanges, not the luckiest: on 2
    processes of this 2-core machine a 2-layer GCN's passes with exchanges took 16 - 38 ms). The parameters'
    gradients held before are put back afterwards, so no ``.grad`` changes. ``halo``: where the chunk's halo rows
    come from (default zeros; :class:`~.plan.way_probe.Exchangers`: from the other ways, exchanged, with the step's
    own exchanges of a way's output and its gradients timed in the pass: ``output`` after the forward, ``gradients``
    after the backward)."""
    cuda = torch.device(device).type == "cuda"
    probe = _ChunkProbe(module, fn, program, groups, inputs, device, chunking, halo)
    params = list(module.parameters())  # (a backward, not autograd.grad, which reentrant checkpoints refuse)
    ends = halo if halo is not None else _Fillers()  # (the step's own collectives around the pass, if any)
    times = []
    with probe.refusing(), probe.passes(params), torch.enable_grad():
        for _ in range(passes):
            ctx, localize = probe.inputs()
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with ctx:
                args, kwargs = localize()
                _, out = probe.runner.run(args, kwargs, {})
                roots = [t for t in flatten(out)[0] if isinstance(t, Tensor) and t.requires_grad]
                ends.output(roots)
                if roots:
                    torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
                ends.gradients(params)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            del out, roots
    return min(times) if halo is None else statistics.median(times)


def grouped_pass_seconds(module: torch.nn.Module, fn: Callable, program: Program, groups: list,
                         inputs: CallInputs, device, chunking: Tuple[Tensor, Tensor]) -> float:
    """Seconds of one training pass of the whole model over the first chunk of ``chunking``, taken one layer group
    at a time (``num_chunks="auto"``'s one chunk a way, :mod:`.plan.chunk_cost`): each group's forward with
    autograd from its inputs detached, then its backward from what it hands on (a gradient of ones), so that it
    holds one group's activations at a time (a stage running one chunk holds all of its groups'). The sum over the
    groups, the smaller of two passes (the first caches the layers' normalisations). Changes nothing, as
    :func:`training_pass_seconds`."""
    cuda = torch.device(device).type == "cuda"
    probe = _ChunkProbe(module, fn, program, groups, inputs, device, chunking)
    runner, params, best = probe.runner, list(module.parameters()), float("inf")
    group_of = {n.name: i for i, g in enumerate(groups) for n in g}
    last = {n.name: max((group_of.get(u.name, len(groups)) for u in n.users), default=-1)
            for g in groups for n in g}
    reads = [{a.name for n in g for a in n.all_input_nodes if group_of.get(a.name) != i} for i, g in enumerate(groups)]
    dies: List[List[str]] = [[] for _ in groups]   # per group, the values no later group reads (freed after it)
    for name, used in last.items():
        if used < len(groups):
            dies[max(used, group_of[name])].append(name)
    with probe.refusing(), probe.passes(params), torch.enable_grad():
        for _ in range(2):
            ctx, localize = probe.inputs()
            total = 0.0
            with ctx:
                env = runner.bind(*localize())
                for i, group in enumerate(groups):
                    for name in reads[i]:
                        env[name] = _detached(env[name])
                    if cuda:
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    for node in group:
                        env[node.name] = runner.step(node, env)
                    roots = [t for n in group if last[n.name] > i for t in flatten(env[n.name])[0]
                             if isinstance(t, Tensor) and t.requires_grad and t.is_floating_point()]
                    total += time.perf_counter() - t0
                    for n in group:  # what later groups read, copied: a backward may free what it hands on
                        if last[n.name] > i:  # (PyG's GroupAddRev rebuilds its input and frees its output's storage)
                            env[n.name] = _detached(env[n.name], copy=True)
                    t0 = time.perf_counter()
                    if roots:
                        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
                    if cuda:
                        torch.cuda.synchronize(device)
                    total += time.perf_counter() - t0
                    for name in dies[i]:
                        env.pop(name, None)
                    del roots
            best = min(best, total)
            del env
    return best


def _detached(value, copy: bool = False):
    """``value`` (a tensor, or a structure of them) with its tensors that ask for gradients cut from the autograd
    graph, still asking for them: a group's inputs, so that its backward stops there (the others are left as they
    are: the hooks know the model's inputs and graphs by identity); ``copy``: those tensors in storage of their own."""
    if isinstance(value, Tensor):
        if not value.requires_grad:
            return value
        return (value.detach().clone() if copy else value.detach()).requires_grad_()
    if isinstance(value, (tuple, list)):
        items = [_detached(v, copy) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _detached(v, copy) for k, v in value.items()}
    return value


def _timed_pass(runner: StageProgram, steps: list, inputs: tuple, times: Dict[str, List[float]],
                shapes: Dict[str, tuple], cuda_device) -> None:
    """One no-grad pass over ``steps``, each step's seconds appended to ``times`` (on a GPU after a device
    synchronise before and after: its host clock times launches), the shapes it returns kept once."""
    env = runner.bind(*inputs)
    for node in steps:
        if cuda_device is not None:
            torch.cuda.synchronize(cuda_device)
        t0 = time.perf_counter()
        env[node.name] = runner.step(node, env)
        if cuda_device is not None:
            torch.cuda.synchronize(cuda_device)
        times[node.name].append(time.perf_counter() - t0)
        shapes.setdefault(node.name, _shapes(env[node.name]))
        for value in runner.release_after(node):  # no grad: values die after their last use
            env.pop(value, None)


class _Fillers:
    """The halo rows of a profiling pass: zeros. The pass times the layers as the pipeline runs them on a
    chunk (a layer reading the model's inputs computes its halo rows too, the others the chunk's rows with
    their sources joined to halo rows), not their values. ``widths``: where each site's bytes a row are told."""

    def __init__(self, widths: Optional[Dict[str, float]] = None):
        self.widths = widths

    def join(self, key: str, cg, lg, t: Tensor, vdim: int) -> Tensor:
        if self.widths is not None:
            self.widths[key] = t.numel() // max(t.size(vdim), 1) * t.element_size()
        rows = leading_rows(t, vdim, lg.rows)
        shape = list(rows.shape)
        shape[vdim] = lg.num_local - lg.rows
        return torch.cat([rows, rows.new_zeros(shape)], dim=vdim)

    def output(self, roots: List[Tensor]) -> None:
        """A chunk's pass alone sends nothing after its forward."""

    def gradients(self, params: List[torch.nn.Parameter]) -> None:
        """... nor after its backward."""



def pooled(times: List[List[float]], signatures: List[tuple]) -> List[float]:
    """Each item's cost: the smallest of the times of every item with its signature."""
    by_signature: Dict[tuple, float] = {}
    for t, sig in zip(times, signatures):
        by_signature[sig] = min([by_signature.get(sig, float("inf"))] + list(t))
    return [by_signature[sig] for sig in signatures]


def step_signature(program: Program, node: fx.Node, returned: tuple) -> Tuple:
    """What one step computes, read off its structure: the class of the module called and the shapes and
    dtypes of its parameters and buffers (``call_module``), or the function or method called; which
    arguments of the forward it reads (a layer on ``edge_index`` and one on ``edge_index2`` may cost
    differently); and the shapes of what it returns (``returned``). Names and values play no part."""
    if node.op == "call_module":
        m = program.modules[node.target]
        what = (type(m).__qualname__,
                tuple((tuple(t.shape), t.dtype) for t in list(m.parameters()) + list(m.buffers())))
    elif node.op == "call_function":
        what = getattr(node.target, "__qualname__", repr(node.target))
    else:
        what = str(node.target)
    placeholders = {n.name for n in program.placeholders}
    reads = tuple(a.name for a in node.all_input_nodes if a.name in placeholders)
    return node.op, what, reads, returned


def _shapes(value) -> tuple:
    """The shapes and dtypes of the tensors in ``value`` (nested tuples and lists)."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_shapes(v) for v in value)
    return (type(value).__name__,)
