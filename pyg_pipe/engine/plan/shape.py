"""The grid and the model's layer groups (:class:`Shape`), decided from the model before the graph is chunked:
the stages and graph-parallel ways as configured, or one stage per device with ways added where the model cannot
be cut into that many stages (fewer layers than devices, no layer in the traced mode, a method torch.fx cannot
trace); and, with several stages or streaming, the traced program cut into layer groups. Modules that build a new
graph during the forward are refused here, in every mode."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from ...model.errors import CannotTrace, NoLayerCalled, UnsupportedModelError
from ...model.inputs import CallInputs
from ...model.split import stage_groups
from ...model.trace import Program, trace, trace_other_mode
from .grid import grid_shape, ways_for_layers

log = logging.getLogger("pyg_pipe")

#: refused in every mode, with why (pooling builds a graph from the vertices' values; hyperedges are no graph)
GRAPH_BUILDERS = {**{n: "builds a new graph from the vertices' values (pooling)" for n in (
    "TopKPooling", "SAGPooling", "EdgePooling", "ASAPooling", "PANPooling", "MemPooling", "ClusterPooling")},
    "HypergraphConv": "takes hyperedges (vertex, hyperedge pairs), not a graph between vertices"}


@dataclass(frozen=True)
class Shape:
    """The grid and the model's layer groups, decided from the model before the graph is chunked."""

    stages: int
    ways: int
    program: Optional[Program]
    groups: Optional[list]
    forced: bool
    ways_added: bool
    notes: Tuple[str, ...] = ()
    streaming: bool = False


def decide_shape(module: torch.nn.Module, inputs: CallInputs, world_size: int, stages: Optional[int],
                 ways: Optional[int], min_ways: int, split_points, streaming: Union[bool, str] = False,
                 fn=None) -> Shape:
    """The grid for this model: as configured, or one stage per device with graph-parallel ways added
    when the model has fewer layers than devices or its method does not trace (no stage count given); and, with
    several stages (or streaming on one device), the traced program cut into layer groups (the user's split points
    when marked).
    ``streaming``: stream on one device (a forward that does not trace streams as one group). ``fn``: the
    method distributed (``None``: forward)."""
    refuse_graph_builders(module)
    S, W = grid_shape(world_size, stages, ways, min_ways)
    if streaming:
        if S * W != 1:
            raise ValueError(f"streaming=True runs on one device, but this run has {S * W}; pass streaming=False "
                             f"(or 'auto') to pipeline over the devices.")
        try:
            program = trace(module, inputs.args, inputs.kwargs, fn)
        except UnsupportedModelError as exc:
            what = getattr(exc, "method", "") or f"the forward of {type(module).__name__}"
            note = (f"pyg_pipe: {what} does not trace into layer groups ({exc}); streaming it as one group, where "
                    f"every propagate of a computed value waits for all chunks (exact, but the forward runs once per "
                    f"such layer).")
            log.info(note)
            return Shape(1, 1, None, None, False, False, (note,), streaming=True)
        groups, forced = stage_groups(program, split_points)
        return Shape(1, 1, program, groups, forced, False, streaming=True)
    if S == 1:
        return Shape(S, W, None, None, False, False)
    try:
        program = trace(module, inputs.args, inputs.kwargs, fn)
        groups, forced = stage_groups(program, split_points)
        if stages is None:
            trace_other_mode(module, inputs.args, inputs.kwargs, fn)
    except NoLayerCalled:  # (PMLP trains as an MLP) no stage to cut: every device a way, unless stages are set
        if stages is not None:
            raise
        program, groups, forced = None, [], False
    except CannotTrace as exc:  # no stages to cut either: graph-parallel ways run the method as it is
        if stages is not None:
            raise
        S2, W2 = ways_for_layers(world_size, 1, W)
        note = (f"pyg_pipe: {exc.method} does not trace into pipeline stages ({exc.reason}); running it on {S2} "
                f"pipeline stage x {W2} graph-parallel ways, which run it as it is.")
        log.info(note)
        return Shape(S2, W2, None, None, False, True, (note,))
    L = len(groups)
    if L >= S or forced:
        return Shape(S, W, program, groups, forced, False)
    if stages is not None:
        raise UnsupportedModelError(
            f"The model has {L} message-passing layers but the pipeline has {S} stages; every stage needs at least "
            f"one layer. Use at most {L} stages, strategy='gnnpipe_hybrid' (stages x graph-parallel ways), or a "
            f"deeper model.")
    S2, W2 = ways_for_layers(world_size, L, W)
    what = f"has {L} message-passing layers" if program else "calls no message-passing layer in its forward now"
    note = (f"pyg_pipe: the model {what} for {world_size} devices: running {S2} pipeline stage{'s' if S2 > 1 else ''} "
            f"x {W2} graph-parallel ways.")
    log.info(note)
    return Shape(S2, W2, *((program, groups, forced) if S2 > 1 else (None, None, False)), True, (note,))


def refuse_graph_builders(module: torch.nn.Module) -> None:
    """Refuses modules that build a new graph from the vertices' values (pooling) or take hyperedges, naming them."""
    for name, m in module.named_modules():
        if type(m).__name__ in GRAPH_BUILDERS:
            raise UnsupportedModelError(
                f"Module '{name}' ({type(m).__name__}) {GRAPH_BUILDERS[type(m).__name__]}; pyg_pipe cuts one fixed "
                f"graph between vertices into chunks, and cannot follow graphs built during the forward. Train this "
                f"model on one device (no pyg_pipe strategy).")
