"""What one training pass of the model over a chunk holds (:func:`training_pass_memory`): the memory model's
measurements (:mod:`.plan.first_step`, :mod:`.plan.memory_fit`), taken on the same probe chunk as the timing passes
of :mod:`.profile`, and changing nothing either."""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
from torch import Tensor, fx

from ..model.inputs import CallInputs
from ..model.trace import Program
from .plan.first_step import PassDetail, PassMemory
from .profile import _ChunkProbe, _Fillers, grouped_pass_seconds, training_pass_seconds
from .tree import flatten


def training_pass_memory(module: torch.nn.Module, fn: Callable, program: Program, groups: list,
                         inputs: CallInputs, device, chunking: Tuple[Tensor, Tensor],
                         way_chunking: Tuple[Tensor, Tensor]) -> PassMemory:
    """:class:`PassMemory` from one training pass of the whole model over the first chunk of ``chunking``, run
    as :func:`training_pass_seconds` runs it, step by step: the storages autograd saves are counted
    (:class:`~.step.chunk.SavedBytes`, as the first training fill counts a kept chunk), each step's value is
    kept to measure what crosses each cut between ``groups``, and the halo joins report their sites' widths;
    then a no-grad pass over the first chunk of ``way_chunking`` (one chunk a way, as the exact passes run) for
    what the layers cache there. Changes nothing (the gradients, buffers and random streams are put back)."""
    from .plan.memory_cost import reachable, storages
    from .step.chunk import SavedBytes, input_storages
    probe = _ChunkProbe(module, fn, program, groups, inputs, device, chunking)
    params = list(module.parameters())
    exclude = input_storages(module, inputs)
    for d in inputs.data:  # (and what ``Data`` arguments carry)
        for _, v in d.items():
            if isinstance(v, Tensor):
                exclude |= storages(v)
    widths: Dict[str, float] = {}
    if probe.halo is not None:
        probe.halo = _Fillers(widths)
    rows = probe.lg.rows
    by_group: List[Dict[int, int]] = []   # every storage each group's steps saved
    group_widths: List[float] = []
    with probe.refusing(), probe.passes(params), torch.enable_grad():
        ctx, localize = probe.inputs()
        with ctx, SavedBytes(True, exclude, no_backward=True) as saved:
            args, kwargs = localize()
            env = probe.runner.bind(args, kwargs)
            for group in groups:
                saved.storages, sites = {}, len(widths)
                for node in group:
                    env[node.name] = probe.runner.step(node, env)
                by_group.append(saved.storages)
                group_widths.append(sum(list(widths.values())[sites:]))
            out = fx.node.map_arg(program.output.args[0], lambda n, values=env: values[n.name])
        kept: Dict[int, int] = {}
        for found in by_group:
            kept.update(found)
        output: Dict[int, int] = {}
        for t in flatten(out)[0]:
            if isinstance(t, Tensor):
                output.update(reachable([t], exclude))
        kept.update(output)
        crossing = _crossing(program, groups, env, exclude)
    del env, out, saved  # (before the way's pass)
    cache = reachable([probe.cache, probe.localizer._adjacency], exclude | set(reachable([probe.cgs])))
    way = _ChunkProbe(module, fn, program, groups, inputs, device, way_chunking)
    with way.refusing(), way.passes(), torch.no_grad():
        ctx, localize = way.inputs()
        with ctx:
            args, kwargs = localize()
            way.runner.run(args, kwargs, {})
        way_cache = reachable([way.cache, way.localizer._adjacency], exclude | set(reachable([way.cgs])))
    return PassMemory(sum(kept.values()) / rows, max((sum(c.values()) for c in crossing), default=0.0) / rows,
                      sum(widths.values()), sum(cache.values()) / max(probe.lg.num_edges, 1),
                      sum(way_cache.values()) / max(way.lg.num_edges, 1),
                      float(sum(p.numel() * p.element_size() for p in params)),
                      PassDetail(rows, by_group, group_widths, crossing, output))


def _crossing(program: Program, groups: list, env: dict, exclude) -> List[Dict[int, int]]:
    """Per cut between consecutive ``groups``: the storages of the values made before it and used after it."""
    from .plan.memory_cost import reachable
    group_of = {n.name: i for i, g in enumerate(groups) for n in g}
    last = len(groups)
    cuts: List[Dict[int, int]] = [dict() for _ in range(max(len(groups) - 1, 0))]
    for i, g in enumerate(groups):
        for n in g:
            used = max((group_of.get(u.name, last) for u in n.users), default=i)
            if used > i and i < last - 1:  # (its storages found once, for every cut it crosses)
                found = reachable([env.get(n.name)], exclude)
                for cut in range(i, min(used, last - 1)):
                    cuts[cut].update(found)
    return cuts


def measuring_passes(probe: tuple) -> Dict[str, Callable]:
    """The passes :func:`~.plan.plan.make_plan` measures the model with, over chunkings it gives, for ``probe`` =
    ``(module, fn, program, groups, inputs, device)``: a training pass's seconds, the same over one chunk a way a
    layer group at a time, and what a training pass holds."""
    return {"pass_seconds": lambda *cut: training_pass_seconds(*probe, chunking=cut),
            "whole_seconds": lambda *cut: grouped_pass_seconds(*probe, chunking=cut),
            "pass_memory": lambda *cuts: training_pass_memory(*probe, *cuts)}
