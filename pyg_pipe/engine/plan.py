"""The plan: everything decided once for a graph and a model, agreed by all ranks, saved in checkpoints.

A plan fixes the rank grid (stages x ways), the chunking (vertex order ``perm`` and chunk bounds
``ptr``), the stage split (layers per stage) and the table of call sites each stage meets. The
decisions that use measurements (the cost-balanced split) or randomness (the partitioner) are made
once, on one rank, and broadcast; a resumed run reuses the saved plan instead of re-deciding, and a
resume whose settings differ from the saved ones fails naming the setting.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..graph.chunks import ChunkedGraph
from ..model.inputs import CallInputs, graph_edges
from ..model.split import Stage, balance, layer_groups, marked_segments
from ..model.trace import Program, SplitPoint


@dataclass
class PipelineConfig:
    """Knobs of the engine (see :class:`pyg_pipe.GNNPipeStrategy` for their documentation)."""

    num_chunks: Optional[int] = None
    shuffle_chunks: bool = True
    snapshot_period: Optional[int] = 23
    unbiased_gradients: bool = True
    balance: Union[str, Sequence[int]] = "time"
    partition: Union[str, Callable] = "auto"
    seed: int = 0
    per_chunk_statistics: bool = False
    split_points: Optional[Dict[str, SplitPoint]] = None

    def validate(self) -> None:
        if self.num_chunks is not None and (not isinstance(self.num_chunks, int) or isinstance(self.num_chunks, bool)
                                            or self.num_chunks < 1):
            raise ValueError(f"num_chunks={self.num_chunks!r} must be a positive integer (or None for 4 per stage).")
        if self.snapshot_period is not None and (not isinstance(self.snapshot_period, int) or self.snapshot_period < 1):
            raise ValueError(f"snapshot_period={self.snapshot_period!r} must be a positive integer, or None to "
                             f"turn periodic snapshots off.")
        from ..graph.partition import PARTITION_METHODS
        if not callable(self.partition) and self.partition not in PARTITION_METHODS:
            raise ValueError(f"partition={self.partition!r} must be one of {', '.join(PARTITION_METHODS)} or a "
                             f"callable (edge_index, num_nodes, num_chunks) -> (perm, ptr).")
        if isinstance(self.balance, str) and self.balance not in ("time", "layers"):
            raise ValueError(f"balance={self.balance!r} must be 'time', 'layers' or a list of layers per stage.")
        for name, point in (self.split_points or {}).items():
            if not isinstance(point, SplitPoint):
                raise ValueError(f"split_points={{{name!r}: {point!r}}}: use SplitPoint.BEGINNING or SplitPoint.END "
                                 f"(from pyg_pipe or torch.distributed.pipelining).")


@dataclass
class Plan:
    """One graph's and one model's decisions (see the module docstring)."""

    stages: int
    ways: int
    num_chunks: int
    num_nodes: int
    num_edges: int
    perm: Tensor
    ptr: Tensor
    graphs: List[Tensor]                 # the input graphs the plan was made for
    chunked: List[ChunkedGraph]          # per input graph, training chunking (C chunks)
    way_chunked: List[ChunkedGraph]      # per input graph, one chunk per way (exact passes)
    program: Optional[Program] = None
    stage_list: Optional[List[Stage]] = None
    sizes: Optional[List[int]] = None    # layer groups per stage
    param_stages: Dict[str, set] = field(default_factory=dict)
    sites: Dict[str, List[str]] = field(default_factory=dict)   # "train"/"eval" -> call sites of this stage
    derived: Dict = field(default_factory=dict)
    cache: Dict = field(default_factory=dict)                    # per-chunk caches of cached=True layers
    adjacency: Dict = field(default_factory=dict)                # local sparse adjacencies (per chunk, values)
    edge_inputs: tuple = ()                                      # identity of the edge inputs the history saw
    rows_checked: set = field(default_factory=set)               # modes checked for row-mixing operations

    @property
    def graph(self) -> ChunkedGraph:
        """The primary graph in training chunks."""
        return self.chunked[0]

    @property
    def chunks_per_way(self) -> int:
        return self.num_chunks // self.ways

    def training_graphs(self) -> List[ChunkedGraph]:
        """Every chunked graph of the training chunking: the inputs' and those derived from them."""
        sources = {id(cg) for cg in self.chunked}
        return self.chunked + [cg for (src, _), cg in self.derived.items() if src in sources]

    def derive(self, cg: ChunkedGraph, kind: str) -> ChunkedGraph:
        """The chunking of a graph derived from ``cg`` (``"flip"``: its transpose), same vertex order."""
        key = (id(cg), kind)
        hit = self.derived.get(key)
        if hit is None:
            if kind != "flip":
                raise ValueError(kind)
            hit = self.derived[key] = ChunkedGraph(cg.dst, cg.src, cg.num_nodes, cg.perm, cg.ptr, cg.ways)
        return hit

    def matches(self, inputs: CallInputs) -> bool:
        """Whether ``inputs`` carry the graphs this plan was made for (same structure)."""
        if len(inputs.graphs) != len(self.graphs) or inputs.num_nodes != self.num_nodes:
            return False
        return all(_same_structure(a, b) for a, b in zip(self.graphs, inputs.graphs))

    def state(self) -> dict:
        return {"stages": self.stages, "ways": self.ways, "num_chunks": self.num_chunks, "num_nodes": self.num_nodes,
                "num_edges": self.num_edges, "perm": self.perm.cpu(), "ptr": self.ptr.cpu(), "sizes": self.sizes,
                "digest": graph_digest(self.graphs[0])}


