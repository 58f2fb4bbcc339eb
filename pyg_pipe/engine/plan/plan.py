"""The plan: everything decided once for a graph and a model, agreed by all ranks, saved in checkpoints.

A :class:`Plan` is immutable. It fixes the rank grid (stages x ways), the chunking (vertex order ``perm`` and chunk
bounds ``ptr``) and the stage split (layer groups per stage, and so which stage owns which parameter). :func:`make_plan`
decides them from the model's structure, the graph and the knobs, and executes nothing of the model except, for
``balance="time"``, the cost measurement it is handed. The decisions that use measurements (the cost-balanced split)
or randomness (the partitioner) are made once, on one rank, and broadcast; a resumed run reuses the saved plan instead
of re-deciding, and a resume whose settings differ from the saved ones fails naming the setting. What is built from a
plan (chunk graphs, history, the schedule, caches) lives in the runtime (:mod:`..runtime.runtime`)."""
from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ...model.errors import UnsupportedModelError
from ...model.inputs import CallInputs, graph_edges, same_structure
from ...model.split import balance, parameter_stages, split
from ..config import PipelineConfig
from .chunk_cost import choose_chunks
from .decide import root_decides
from .memory_fit import fit_memory, measure_memory, memory_room, probe_scale
from .norms import refuse_statistics, resolve_statistics
from .grid import check_chunks_per_way
from .shape import Shape

log = logging.getLogger("pyg_pipe")


@dataclass(frozen=True)
class Plan:
    """One graph's and one model's decisions (see the module docstring).

    Attributes:
        stages, ways: the grid, S x W.
        num_chunks: C (``C / W`` per way).
        num_nodes, num_edges: of the primary graph.
        perm, ptr: new vertex order (``perm[new] = old``) and chunk bounds in new ids.
        sizes: layer groups per stage (``None``: one stage, the forward runs untraced).
        param_stages: parameter / buffer name -> the stages that use it.
        digest: checksum of the primary graph's structure.
        graphs: the input graphs the plan was made for, each with its version (compared by structure on every
            call; the same tensor changed in place since is another graph).
        streaming: one device runs every layer group over all chunks in turn (:mod:`..step.stream`); ``sizes``
            then has one group per (virtual) stage.
        statistics: how graph-wide statistics run with several chunks per way (``per_chunk_statistics``
            resolved: ``"auto"`` becomes ``"history"`` for norms computed from sums in the pipeline, else ``False``).
        predicted_step: with ``num_chunks="auto"``, the step the cost model predicted for the chosen count
            (seconds; checked against the measured steps: :class:`~pyg_pipe.strategies.callbacks.TimelineLogger`);
            ``None`` otherwise, and on a resume (the count was not chosen again).
        first_step_peak: with ``num_chunks="auto"`` under a memory budget, the first step's counted peak per
            process estimated before it (bytes; :func:`~.memory_fit.fit_memory`), else ``None``.
        offload: ``"host"`` where that choice put the history in host memory (``offload`` unset and no chunk
            count fitting with it on the device), else ``None``; saved with the plan.
    """

    stages: int
    ways: int
    num_chunks: int
    num_nodes: int
    num_edges: int
    perm: Tensor
    ptr: Tensor
    sizes: Optional[Tuple[int, ...]]
    param_stages: Mapping[str, FrozenSet[int]]
    digest: int
    graphs: Tuple[Tuple[Tensor, int], ...] = field(repr=False, compare=False)  # (graph, its version then)
    streaming: bool = False
    statistics: Union[bool, str] = False
    predicted_step: Optional[float] = None
    first_step_peak: Optional[int] = None
    offload: Optional[str] = None

    @property
    def chunks_per_way(self) -> int:
        return self.num_chunks // self.ways

    @property
    def owners(self) -> Dict[str, int]:
        """Parameter / buffer name -> the stage whose copy is authoritative (the first that uses it)."""
        return {n: (min(st) if st else 0) for n, st in self.param_stages.items()}

    def matches(self, inputs: CallInputs) -> bool:
        """Whether ``inputs`` carry the graphs this plan was made for (same structure)."""
        return len(inputs.graphs) == len(self.graphs) and inputs.num_nodes == self.num_nodes and all(
            same_structure(a, b, version) for (a, version), b in zip(self.graphs, inputs.graphs))

    def state(self) -> dict:
        """The decisions, for checkpoints (:func:`make_plan` takes them back as ``saved``)."""
        return {"stages": self.stages, "ways": self.ways, "num_chunks": self.num_chunks, "num_nodes": self.num_nodes,
                "num_edges": self.num_edges, "perm": self.perm.cpu(), "ptr": self.ptr.cpu(),
                "sizes": list(self.sizes) if self.sizes is not None else None, "digest": self.digest,
                "streaming": self.streaming, "offload": self.offload}


