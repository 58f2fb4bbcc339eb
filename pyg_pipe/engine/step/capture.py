"""Captured streaming steps: on one CUDA device, the streamed step replayed as two CUDA graphs.

Streaming (:mod:`.stream`) runs every layer group on every chunk, forward and again in the backward, and
for a fixed plan it launches the same kernels on the same shapes every step: what varies is the values of
the weights and of the inputs, read in place. On a GPU its cost is the host's (about 2 ms of Python per
chunk and layer, docs/benchmarks.md "On a GPU"), so it is captured (``torch.cuda.CUDAGraph``) and replayed::

    steps 0 .. WARMUP-1   eager: the plan's first-step decisions and checks, cached layers, lazy library
                          state; the forward is watched for random numbers (dropout)
    step WARMUP           forward: capture F = stream.forward and B = stream.backward (from a static output
                          gradient) into one memory pool, then replay F; backward: replay B
    later steps           forward: replay F, hand out a copy of its output;
                          backward: the output gradient into B's static input, replay B, then every
                          parameter's gradient += what B left in its static gradient

Both are captured on aliases of the parameters (:class:`_Leaves`: the same storage, autograd leaves of
their own), so B leaves this step's gradient alone in the aliases' ``.grad``; after each replay it is added
to (or becomes) the gradient the user holds, as an uncaptured backward does. Replays
read the weights where they were at capture, and the inputs from buffers of the captured step that each
replay copies the call's inputs into (a new tensor every step, as Lightning's move of the batch to the
device gives, is fine). A replay is refused (the call runs eager, and is captured again after ``WARMUP``
eager steps) when an input's shape or type differs, a graph differs from the captured one or was changed
in place, a parameter or buffer was replaced, or a module's plain attributes (``training``, a number the
user changes between steps), a parameter's ``requires_grad`` or the autocast settings changed. Python
values the forward reads from elsewhere (a global, a closure) are not seen: a model whose forward
depends on such values between steps needs ``cuda_graphs=False``. Random numbers are not captured: a model that draws
any in its forward (dropout) is not captured (one log line); nor a plan whose streamed values are not all
on the device (``offload``), nor a capture that fails (a host synchronisation, a value-dependent
allocation: the error is logged). The compiled kernels (``extensions/``) launch on the current stream, so
they are part of the graphs; the equality of captured and uncaptured training (tests/engine/test_capture.py,
tests/test_gpu.py) is the check. A captured step keeps each chunk's activations inside the capture (as the
eager step does where they fit, ``recompute``), so its backward does not replay the forward
(``KEEP_WHEN_CAPTURED`` in :mod:`.stream`; measured 1.4x faster on an H100, docs/benchmarks.md "Fifth GPU
run"); where such a capture fails (PyG's ``GCN`` did once, in the fourth GPU run, not since; the cause was
not found), the step is captured again after the warm-up, replaying activations, with one log line.
"""
from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ...model.inputs import CallInputs, same_graph
from ...ops import messages, transpose
from ..context import autocast_state
from ..runtime.runtime import Runtime
from ..runtime.store import Store
from . import stream

log = logging.getLogger("pyg_pipe")

#: eager steps before a capture
WARMUP = 2
#: captures of one plan before it stays eager (inputs or weights that change every few steps)
MAX_CAPTURES = 3


def forward(rt: Runtime, inputs: CallInputs, call: int, enabled: bool):
    """The streamed forward of a training call: captured or replayed where it can be (module docstring),
    else :func:`.stream.forward`. Returns the output and the record :func:`backward` takes."""
    store = rt.store(call)
    if not enabled or call != 0 or rt.comm.device.type != "cuda" or rt.comm.world_size != 1:
        return stream.forward(rt, inputs, True, store)
    if rt.captured is None:
        rt.captured = CapturedStep(rt)
    return rt.captured.forward(inputs, store)


def backward(grad: Tensor, record) -> None:
    """The backward of :func:`forward`'s record."""
    if isinstance(record, Replay):
        record.step.replay_backward(grad)
    else:
        stream.backward(grad, record)


class Replay:
    """The record of a replayed forward (its backward replays B)."""

    def __init__(self, step: "CapturedStep"):
        self.step, self.structure = step, step.structure


