"""The pipeline in checkpoints: every rank's part of the pipeline state and of the optimizer state.

Each rank holds the parameters of its stage (and their optimizer state) and the history of its call
sites. A checkpoint holds the whole model, as one process's would (so it loads into the plain model),
plus ``checkpoint["pyg_pipe"] = {"plan", "world_size", "shards"}``: the plan, and the names of one
file per rank beside the checkpoint (``<checkpoint>.pyg_pipe-rank<r>-of-<P>``) holding that rank's call
sites and history. Each rank writes its own shard, so no rank ever holds another's history and rank
0's memory does not grow with the number of processes. Loading on the same number of processes reads
each rank's shard (and resumes bit for bit); on another number, the pipeline is planned anew and the
history restarts from an exact pass (a warning says so).

A checkpoint saved after ``fit`` from the main process (spawned workers have ended) cannot have its
shards written by the workers: the workers send their state home at the end of fit and the
checkpoint holds it inline, ``{"plan", "world_size", "ranks"}`` (every rank's state gathered on rank 0
tensor by tensor), which loads the same way.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor

from ..engine import Comm, sync_module_state
from ..engine.tree import flatten, unflatten


class PipelineCheckpoints:
    """A pipeline strategy's part of Lightning's checkpoints (the strategy's checkpoint hooks call it).

    Args:
        strategy: the :class:`~pyg_pipe.GNNPipeStrategy` (its engine, comm, LightningModule and launcher).
    """

    def __init__(self, strategy):
        self.strategy = strategy
        self.pending: Optional[dict] = None      # a loaded state, for the engine when it exists
        # the pipeline state at the end of fit, for save_checkpoint after it: gathered on rank 0 when the
        # workers end with fit (spawn / fork), else this rank's part, gathered if a checkpoint is saved
        self.final_state: Optional[dict] = None
        self.final_local: Optional[dict] = None

    def owners(self) -> Dict[str, int]:
        """Parameter name in the LightningModule -> the rank holding its authoritative copy."""
        engine = self.strategy.engine
        if engine is None or not engine.owners:
            return {}
        ranks = engine.owner_ranks
        return {n: ranks[s] for n, s in prefixed(self.strategy.lightning_module, engine.module, engine.owners).items()}

    def sync_parameters(self) -> None:
        """Every rank (so the checkpoint, and the user's model after fit) gets the whole trained model."""
        engine = self.strategy.engine
        if engine is not None and engine.owners:
            owners = prefixed(self.strategy.lightning_module, engine.module, engine.owners)
            sync_module_state(self.strategy.lightning_module, owners, engine.owner_ranks, comm=self.strategy.comm)

    def at_train_end(self, gather_now: bool) -> None:
        """Keeps the pipeline state for a ``save_checkpoint`` after fit (``gather_now``: the workers end with
        fit, so rank 0 takes it home now)."""
        s = self.strategy
        self.sync_parameters()
        if s.checkpoint_history and s.engine is not None and s.engine.plan is not None:
            if gather_now:
                self.final_state = pipeline_state(s.engine.state_dict(), s.comm)
            else:  # every process lives on (and calls save_checkpoint with the others): gather only then
                self.final_local = s.engine.state_dict()

    def optimizer_state(self, optimizer) -> Dict[str, Any]:
        """The optimizer state with every parameter's entry taken from the stage that owns it."""
        s = self.strategy
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        state = optimizer.state_dict()
        if s.engine is None or not s.engine.owners or s.world_size == 1:
            return state
        owners, name_of = self.owners(), {id(p): n for n, p in s.lightning_module.named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return merged_optimizer_state(state, {i: owners.get(name_of.get(id(p)), 0) for i, p in enumerate(params)},
                                      s.comm)

    def add_to(self, checkpoint: Dict[str, Any], filepath) -> None:
        """Puts ``checkpoint["pyg_pipe"]`` in a checkpoint being saved to ``filepath``; while training, every
        rank writes its shard beside it."""
        s = self.strategy
        if not s.checkpoint_history:
            return
        if s.engine is not None and s.engine.plan is not None:
            mine = s.engine.state_dict()
            P = s.world_size
            path = shard_path(filepath, s.global_rank, P)
            fs = get_filesystem(path)
            fs.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with fs.open(path, "wb") as f:
                torch.save({"rank": mine["rank"], "world_size": P}, f)
            state = {"plan": mine["plan"], "world_size": P,
                     "shards": [os.path.basename(shard_path(filepath, r, P)) for r in range(P)]}
        elif self.final_local is not None:
            state = pipeline_state(self.final_local, Comm(s.root_device, timeout=s.comm_timeout))
        else:
            state = self.final_state
        if state is not None:
            checkpoint["pyg_pipe"] = state

    def restore_from(self, checkpoint: Dict[str, Any], path) -> None:
        """Hands this rank's part of a loaded checkpoint's pipeline state to the engine (now or at setup)."""
        s = self.strategy
        saved = checkpoint.get("pyg_pipe")
        if saved:
            if s.checkpoint_history:
                state = rank_state(saved, s.global_rank, s.world_size, path)
            else:  # the history restarts from an exact pass
                state = {"plan": saved["plan"], "rank": None}
            if s.engine is not None:
                s.engine.load_state_dict(state)
            else:
                self.pending = state

    def remove(self, filepath) -> None:
        """Deletes this rank's shard of the checkpoint at ``filepath`` (Lightning deletes the checkpoint)."""
        path = shard_path(filepath, self.strategy.global_rank, self.strategy.world_size)
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path)

    def install_pending(self) -> None:
        if self.pending is not None:
            self.strategy.engine.load_state_dict(self.pending)
            self.pending = None


def gather_on_root(state: Any, comm: Comm) -> Optional[List[Any]]:
    """Every rank's ``state`` (nested dicts / lists of tensors and small values) on rank 0, as CPU
    tensors; ``None`` elsewhere (a collective)."""
    tensors, structure = flatten(state)
    metas = comm.all_gather_objects((structure, [(tuple(t.shape), t.dtype) for t in tensors]),
                                    "gathering the pipeline state")
    if comm.rank != 0:
        for t in tensors:
            comm.send(t.detach().to(comm.device), 0, None)
        comm.flush()
        return None
    out = [unflatten([t.detach().cpu() for t in tensors], structure)]
    for src in range(1, comm.world_size):
        structure, shapes = metas[src]
        out.append(unflatten([comm.recv(shape, dtype, src).cpu() for shape, dtype in shapes], structure))
    return out


def pipeline_state(mine: dict, comm: Comm) -> Optional[dict]:
    """``{"plan", "ranks", "world_size"}`` on rank 0 from every rank's engine state ``mine`` (a collective;
    ``None`` on the other ranks)."""
    gathered = gather_on_root(mine, comm) if comm.world_size > 1 else [mine]
    if gathered is None:
        return None
    return {"plan": gathered[0]["plan"], "ranks": [g["rank"] for g in gathered], "world_size": comm.world_size}


def shard_path(filepath, rank: int, world_size: int) -> str:
    """The file of rank ``rank``'s shard of the checkpoint ``filepath``."""
    return f"{os.fspath(filepath)}.pyg_pipe-rank{rank}-of-{world_size}"


def rank_state(saved: dict, rank: int, world_size: int, path=None) -> dict:
    """This rank's engine state from a checkpoint's ``saved`` pipeline state, loaded from ``path`` (the plan
    alone when the world size differs: the history then restarts from an exact pass)."""
    P = saved.get("world_size")
    if P != world_size:
        rank_zero_warn(f"pyg_pipe: the checkpoint was saved by {P} processes and this run has {world_size}: the "
                       f"parameters and the optimizer state load; the pipeline is planned anew for {world_size} and "
                       f"the historical embeddings restart from an exact pass over the graph (the run continues, "
                       f"not bit for bit as on {P}).")
        return {}
    if "ranks" in saved:  # inline (saved after fit from the main process)
        return {"plan": saved["plan"], "rank": saved["ranks"][rank]}
    shard = os.path.join(os.path.dirname(os.fspath(path)), saved["shards"][rank])
    fs = get_filesystem(shard)
    if not fs.exists(shard):
        raise FileNotFoundError(
            f"pyg_pipe: the checkpoint {os.fspath(path)!r} keeps rank {rank}'s history in {shard!r}, which is missing. "
            f"Copy the checkpoint together with its files '*.pyg_pipe-rank*-of-{P}', or load it with "
            f"GNNPipeStrategy(checkpoint_history=False) to restart the history from an exact pass.")
    with fs.open(shard, "rb") as f:
        return {"plan": saved["plan"], "rank": torch.load(f, map_location="cpu", weights_only=False)["rank"]}


def merged_optimizer_state(state: dict, owner_of_index: Mapping[int, int], comm: Comm) -> dict:
    """The optimizer ``state`` with every parameter's entry taken from the rank that owns it (a collective)."""
    mine = {k: _to_cpu(v) for k, v in state["state"].items() if owner_of_index.get(k, 0) == comm.rank}
    merged: Dict[int, Any] = {}
    for rank_states in comm.all_gather_objects(mine, "gathering the optimizer state"):
        merged.update(rank_states)
    return {**state, "state": {k: merged[k] for k in sorted(merged)}}


def _to_cpu(obj):
    if isinstance(obj, Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def prefixed(root: torch.nn.Module, sub: torch.nn.Module, owners: Mapping[str, int]) -> Dict[str, int]:
    """Owner map of ``sub``'s parameters, keyed by their names inside ``root``."""
    prefix = next((n for n, m in root.named_modules() if m is sub), "")
    return {(f"{prefix}.{k}" if prefix else k): v for k, v in owners.items()}