def graph_digest(graph: Tensor) -> int:
    """A checksum of a graph's structure (to recognise it in a checkpoint)."""
    src, dst, _ = graph_edges(graph)
    data = torch.stack([src, dst]).cpu().numpy().tobytes()
    return zlib.crc32(data)


def _same_structure(a: Tensor, b: Tensor) -> bool:
    if a is b:
        return True
    if a.layout != b.layout or a.shape != b.shape or a.device != b.device:
        return False
    if a.layout == torch.strided:
        return torch.equal(a, b)
    if a.layout == torch.sparse_csr:
        return torch.equal(a.crow_indices(), b.crow_indices()) and torch.equal(a.col_indices(), b.col_indices())
    return torch.equal(a.coalesce().indices(), b.coalesce().indices())


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


def chunk_count(config: PipelineConfig, stages: int, ways: int, num_nodes: int) -> int:
    """The number of chunks: the configured one, or 4 per stage for each way (one per way for a
    single stage), at most |V|."""
    if ways > num_nodes:
        raise ValueError(f"{ways} graph-parallel ways need at least {ways} vertices, but the graph has {num_nodes}; "
                         f"use at most {num_nodes} ways (devices).")
    C = config.num_chunks
    if C is None:
        C = ways * (1 if stages == 1 else 4 * stages)
        C = min(C, num_nodes - num_nodes % ways)
    if C > num_nodes:
        raise ValueError(f"num_chunks={C} is larger than the number of vertices ({num_nodes}); use at most "
                         f"{num_nodes} chunks.")
    if C % ways:
        raise ValueError(f"num_chunks={C} must be a multiple of the {ways} graph-parallel ways (each way owns the same "
                         f"number of chunks); use e.g. num_chunks={ways * max(1, C // ways)}.")
    return C


