"""The cost model of ``balance="time"``: seconds each layer group takes in one pass over the whole graph.

Measured once per model, on one rank, in no-grad passes of the traced program with the whole graph
as one chunk (no halo): two passes, each group's cost the smaller of its two times, so that work
done once and cached (a layer's graph normalisation, the allocator's first requests) does not make
the first layers look dearer than they are at every step; the planner (:func:`pyg_pipe.engine.plan.choose_sizes`) broadcasts the
result and splits the stages by it, and the split is saved with the plan, never measured again.
The pass changes nothing: the module's buffers (running statistics) are put back and the random
number generators are forked, so the ranks' random streams stay as they were.
"""
from __future__ import annotations

import time
from typing import Callable, List

import torch

from ..model.inputs import CallInputs, Localizer
from ..model.split import Stage
from ..model.trace import Program
from .context import ChunkContext
from .program import StageProgram
from .runtime import chunk_graphs
from .statistics import Statistics


def layer_costs(module: torch.nn.Module, fn: Callable, program: Program, groups: list, inputs: CallInputs,
                device) -> List[float]:
    """Seconds per layer group of ``program`` (cut into ``groups``) for the call ``inputs``."""
    N = inputs.num_nodes
    whole = chunk_graphs(inputs.graphs, N, torch.arange(N), torch.tensor([0, N]), 1, device)
    localizer = Localizer(inputs, whole)
    lg = whole[0].chunks[0]
    ctx = ChunkContext(whole[0], lg, None, localizer.resolver(0, lambda cg, kind: cg), Statistics(None, None, None, N,
                                                                                                  False), {})
    everything = Stage(0, [n for g in groups for n in g], [], [program.output.args[0].name], None)
    runner = StageProgram(program, everything, fn, True)
    costs = [float("inf")] * len(groups)
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    devices = [device] if torch.device(device).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), ctx:
            for _ in range(2):
                args, kwargs = localizer.localize(0, ctx)
                env = runner.bind(args, kwargs)
                for k, group in enumerate(groups):
                    t0 = time.perf_counter()
                    for node in group:
                        env[node.name] = runner.step(node, env)
                        for value in runner.release_after(node):  # no grad: values die after their last use
                            env.pop(value, None)
                    costs[k] = min(costs[k], time.perf_counter() - t0)
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    return costs
