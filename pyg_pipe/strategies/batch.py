"""What the strategies check of each batch: one whole, well-formed graph, the same on every rank."""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import Tensor
from torch_geometric.data import Batch, Data, HeteroData

from ..engine import Comm
from ..model.inputs import fingerprint


def check_graph(data: Data) -> None:
    """Refuses a malformed graph where the data is, before any process waits on another: every attribute
    named ``*edge_index`` must be a ``[2, E]`` integer tensor of vertex ids below ``data.num_nodes``, and
    ``x`` must have a row per vertex. Each message names the attribute and the fix."""
    n = data.num_nodes
    x = data.x if "x" in data else None
    if isinstance(x, Tensor) and x.dim() > 0 and "num_nodes" in data._store and x.size(0) != n:
        raise ValueError(f"data.x has {x.size(0)} rows but data.num_nodes is {n}: give x one row per vertex, or drop "
                         f"num_nodes (PyG then counts the rows of x).")
    for key, value in data.items():
        if not key.endswith("edge_index") or not isinstance(value, Tensor) or value.layout != torch.strided:
            continue
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"data.{key} has dtype {value.dtype}; an edge_index holds integer vertex ids. Convert it: "
                            f"data.{key} = data.{key}.long()")
        if value.dim() != 2 or value.size(0) != 2:
            raise ValueError(f"data.{key} has shape {tuple(value.shape)}; an edge_index has shape [2, E] (sources in "
                             f"row 0, destinations in row 1). For an [E, 2] list of pairs: data.{key} = "
                             f"data.{key}.t().contiguous()")
        if value.numel():
            lo, hi = int(value.min()), int(value.max())
            if lo < 0 or hi >= n:
                rows = f"x's {n} rows" if isinstance(x, Tensor) and "num_nodes" not in data._store else \
                    f"data.num_nodes = {n}"
                raise ValueError(f"data.{key} holds vertex ids from {lo} to {hi}, but the graph has {n} vertices "
                                 f"({rows}): ids must lie in 0..{n - 1}. Remove or renumber the edges outside that "
                                 f"range (e.g. torch_geometric.utils.subgraph), or give every vertex a row.")


def check_batch(batch: Any) -> None:
    """Refuses a batch that is not one whole graph (a ``Data``), naming the loader to use."""
    fix = ("pyg_pipe trains on one whole graph per step: the dataloader must yield a single "
           "torch_geometric.data.Data, e.g. pyg_pipe.FullGraphDataModule(data) or DataLoader([data], batch_size=None).")
    if isinstance(batch, HeteroData):
        raise TypeError(f"The dataloader yielded a HeteroData; heterogeneous graphs are not supported yet. Convert it "
                        f"with data.to_homogeneous() (node_type and edge_type kept) and use typed layers that take "
                        f"edge_type (RGCNConv, RGATConv). {fix}")
    if isinstance(batch, Batch) and batch.num_graphs != 1:
        raise ValueError(f"The dataloader yielded a Batch of {batch.num_graphs} graphs. {fix} For a task on many "
                         f"small graphs (graph classification or regression, a readout such as global_add_pool), no "
                         f"graph needs splitting: train with Lightning's strategy='ddp', each process a share of the "
                         f"graphs.")
    if not isinstance(batch, Data):
        raise TypeError(f"The dataloader yielded a {type(batch).__name__}, not a Data object. {fix}")


def graph_of(value: Any) -> Optional[Data]:
    """The graph an argument of ``Trainer.fit`` (or ``validate``, ...) holds without running user code: a
    ``FullGraphDataModule``'s graph (when given as a ``Data``), or the one graph of a loader over a list
    (``DataLoader([data], batch_size=None)``); else ``None``."""
    from torch.utils.data import DataLoader

    from ..data import FullGraphDataModule
    if isinstance(value, FullGraphDataModule):
        return value._data
    if isinstance(value, DataLoader) and isinstance(value.dataset, (list, tuple)) and len(value.dataset) == 1 \
            and isinstance(value.dataset[0], Data) and not isinstance(value.dataset[0], HeteroData):
        return value.dataset[0]
    return None


class SameGraph:
    """Checks that every rank loaded the same graph: attribute by attribute, by :func:`fingerprint`, once
    per new batch object (the same tensors, unchanged, are not compared again)."""

    def __init__(self) -> None:
        self._checked: Optional[tuple] = None
        self._seen: Optional[tuple] = None

    def new(self, batch: Data) -> bool:
        """Whether ``batch`` is another graph than the last one asked about (other tensors, or changed)."""
        key = tuple((k, id(v), v._version) for k, v in batch.items() if isinstance(v, Tensor))
        seen, self._seen = self._seen, key
        return key != seen

    def check(self, batch: Data, comm: Comm, moved: Optional[Data] = None) -> None:
        """``batch``: the graph as the loader gave it, whose tensors are the same objects epoch after epoch
        (FullGraphDataModule), so it is compared once; ``moved``: the same on the device (a new copy every step on
        a GPU), which is what is digested when it is compared (default: ``batch``)."""
        if comm.world_size == 1:
            return
        key = tuple((k, id(v), v._version) for k, v in batch.items() if isinstance(v, Tensor))
        same = torch.tensor([float(key == self._checked)], device=comm.device)
        comm.all_reduce(same, None, "checking the graph", op="min")
        if float(same) == 1.0:  # skipped only where every rank can skip (a collective follows otherwise)
            return
        digested = batch if moved is None else moved
        mine = {k: (fingerprint(v) if isinstance(v, Tensor) else (v,)) for k, v in digested.items()
                if isinstance(v, (Tensor, int, float, str, bool))}
        gathered: List[dict] = comm.all_gather_objects(mine, "checking the graph")
        bad = sorted({k for other in gathered for k in set(other) | set(mine) if other.get(k) != gathered[0].get(k)})
        if bad:
            raise ValueError(
                f"The graph differs between ranks (attributes: {', '.join(bad)}). pyg_pipe's strategies need the "
                f"same whole graph on every process: build it deterministically (seed the generator, e.g. "
                f"lightning.seed_everything(0) before creating it) or load it from the same file on every rank.")
        self._checked = key