def partition(config: PipelineConfig, inputs: CallInputs, num_chunks: int, ways: int, rank: int, root: int,
              device) -> tuple:
    """``(perm, ptr)`` made on ``root`` and broadcast (a user callable runs on every rank, so a bad
    one fails everywhere at once)."""
    N = inputs.num_nodes
    src, dst, _ = graph_edges(inputs.primary)
    part = config.partition
    if not callable(part):
        both = root_decides(lambda: torch.cat(_partition(config, src, dst, N, num_chunks, ways)),
                            torch.empty(N + num_chunks + 1, dtype=torch.long), rank, root, device,
                            "partitioning the graph")
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
    from ..graph.partition import make_chunks, make_way_chunks
    edge_index = torch.stack([src, dst]).cpu()
    if ways > 1:
        return make_way_chunks(edge_index, N, ways, num_chunks // ways, method=config.partition, seed=config.seed)
    return make_chunks(edge_index, N, num_chunks, method=config.partition, seed=config.seed)


def broadcast(t: Tensor, src: int, device) -> Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = t.to(device)
        dist.broadcast(t, src)
    return t.cpu()


def chunk_graphs(inputs: CallInputs, perm: Tensor, ptr: Tensor, ways: int, device) -> List[ChunkedGraph]:
    out = []
    for g in inputs.graphs:
        src, dst, _ = graph_edges(g)
        out.append(ChunkedGraph(src.to(device), dst.to(device), inputs.num_nodes, perm.to(device), ptr.to(device),
                                ways))
    return out


def stage_groups(program: Program, split_points) -> tuple:
    """``(groups, forced)``: the layer groups, or the user's marked segments (``forced``)."""
    if split_points:
        _mark(program, split_points)
    if program.splits:
        return marked_segments(program), True
    return layer_groups(program), False


def _mark(program: Program, split_points) -> None:
    """Turns ``split_points={"name": SplitPoint.BEGINNING|END}`` into cuts before/after that module's call."""
    import torch.fx as fx
    from ..model.trace import pipe_split
    for name, point in split_points.items():
        calls = [n for n in program.graph.nodes if n.op == "call_module"
                 and (n.target == name or n.target.startswith(name + "."))]
        if not calls:
            raise ValueError(f"split_points names '{name}', but the traced forward calls no module of that name; "
                             f"use the qualified name of a submodule (e.g. 'convs.4').")
        anchor = calls[0] if point == SplitPoint.BEGINNING else calls[-1]
        ctx = program.graph.inserting_before(anchor) if point == SplitPoint.BEGINNING else \
            program.graph.inserting_after(anchor)
        with ctx:
            node = program.graph.call_function(pipe_split, ())
        program.splits.append(node)
    order = {n: i for i, n in enumerate(program.graph.nodes)}
    program.splits.sort(key=order.__getitem__)
    del fx


def choose_sizes(config: PipelineConfig, groups: list, stages: int, costs: Callable[[], List[float]],
                 rank: int, root: int, device) -> List[int]:
    """Layer groups per stage: the configured list, equal counts, or balanced by measured cost
    (measured on ``root`` only, broadcast)."""
    L, S = len(groups), stages
    bal = config.balance
    if not isinstance(bal, str):
        sizes = [int(b) for b in bal]
        if len(sizes) != S or sum(sizes) != L or min(sizes) < 1:
            raise ValueError(f"balance={list(bal)} must give {S} positive layer counts summing to {L}.")
        return sizes
    if bal == "layers" or S == 1:
        return [L // S + (1 if s < L % S else 0) for s in range(S)]
    measured = root_decides(lambda: torch.tensor(costs(), dtype=torch.float64), torch.zeros(L, dtype=torch.float64),
                            rank, root, device, "measuring the layers' costs")
    return balance(measured.tolist(), S)


def root_decides(fn: Callable[[], Tensor], empty: Tensor, rank: int, root: int, device, what: str) -> Tensor:
    """``fn()`` computed on ``root`` and broadcast. If it fails there, every rank fails too (the others
    are told through the broadcast instead of waiting on it)."""
    error = None
    value = empty
    if rank == root:
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others were told
            error = exc
    flag = broadcast(torch.tensor([1.0 if error is not None else 0.0], dtype=torch.float64), root, device)
    if error is not None:
        raise error
    if float(flag) != 0.0:
        raise RuntimeError(f"pyg_pipe: rank {root} failed while {what}; its error says why.")
    return broadcast(value, root, device)
