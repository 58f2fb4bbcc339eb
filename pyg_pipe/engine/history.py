"""Historical embeddings: one |V|-row buffer per (propagate call site, source argument).

A *call site* is one neighbour access of the model: the k-th ``propagate`` (or ``edge_updater``)
call of one ``MessagePassing`` module within one run of a stage (so K-hop layers such as APPNP
have K sites, each with its own history). Its *source arguments* are the tensors the layer reads
at the sources of edges (``x`` for ``x_j``). Rows are stored vertex-first, in new (chunk) ids.

Within a step the buffer of a site holds, for every vertex, the row last written: rows of chunks
already run this step are fresh, the others historical (:mod:`pyg_pipe.engine.schedule`). The
drain accumulates, per site, the gradients of fresh cross-chunk reads (``G``), added to the
owner chunk's rows when its backward runs.

Snapshots (T2, ``period = R``): at the start of step ``t`` the buffers are copied to a snapshot
when ``t % R == 0`` and restored from it otherwise, so historical rows are an anchor refreshed
every R steps instead of whatever the last step left.

This module is the one place that owns these buffers: offloading or compressing history changes
here only.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor


class HistoryStore:
    """Buffers of historical rows and of pending cross-chunk gradients, keyed by ``"site:arg"``.

    Args:
        num_nodes: |V|.
        device: where the buffers live.
    """

    def __init__(self, num_nodes: int, device: torch.device):
        self.num_nodes = num_nodes
        self.device = device
        self.buffers: Dict[str, Tensor] = {}
        self.snapshot: Dict[str, Tensor] = {}
        self.grads: Dict[str, Tensor] = {}

    # ------------------------------------------------------------------ rows
    def buffer(self, key: str, like: Tensor) -> Tensor:
        """The buffer of ``key``, created (zeros) with ``like``'s trailing shape and dtype."""
        buf = self.buffers.get(key)
        if buf is None:
            buf = torch.zeros((self.num_nodes, *like.shape[1:]), dtype=like.dtype, device=self.device)
            self.buffers[key] = buf
        return buf

    def write(self, key: str, start: int, rows: Tensor) -> None:
        """Stores the rows ``start .. start + len(rows) - 1`` (vertex-first, detached)."""
        self.buffer(key, rows)[start:start + rows.size(0)] = rows.detach()

    def write_ids(self, key: str, ids: Tensor, rows: Tensor) -> None:
        self.buffer(key, rows)[ids] = rows.detach()

    def read(self, key: str, ids: Tensor, like: Tensor) -> Tensor:
        """The stored rows ``ids`` (a copy)."""
        return self.buffer(key, like)[ids]

    # ------------------------------------------------------------------ gradients of fresh reads
    def add_grad(self, key: str, ids: Tensor, grad: Tensor) -> None:
        g = self.grads.get(key)
        if g is None:
            g = self.grads[key] = grad.new_zeros((self.num_nodes, *grad.shape[1:]))
        g.index_add_(0, ids, grad)

    def take_grad(self, key: str, start: int, end: int) -> Optional[Tensor]:
        """The accumulated gradient of rows ``start .. end-1`` (``None`` if nothing reached them)."""
        g = self.grads.get(key)
        return None if g is None else g[start:end]

    def clear_grads(self) -> None:
        self.grads = {}

    # ------------------------------------------------------------------ steps and snapshots
    def begin_step(self, step: int, period: Optional[int]) -> None:
        """T2: snapshot every ``period`` steps, restore the snapshot in between."""
        self.grads = {}
        if period is None or not self.buffers:
            return
        if step % period == 0 or set(self.snapshot) != set(self.buffers):  # (no snapshot yet: take one)
            self.snapshot = {k: v.clone() for k, v in self.buffers.items()}
        else:
            for k, v in self.buffers.items():
                v.copy_(self.snapshot[k])

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"buffers": {k: v.cpu() for k, v in self.buffers.items()},
                "snapshot": {k: v.cpu() for k, v in self.snapshot.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restores saved buffers and snapshot."""
        self.buffers = {k: v.to(self.device).clone() for k, v in state["buffers"].items()}
        self.snapshot = {k: v.to(self.device).clone() for k, v in state["snapshot"].items()}
