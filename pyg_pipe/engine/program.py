"""What one stage runs for one chunk: the user's forward itself, or its part of a traced program.

* One stage (graph parallelism, or a pipeline of one): :class:`WholeForward` calls the model's own
  forward, as ordinary Python, with the chunk's inputs. Nothing is traced.
* Several stages: :class:`StageProgram` interprets the fx nodes of its stage
  (:mod:`pyg_pipe.model.split`): placeholders take the chunk's inputs, values from the previous stage
  arrive through the stage link, and each node calls the user's module or function unchanged, so the
  layer hooks (:mod:`pyg_pipe.engine.layers`) see every call as in an eager run.

Both return ``(sent, output)``: the values for the next stage, and the model's output (last stage).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.fx as fx

from ..model.split import Stage
from ..model.trace import Program, _is_generic_sequential


class WholeForward:
    """The model's own forward, run on a chunk's inputs."""

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
        return {n.name: values.get(n.target.lstrip("*")) for n in self.placeholders}

    def run(self, args: tuple, kwargs: dict, received: Dict[str, Any]) -> Tuple[Dict[str, Any], Any]:
        env = self.bind(args, kwargs)
        env.update(received)
        for node in self.stage.steps:
            env[node.name] = self._eval(node, env)
            for value in self._release.get(node.name, ()):
                env.pop(value, None)
        if self.last:
            return {}, env[self.stage.outputs[0]]
        return {name: env[name] for name in self.stage.outputs}, None

    def _eval(self, node: fx.Node, env: Dict[str, Any]):
        args = fx.node.map_arg(node.args, lambda n: env[n.name])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
        if node.op == "call_module":
            return self.program.modules[node.target](*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "get_attr":
            obj = self.module
            for part in node.target.split("."):
                obj = getattr(obj, part)
            return obj
        raise RuntimeError(f"unexpected fx node {node.op}")


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