def make_plan(module: torch.nn.Module, config: PipelineConfig, shape: Shape, inputs: CallInputs, comm, root: int,
              sizes: Optional[Sequence[int]] = None, costs: Optional[Callable[[Tensor, Tensor], List[float]]] = None,
              saved: Optional[dict] = None, notes: Optional[List[str]] = None,
              pass_seconds: Optional[Callable[[Tensor, Tensor], float]] = None,
              chosen: Optional[Tuple[int, Optional[float]]] = None,
              pass_memory: Optional[Callable[[tuple, tuple], object]] = None, whole_seconds=None) -> Plan:
    """The plan for ``inputs`` on the grid ``shape``.

    Args:
        comm: the transport (decisions made on ``root`` are broadcast with it).
        root: the rank that partitions and measures.
        sizes: the stage split, when already decided (by an earlier plan: a property of the model); else here.
        costs: per layer group, seconds of one pass over a chunk of the chunking ``(perm, ptr)`` it is given
            (called on ``root`` for ``balance="time"``).
        saved: a checkpoint's :meth:`Plan.state` to resume from (checked against this run).
        notes: where decisions pyg_pipe made on its own are told (also logged).
        pass_seconds: seconds of one training pass of the model over the first chunk of the chunking
            ``(perm, ptr)`` it is given (on ``root`` for ``num_chunks="auto"``; ``whole_seconds``: over one chunk a
            way, a layer group at a time, :func:`.chunk_cost.measure_whole`).
        chosen: ``num_chunks="auto"``'s ``(count, predicted step, offload)`` from an earlier engine of the same
            strategy (fit, then test): taken instead of measuring again, unless a checkpoint's plan is resumed.
        pass_memory: what one training pass over the first chunk of the chunking it is given holds, and what the
            layers cache on the first chunk of the one-chunk-a-way chunking given second (a
            :class:`~.first_step.PassMemory`, on ``root`` under a memory budget: :func:`~.memory_fit.fit_memory`).
    """
    S, W = shape.stages, shape.ways
    auto = config.num_chunks == "auto"
    predicted, first_peak, fresh, offload, measured = None, None, False, None, None
    if shape.streaming and (config.num_chunks is None or auto):
        wanted = stream_chunks(config, inputs, comm.device)
    elif auto:  # measured once: a resume keeps the saved count
        fixed = chunk_count(replace(config, num_chunks=None), S, W, inputs.num_nodes, shape.ways_added)
        if saved is not None:
            wanted = saved["num_chunks"]
        elif chosen is not None and chosen[0] <= inputs.num_nodes:
            wanted, predicted, offload = (tuple(chosen) + (None,))[:3]
        else:  # under a memory budget the memory is measured first, so that the timing fits too (memory_fit)
            room = memory_room(config, comm) if pass_seconds is not None and pass_memory is not None and S > 1 \
                else None
            measured = None if room is None else measure_memory(pass_memory, inputs.num_nodes, S, W, comm, root)
            scale = 1 if measured is None else probe_scale(measured, room, inputs.num_nodes, S, W, notes)
            wanted, predicted = choose_chunks(pass_seconds, inputs.num_nodes, S, W, fixed, comm, root, notes, scale,
                                              whole_seconds)
            fresh = pass_seconds is not None
    else:
        wanted = chunk_count(config, S, W, inputs.num_nodes, shape.ways_added, notes)
    if saved is not None:
        check_resume(saved, S, W, wanted, inputs)
        C, perm, ptr = saved["num_chunks"], saved["perm"], saved["ptr"]
        offload = saved.get("offload")
        sizes = saved.get("sizes") or sizes
    else:
        C = wanted
        perm, ptr = partition(config, inputs, C, W, comm, root)
        if fresh and measured is not None:  # the first step must fit the memory: more chunks if not
            layout = None  # (the widest stage is estimated: the split is made first, on the time model's chunks)
            if shape.program is not None and not shape.forced:
                sizes = sizes or choose_sizes(config, shape.groups, S,
                                              None if costs is None else lambda: costs(perm, ptr), comm, root)
                layout = (sizes, stage_parameter_bytes(module, shape, sizes))
            fitted = fit_memory(measured, room, config, inputs, S, W, C, perm, ptr,
                                lambda n: partition(config, inputs, n, W, comm, root), comm, root, notes, layout)
            C, perm, ptr, first_peak, offload = fitted.chunks, fitted.perm, fitted.ptr, fitted.peak, fitted.offload
    statistics = resolve_statistics(config.per_chunk_statistics, module, C // W, shape.streaming, notes)
    if C // W > 1 and statistics is not True:
        refuse_statistics(module, C // W, W, history=statistics == "history", streaming=shape.streaming)
    stage_sizes: Optional[Tuple[int, ...]] = None
    if shape.streaming:  # every layer group is a stage of its own, all on this device
        stage_sizes = (1,) * len(shape.groups) if shape.groups is not None else None
        owners = {n: {0} for n, _ in list(module.named_parameters()) + list(module.named_buffers())}
    elif shape.program is not None:
        if shape.forced:
            if len(shape.groups) != S:
                raise UnsupportedModelError(
                    f"The forward is split into {len(shape.groups)} parts by its split points, but the pipeline has "
                    f"{S} stages; mark {S - 1} split points (pipe_split() / split_points) or use {len(shape.groups)} "
                    f"stages.")
            sizes = [1] * S
        elif sizes is None:
            sizes = choose_sizes(config, shape.groups, S, None if costs is None else lambda: costs(perm, ptr), comm,
                                 root)
        stage_sizes = tuple(int(s) for s in sizes)
        owners = parameter_stages(module, split(shape.program, shape.groups, stage_sizes))
    else:
        owners = {n: {0} for n, _ in list(module.named_parameters()) + list(module.named_buffers())}
    return Plan(S, W, C, inputs.num_nodes, inputs.num_edges, perm.cpu(), ptr.cpu(), stage_sizes,
                {n: frozenset(s) for n, s in owners.items()}, graph_digest(inputs.primary),
                tuple((g, g._version) for g in inputs.graphs),
                shape.streaming, statistics, predicted, first_peak, offload)


def stage_parameter_bytes(module: torch.nn.Module, shape: Shape, sizes: Sequence[int]) -> List[float]:
    """The bytes of the parameters each stage of the split ``sizes`` holds (a shared one on every stage using it)."""
    owners = parameter_stages(module, split(shape.program, shape.groups, sizes))
    held = [0.0] * len(sizes)
    for name, p in module.named_parameters():
        for s in owners.get(name, ()):
            held[s] += p.numel() * p.element_size()
    return held


def chunk_count(config: PipelineConfig, stages: int, ways: int, num_nodes: int, ways_added: bool = False,
                notes: Optional[List[str]] = None) -> int:
    """The number of chunks: the configured one, or 4 per stage for each way (one per way for a single
    stage), at most |V|. When pyg_pipe added the ways itself, a configured count that is not a multiple of
    them becomes the next multiple (logged)."""
    if ways > num_nodes:
        raise ValueError(f"{ways} graph-parallel ways need at least {ways} vertices, but the graph has {num_nodes}; "
                         f"use at most {num_nodes} ways (devices).")
    C = config.num_chunks
    if C is None:
        C = ways * (1 if stages == 1 else 4 * stages)
        C = min(C, num_nodes - num_nodes % ways)
    elif C % ways and ways_added:
        fitted = -(-C // ways) * ways
        note = (f"pyg_pipe: num_chunks={C} is not a multiple of the {ways} graph-parallel ways pyg_pipe added for "
                f"this model; using num_chunks={fitted}.")
        log.info(note)
        if notes is not None and note not in notes:
            notes.append(note)
        C = fitted
    if C > num_nodes:
        raise ValueError(f"num_chunks={C} is larger than the number of vertices ({num_nodes}); use at most "
                         f"{num_nodes} chunks.")
    check_chunks_per_way(C, ways)
    return C


def stream_chunks(config: PipelineConfig, inputs: CallInputs, device: torch.device) -> int:
    """Chunks for streaming when ``num_chunks`` is not set: enough that one chunk's working set of one layer
    group (estimated as 16 rows of the widest per-vertex input, at least 64 wide, per vertex) fits
    ``offload_budget`` (``"auto"``: half the free memory); 4 without a budget."""
    from ..runtime.tiers import free_memory
    N = inputs.num_nodes
    budget = config.offload_budget
    if budget == "auto":
        budget = free_memory(device) // 2
    if not budget:
        return min(4, N)
    width = max([64] + [t[0].numel() for t in _node_inputs(inputs)])
    need = N * width * 4 * 16
    return int(min(max(2, -(-need // budget)), N))


def _node_inputs(inputs: CallInputs) -> List[Tensor]:
    """The floating-point tensors of a call with one row per vertex (top level and in ``Data``)."""
    values = list(inputs.args) + list(inputs.kwargs.values())
    for d in inputs.data:
        values += [v for _, v in d.items()]
    return [v for v in values if isinstance(v, Tensor) and v.layout == torch.strided and v.dim() > 0
            and v.is_floating_point() and v.size(0) == inputs.num_nodes]


def graph_digest(graph: Tensor) -> int:
    """A checksum of a graph's structure (to recognise it in a checkpoint)."""
    src, dst, _ = graph_edges(graph)
    return zlib.crc32(torch.stack([src, dst]).cpu().numpy().tobytes())


def check_resume(saved: dict, stages: int, ways: int, num_chunks: int, inputs: CallInputs) -> None:
    """Raises naming the first setting in which the run differs from the checkpoint's plan."""
    diffs = [("devices (stages x ways)", f"{saved['stages']} x {saved['ways']}", f"{stages} x {ways}"),
             ("num_chunks", saved["num_chunks"], num_chunks),
             ("the graph's vertex count", saved["num_nodes"], inputs.num_nodes),
             ("the graph's edge count", saved["num_edges"], inputs.num_edges)]
    for what, then, now in diffs:
        if then != now:
            raise ValueError(f"The checkpoint was saved with {what} = {then}, but this run has {now}. Resume with the "
                             f"same setting, or start a new run without ckpt_path.")
    if saved["digest"] != graph_digest(inputs.primary):
        raise ValueError("The checkpoint was saved for a graph with other edges than this run's. Resume on the same "
                         "graph, or start a new run without ckpt_path.")


def partition(config: PipelineConfig, inputs: CallInputs, num_chunks: int, ways: int, comm, root: int) -> tuple:
    """``(perm, ptr)`` made on ``root`` and broadcast (a user callable runs on every rank, so a bad
    one fails everywhere at once)."""
    N = inputs.num_nodes
    src, dst, _ = graph_edges(inputs.primary)
    part = config.partition
    if not callable(part):
        both = root_decides(lambda: torch.cat(_partition(config, src, dst, N, num_chunks, ways)),
                            torch.empty(N + num_chunks + 1, dtype=torch.long), comm, root, "partitioning the graph")
        return both[:N], both[N:]
    perm, ptr = part(torch.stack([src, dst]).cpu(), N, num_chunks)
    perm, ptr = torch.as_tensor(perm, dtype=torch.long), torch.as_tensor(ptr, dtype=torch.long)
    if ptr.numel() != num_chunks + 1 or not torch.equal(torch.sort(perm).values, torch.arange(N)) \
            or int(ptr[0]) != 0 or int(ptr[-1]) != N:
        raise ValueError(f"partition callable must return (perm, ptr): a permutation of {N} vertices and "
                         f"{num_chunks + 1} chunk boundaries from 0 to {N}.")
    sizes = ptr[1:] - ptr[:-1]
    if bool((sizes <= 0).any()):
        empty = torch.nonzero(sizes <= 0).view(-1).tolist()
        raise ValueError(f"partition callable returned empty chunks {empty}: every chunk (and so every "
                         f"partition of a graph-parallel way) needs at least one vertex.")
    return perm, ptr


def _partition(config: PipelineConfig, src: Tensor, dst: Tensor, N: int, num_chunks: int, ways: int):
    from ...graph.partition import make_chunks, make_way_chunks
    edge_index = torch.stack([src, dst]).cpu()
    if ways > 1:
        return make_way_chunks(edge_index, N, ways, num_chunks // ways, method=config.partition, seed=config.seed)
    return make_chunks(edge_index, N, num_chunks, method=config.partition, seed=config.seed)


def choose_sizes(config: PipelineConfig, groups: list, stages: int, costs: Optional[Callable[[], List[float]]],
                 comm, root: int) -> List[int]:
    """Layer groups per stage: the configured list, equal counts, or balanced by measured cost
    (measured on ``root`` only, broadcast)."""
    L, S = len(groups), stages
    bal = config.balance
    if not isinstance(bal, str):
        sizes = [int(b) for b in bal]
        if len(sizes) != S or sum(sizes) != L or min(sizes) < 1:
            raise ValueError(f"balance={list(bal)} must give {S} positive layer counts summing to {L}.")
        return sizes
    if bal == "layers" or S == 1 or costs is None:
        return [L // S + (1 if s < L % S else 0) for s in range(S)]
    measured = root_decides(lambda: torch.tensor(costs(), dtype=torch.float64), torch.zeros(L, dtype=torch.float64),
                            comm, root, "measuring the layers' costs")
    return balance(measured.tolist(), S)