class CapturedStep:
    """The captured forward and backward of one plan's streamed training call (module docstring)."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.device = rt.comm.device
        self.warm = 0
        self.captures = 0
        self.replays = 0
        self.off: Optional[str] = None             # why this plan stays eager
        self.keep_inside = True                    # False after a capture keeping activations failed
        self.graphs: Optional[Tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = None
        self.out: Optional[Tensor] = None
        self.grad_in: Optional[Tensor] = None
        self.grads: List[Tuple[torch.nn.Parameter, Tensor]] = []
        self.structure = None
        self._inputs: list = []
        self._signature = None
        self._alive = None
        if rt.config.offload is not None:
            self._stop(f"offload={rt.config.offload!r} keeps streamed values off the device")

    # ------------------------------------------------------------------ forward
    def forward(self, inputs: CallInputs, store: Store):
        if self.off is None and self.graphs is not None and not self._bind(inputs):
            self._drop()
        if self.off is not None:
            return stream.forward(self.rt, inputs, True, store)
        if self.graphs is None:
            if self.warm < WARMUP:
                self.warm += 1
                before = torch.cuda.get_rng_state(self.device), torch.get_rng_state()
                out, record = stream.forward(self.rt, inputs, True, store)
                if not (torch.equal(before[0], torch.cuda.get_rng_state(self.device))
                        and torch.equal(before[1], torch.get_rng_state())) or self.rt.draws_edges:
                    self._stop("the model draws random numbers in its forward (dropout, DropEdge), which a replay "
                               "would not redraw as an uncaptured step does")
                return out, record
            other = sorted({type(v).__name__ for v in _flat(inputs) if not isinstance(v, _REPLAYABLE)})
            if other:
                self._stop(f"its inputs include {', '.join(other)} (a replay can check tensors and numbers only: "
                           f"pass the tensors, e.g. model(data.x, data.edge_index))")
                return stream.forward(self.rt, inputs, True, store)
            if self.captures >= MAX_CAPTURES:
                self._stop(f"captured {self.captures} times; its inputs or weights keep changing (pass the same "
                           f"input tensors every step and update weights in place)")
                return stream.forward(self.rt, inputs, True, store)
            try:
                self._capture(inputs, store)
            except Exception as exc:  # noqa: BLE001 - whatever stops a capture leaves the plan eager, logged
                torch.cuda.synchronize(self.device)
                store.clear()
                self.graphs = None
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                if self._keeps_inside():  # once more after the warm-up, replaying activations as by default
                    self.keep_inside, self.warm = False, 0
                    log.info("pyg_pipe: the capture keeping activations failed (%s); capturing again, replaying "
                             "them", why)
                else:
                    self._stop(f"the capture failed ({why})")
                return stream.forward(self.rt, inputs, True, store)
        self.graphs[0].replay()
        self.replays += 1
        return self.out.clone(), Replay(self)

    def _keeps_inside(self) -> bool:
        """Whether a capture now keeps activations (:data:`.stream.KEEP_WHEN_CAPTURED`, not yet failed here)."""
        return stream.KEEP_WHEN_CAPTURED and self.keep_inside and self.rt.stream_keep is True

    def _capture(self, inputs: CallInputs, store: Store) -> None:
        rt, dev = self.rt, self.device
        fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(dev)
        torch.clear_autocast_cache()
        static = self._static_inputs(inputs)
        with _uncached_autocast(dev), _Leaves(rt.module) as leaves:
            with torch.cuda.graph(fwd, pool=pool):
                out, record = stream.forward(rt, static, True, store)
            self.grad_in = torch.zeros_like(out)
            with torch.cuda.graph(bwd, pool=pool):
                stream.backward(self.grad_in, record)
        self.grads = [(p, a.grad) for p, a in leaves.pairs if a.grad is not None]
        self.out, self.structure, self.graphs = out, record.structure, (fwd, bwd)
        # the graphs read tensors made before the capture at their addresses (cached cuts, normalisations, index
        # tensors, the kernels' transposes and edge weights): hold every one the record and the caches hold now, so
        # none is freed and reused
        self._alive = (record, leaves, dict(rt.layer_cache), {k: (dict(v) if isinstance(v, dict) else v)
                                                              for k, v in rt.adjacency.items()},
                       transpose.held(), messages.held())
        self.captures += 1
        self._signature = self._now()
        log.info("pyg_pipe: the streamed step is captured as CUDA graphs (%d chunks; replays from the next call; "
                 "PipelineConfig(cuda_graphs=False) turns it off)", rt.graph.num_chunks)

    # ------------------------------------------------------------------ backward
    def replay_backward(self, grad: Tensor) -> None:
        self.grad_in.copy_(grad)
        self.graphs[1].replay()
        fresh, add = [], []
        for p, g in self.grads:
            if p.grad is None:
                p.grad = g.clone()
            else:
                fresh.append(p.grad)
                add.append(g)
        if fresh:
            torch._foreach_add_(fresh, add)

    # ------------------------------------------------------------------ validity
    def _now(self) -> tuple:
        """What a replay depends on besides the inputs: where the weights and buffers are, which weights need
        gradients, every module's plain attributes (numbers, strings, flags: ``training``, a coefficient the
        user schedules) and the autocast settings."""
        m = self.rt.module
        return (tuple((p.data_ptr(), p.requires_grad) for p in m.parameters()),
                tuple(b.data_ptr() for b in m.buffers()),
                tuple((k, v) for x in m.modules() for k, v in x.__dict__.items() if type(v) in _PLAIN),
                autocast_state(self.device))

    def _static_inputs(self, inputs: CallInputs) -> CallInputs:
        """The call's arguments for the capture: every tensor that is not a graph copied into a buffer of the
        captured step (each replay copies the call's values in, so a new tensor every step, as Lightning's
        move of the batch to the device gives, replays too); graphs as given (a replay checks that the call's
        graphs are these: the same object and version, or equal)."""
        graphs = inputs.graphs
        planned = dict(zip(map(id, graphs), (g for g, _ in self.rt.plan.graphs)))
        self._inputs = []

        def static(v):
            if isinstance(v, Tensor) and not any(v is g for g in graphs):
                v = v.detach().clone()
                self._inputs.append(("copy", v, None))
            elif isinstance(v, Tensor):
                first = planned.get(id(v))
                if first is not None and same_graph(first, v):  # the tensor the chunks' graphs were cut from,
                    v = first                                    # so the capture cuts nothing (no host syncs)
                self._inputs.append(("graph", v, v._version))
            else:
                self._inputs.append(("plain", v, None))
            return v
        args = tuple(static(v) for v in inputs.args)
        kwargs = {k: static(inputs.kwargs[k]) for k in sorted(inputs.kwargs)}
        return CallInputs(args, kwargs)

    def _bind(self, inputs: CallInputs) -> bool:
        """Whether a replay computes this call (module docstring); if so, the call's tensors are copied into
        the captured step's buffers."""
        flat = _flat(inputs)
        if len(flat) != len(self._inputs) or self._now() != self._signature:
            return False
        copies = []
        for value, (kind, held, version) in zip(flat, self._inputs):
            if kind == "plain":
                if not _same_plain(value, held):
                    return False
            elif not isinstance(value, Tensor):
                return False
            elif kind == "graph":
                if held._version != version or not same_graph(value, held):
                    return False
            elif (value.shape, value.dtype, value.device, value.layout) != (held.shape, held.dtype, held.device,
                                                                          held.layout):
                return False
            else:
                copies.append((held, value))
        for held, value in copies:
            held.copy_(value)
        return True

    def _drop(self) -> None:
        self.graphs, self.out, self.grad_in, self.grads, self.warm, self._alive = None, None, None, [], 0, None

    def _stop(self, why: str) -> None:
        self._drop()
        self.off = why
        log.info("pyg_pipe: the streamed step runs uncaptured: %s.", why)


