"""What one stage runs for one chunk: the user's forward itself, or its part of a traced program.

* One stage (graph parallelism, or a pipeline of one): :class:`WholeForward` calls the model's own
  forward, as ordinary Python, with the chunk's inputs. Nothing is traced.
* Several stages: :class:`StageProgram` interprets the fx nodes of its stage
  (:mod:`pyg_pipe.model.split`): placeholders take the chunk's inputs, values from the previous stage
  arrive through the stage link, and each node calls the user's module or function unchanged, so the
  layer hooks (:mod:`..step.layers`) see every call as in an eager run.

Both return ``(sent, output)``: the values for the next stage, and the model's output (last stage).
A traced forward bakes in ``self.training`` and the arguments that are not tensors, so
:class:`Programs` keeps one traced program per kind of call (:func:`signature`), each cut with the
plan's stage split.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch import Tensor

from ...model.errors import UnsupportedModelError
from ...model.inputs import CallInputs
from ...model.split import Stage, split, stage_groups
from ...model.trace import Program, _is_generic_sequential, trace
from ..context import current


class WholeForward:
    """The model's own forward, run on a chunk's inputs."""

    stage = None

    def __init__(self, module: torch.nn.Module, fn: Callable):
        self.module, self.fn = module, fn

    def run(self, args: tuple, kwargs: dict, received: Dict[str, Any]) -> Tuple[Dict[str, Any], Any]:
        return {}, self.fn(self.module, *args, **kwargs)


class StageProgram:
    """Stage ``stage`` of a traced ``program``."""

    def __init__(self, program: Program, stage: Stage, fn: Callable, last: bool):
        self.program, self.stage, self.fn, self.last = program, stage, fn, last
        self.module = program.root
        self.placeholders = program.placeholders
        self.generic = _is_generic_sequential(self.module, fn)
        self._release = _last_uses(stage.steps, set(stage.outputs))
        self._python = {n.name for n in stage.steps if n.op == "call_function" and
                        getattr(n.target, "__module__", None) in ("_operator", "operator", "math", "builtins")}
        # calls numbered in the whole forward's order, whichever stage runs them (DropEdge's: :mod:`..step.dropedge`)
        numbered = [n for n in program.graph.nodes if n.op == "call_function" and getattr(n.target, "numbered", False)]
        self._ordinal = {n.name: i for i, n in enumerate(numbered)}

    def bind(self, args: tuple, kwargs: dict) -> Dict[str, Any]:
        """Placeholder name -> value for a call with ``args`` / ``kwargs``."""
        if self.generic:
            names = list(self.module.signature.param_dict)
            values = dict(zip(names, args))
            values.update(kwargs)
        else:
            sig = inspect.signature(self.fn)
            bound = sig.bind(self.module, *args, **kwargs)
            bound.apply_defaults()
            values = dict(bound.arguments)
        # an argument baked in by tracing (a Python value) has a renamed placeholder holding its value
        return {n.name: values[n.target.lstrip("*")] if n.target.lstrip("*") in values else
                (n.args[0] if n.args else None) for n in self.placeholders}

    def run(self, args: tuple, kwargs: dict, received: Dict[str, Any]) -> Tuple[Dict[str, Any], Any]:
        env = self.bind(args, kwargs)
        env.update(received)
        for node in self.stage.steps:
            env[node.name] = self.step(node, env)
            for value in self._release.get(node.name, ()):
                env.pop(value, None)
        if self.last:  # the forward's return value: one tensor, or a tuple / dict of them
            return {}, fx.node.map_arg(self.program.output.args[0], lambda n: env[n.name])
        return {name: env[name] for name in self.stage.outputs}, None

    def step(self, node: fx.Node, env: Dict[str, Any]):
        """Runs one fx node with its arguments taken from ``env``."""
        args = fx.node.map_arg(node.args, lambda n: env[n.name])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
        if node.op == "call_module":
            return self.program.modules[node.target](*args, **kwargs)
        if node.op == "call_function":
            if node.name in self._ordinal:
                current().drops = self._ordinal[node.name]
            out = node.target(*args, **kwargs)
            if node.name in self._python and type(out) is float:  # (a count made a plain float: the row check)
                ctx = current()
                if ctx is not None and ctx.observer is not None:
                    ctx.observer.python_op(node.name, args, kwargs, out)
            return out
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "get_attr":
            obj = self.module
            for part in node.target.split("."):
                obj = getattr(obj, part)
            return obj
        raise RuntimeError(f"unexpected fx node {node.op}")

    def release_after(self, node: fx.Node) -> Sequence[str]:
        """The values whose last use is ``node`` (a no-grad pass can drop them there)."""
        return self._release.get(node.name, ())


#: the code objects that run the user's forward: the row check walks up to them to find the model's line
RUNNER_CODES = frozenset({WholeForward.run.__code__, StageProgram.run.__code__})
STEP_CODE = StageProgram.step.__code__


class Programs:
    """This stage's runner for every kind of call: the forward itself (one stage), or this stage's part
    of the program traced for that kind of call, cut with the plan's layer groups per stage.

    Args:
        module: the user's model.
        fn: its plain forward function.
        sizes: layer groups per stage (``None``: one stage, nothing traced; ones when the stages are the
            user's marked segments, ``pipe_split()``).
        split_points: the configured ``split_points``.
        stage: this rank's stage; ``last``: whether it is the last.
    """

    def __init__(self, module: torch.nn.Module, fn: Callable, sizes: Optional[Sequence[int]], split_points,
                 stage: int, last: bool):
        self.module, self.fn = module, fn
        self.sizes, self.split_points = sizes, split_points
        self.stage, self.last = stage, last
        self._cache: Dict[tuple, Tuple[Any, Optional[List[Stage]]]] = {}
        self._every: Dict[tuple, List[StageProgram]] = {}

    def seed(self, inputs: CallInputs, program: Program) -> None:
        """Keeps a program traced while planning for calls like ``inputs`` (no second trace)."""
        if self.sizes is not None:
            self._cache[signature(self.module, inputs)] = self._cut(program)

    def runner(self, inputs: CallInputs):
        """What this stage runs for a call like ``inputs``."""
        return self._get(inputs)[0]

    def stage_runners(self, inputs: CallInputs) -> list:
        """Every stage's runner for a call like ``inputs``, in order (streaming runs them one after another
        on one device, :mod:`..step.stream`; an untraced forward is one)."""
        if self.sizes is None:
            return [WholeForward(self.module, self.fn)]
        key = signature(self.module, inputs)
        hit = self._every.get(key)
        if hit is None:
            runner, stages = self._get(inputs)
            hit = self._every[key] = [StageProgram(runner.program, st, self.fn, i == len(stages) - 1)
                                      for i, st in enumerate(stages)]
        return hit

    def next_activation(self, inputs: CallInputs) -> Optional[str]:
        """The value feeding the next stage's first layer (its traffic counts as stage activations)."""
        stages = self._get(inputs)[1]
        return stages[self.stage + 1].activation if stages and self.stage + 1 < len(stages) else None

    def _get(self, inputs: CallInputs):
        if self.sizes is None:
            return WholeForward(self.module, self.fn), None
        key = signature(self.module, inputs)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._cut(trace(self.module, inputs.args, inputs.kwargs, self.fn))
        return hit

    def _cut(self, program: Program):
        groups, _ = stage_groups(program, self.split_points)
        want = sum(self.sizes)
        if len(groups) != want:
            raise UnsupportedModelError(
                f"{type(self.module).__name__} runs {len(groups)} pipeline units for this call but {want} for the "
                f"first one (in {'training' if self.module.training else 'eval'} mode, or with other arguments "
                f"given); pyg_pipe needs the same layers in every call.")
        stages = split(program, groups, self.sizes)
        return StageProgram(program, stages[self.stage], self.fn, self.last), stages


def signature(module: torch.nn.Module, inputs: CallInputs) -> tuple:
    """What a traced program depends on besides tensor values: the module's mode, and which arguments
    are ``None``, tensors, ``Data`` (with which attributes) or Python values (baked in by tracing)."""
    return (module.training, tuple(_kind(a) for a in inputs.args),
            tuple(sorted((k, _kind(v)) for k, v in inputs.kwargs.items())))


def _kind(v):
    from torch_geometric.data import Data
    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)
    if isinstance(v, Tensor):
        return "tensor"
    if isinstance(v, Data):
        return "data:" + ",".join(sorted(v.keys()))
    if isinstance(v, (tuple, list)):
        return tuple(_kind(x) for x in v)
    return type(v).__name__


def _last_uses(steps: List[fx.Node], keep) -> Dict[str, List[str]]:
    """For every step, the values whose last use (within ``steps``) it is, except ``keep``."""
    last: Dict[str, str] = {}
    for node in steps:
        for a in node.all_input_nodes:
            last[a.name] = node.name
    out: Dict[str, List[str]] = {}
    for value, user in last.items():
        if value not in keep:
            out.setdefault(user, []).append(value)
    return out
