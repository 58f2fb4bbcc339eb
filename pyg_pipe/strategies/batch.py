"""What the strategies check of each batch: one whole graph, the same on every rank."""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import Tensor
from torch_geometric.data import Batch, Data, HeteroData

from ..engine import Comm
from ..model.inputs import fingerprint


def check_batch(batch: Any) -> None:
    """Refuses a batch that is not one whole graph (a ``Data``), naming the loader to use."""
    fix = ("pyg_pipe trains on one whole graph per step: the dataloader must yield a single "
           "torch_geometric.data.Data, e.g. pyg_pipe.FullGraphDataModule(data) or DataLoader([data], batch_size=None).")
    if isinstance(batch, HeteroData):
        raise TypeError(f"The dataloader yielded a HeteroData; heterogeneous graphs are not supported yet. {fix}")
    if isinstance(batch, Batch) and batch.num_graphs != 1:
        raise ValueError(f"The dataloader yielded a Batch of {batch.num_graphs} graphs. {fix}")
    if not isinstance(batch, Data):
        raise TypeError(f"The dataloader yielded a {type(batch).__name__}, not a Data object. {fix}")


class SameGraph:
    """Checks that every rank loaded the same graph: attribute by attribute, by :func:`fingerprint`, once
    per new batch object (the same tensors, unchanged, are not compared again)."""

    def __init__(self) -> None:
        self._checked: Optional[tuple] = None

    def check(self, batch: Data, comm: Comm) -> None:
        if comm.world_size == 1:
            return
        key = tuple((k, id(v), v._version) for k, v in batch.items() if isinstance(v, Tensor))
        same = torch.tensor([float(key == self._checked)], device=comm.device)
        comm.all_reduce(same, None, "checking the graph", op="min")
        if float(same) == 1.0:  # skipped only where every rank can skip (a collective follows otherwise)
            return
        mine = {k: (fingerprint(v) if isinstance(v, Tensor) else (v,)) for k, v in batch.items()
                if isinstance(v, (Tensor, int, float, str, bool))}
        gathered: List[dict] = comm.all_gather_objects(mine, "checking the graph")
        bad = sorted({k for other in gathered for k in set(other) | set(mine) if other.get(k) != gathered[0].get(k)})
        if bad:
            raise ValueError(
                f"The graph differs between ranks (attributes: {', '.join(bad)}). pyg_pipe's strategies need the "
                f"same whole graph on every process: build it deterministically (seed the generator, e.g. "
                f"lightning.seed_everything(0) before creating it) or load it from the same file on every rank.")
        self._checked = key