class _Leaves:
    """Inside the block every parameter that needs a gradient is replaced in its module by an alias of its
    storage (``p.detach().requires_grad_()``): the captured graphs own their autograd leaves. A parameter's
    own leaf node is shared with whatever graph of an earlier step is still alive (a user who holds the last
    step's loss, as a plain ``for`` loop does while the next forward runs), and that node belongs to the
    stream it was made on: a capture reaching it synchronises with the default stream, which breaks the
    capture. Weights stay where they are (optimisers update them in place; a replay reads them there);
    gradients land in each alias's ``.grad`` (:meth:`CapturedStep.replay_backward` adds them to the
    parameter's)."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.pairs, self._swapped = module, [], []

    def __enter__(self) -> "_Leaves":
        alias = {}
        for p in self.module.parameters():
            if p.requires_grad:
                alias[id(p)] = p.detach().requires_grad_()
                self.pairs.append((p, alias[id(p)]))
        for m in self.module.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) in alias:
                    m._parameters[name] = alias[id(p)]
                    self._swapped.append((m, name, p))
        return self

    def __exit__(self, *exc) -> bool:
        for m, name, p in self._swapped:
            m._parameters[name] = p
        self._swapped = []
        return False


def _flat(inputs: CallInputs) -> list:
    return list(inputs.args) + [inputs.kwargs[k] for k in sorted(inputs.kwargs)]


_PLAIN = (int, float, bool, str, type(None))

#: the arguments a replay can check: tensors (the same object, not changed in place) and plain values (equal);
#: not a ``Data``, say, whose tensors may have been replaced while the object stays the same
_REPLAYABLE = (Tensor, int, float, str, bool, type(None))


def _same_plain(a, b) -> bool:
    """Whether two plain (non-tensor) arguments are the same for a replay."""
    return type(a) is type(b) and a == b


def _uncached_autocast(dev: torch.device) -> ExitStack:
    """The autocast settings in force, with autocast's cast cache off: a cast cached outside a capture and
    read inside it would be replayed stale (weights change every step)."""
    stack = ExitStack()
    for device_type, enabled, dtype in autocast_state(dev):
        if enabled:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=False))
    return stack
