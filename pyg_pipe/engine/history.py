"""Historical embeddings: one |V|-row buffer per (propagate call site, source argument), per call of the model.

A *call site* is one neighbour access of the model: the k-th ``propagate`` (or ``edge_updater``)
call of one ``MessagePassing`` module within one run of a stage (so K-hop layers such as APPNP
have K sites, each with its own history). Its *source arguments* are the tensors the layer reads
at the sources of edges (``x`` for ``x_j``). Rows are stored vertex-first, in new (chunk) ids.

A model called several times in one training step (an encoder run on the graph and on a corrupted
copy, as contrastive methods do) keeps one :class:`CallHistory` per call, so each call reads the
rows its own earlier chunks and steps wrote, never another call's.

Within a step the buffer of a site holds, for every vertex, the row last written: rows of chunks
already run this step are fresh, the others historical (:mod:`pyg_pipe.engine.schedule`). The
drain accumulates, per site, the gradients of fresh cross-chunk reads (``G``), added to the
owner chunk's rows when its backward runs.

Snapshots (T2, ``period = R``): at the start of step ``t`` the buffers are copied to a snapshot
when ``t % R == 0`` (or when a buffer has none yet) and restored from it otherwise, so historical
rows are an anchor refreshed every R steps instead of whatever the last step left.

This module is the one place that owns these buffers: offloading or compressing history changes
here only.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor


class CallHistory:
    """Buffers of historical rows and of pending cross-chunk gradients of one call, keyed by ``"site:arg"``.

    Attributes:
        initialised: whether the buffers were filled by an exact pass (or restored from a checkpoint).
        edge_inputs: the identity of the per-edge inputs the buffers were computed with (new values on
            the same graph refill them; :mod:`.step`).
    """

    def __init__(self, num_nodes: int, device: torch.device):
        self.num_nodes = num_nodes
        self.device = device
        self.buffers: Dict[str, Tensor] = {}
        self.snapshot: Dict[str, Tensor] = {}
        self.grads: Dict[str, Tensor] = {}
        self.initialised = False
        self.edge_inputs: tuple = ()

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
        """Stores ``rows`` at the vertices ``ids``."""
        self.buffer(key, rows)[ids] = rows.detach()

    def read(self, key: str, ids: Tensor, like: Tensor) -> Tensor:
        """The stored rows ``ids`` (a copy)."""
        return self.buffer(key, like)[ids]

    # ------------------------------------------------------------------ gradients of fresh reads
    def add_grad(self, key: str, ids: Tensor, grad: Tensor) -> None:
        """Adds ``grad`` to the pending gradient of the rows ``ids`` (their owner's backward takes it)."""
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

    def renew(self) -> None:
        """Drops the snapshot: the next step takes a new one (after the buffers were refilled)."""
        self.snapshot = {}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"buffers": {k: v.cpu() for k, v in self.buffers.items()},
                "snapshot": {k: v.cpu() for k, v in self.snapshot.items()}, "initialised": self.initialised}

    def load_state_dict(self, state: dict) -> None:
        """Restores saved buffers and snapshot."""
        self.buffers = {k: v.to(self.device).clone() for k, v in state["buffers"].items()}
        self.snapshot = {k: v.to(self.device).clone() for k, v in state["snapshot"].items()}
        self.initialised = bool(state.get("initialised", False)) and bool(self.buffers)


class HistoryStore:
    """The history of every call of the model within a step (call 0, call 1, ...).

    Args:
        num_nodes: |V|.
        device: where the buffers live.
    """

    def __init__(self, num_nodes: int, device: torch.device):
        self.num_nodes, self.device = num_nodes, device
        self.calls: Dict[int, CallHistory] = {}

    def of(self, call: int) -> CallHistory:
        """The history of the ``call``-th call of a step (created empty)."""
        hit = self.calls.get(call)
        if hit is None:
            hit = self.calls[call] = CallHistory(self.num_nodes, self.device)
        return hit

    def state_dict(self) -> dict:
        return {"calls": {k: v.state_dict() for k, v in self.calls.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restores saved histories; a state without them (or of an older format) leaves every call
        uninitialised, so its first step refills it with an exact pass."""
        self.calls = {}
        for k, v in (state.get("calls") or {}).items():
            self.of(int(k)).load_state_dict(v)
