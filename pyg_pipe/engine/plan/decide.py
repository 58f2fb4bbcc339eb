"""Decisions made once, on one rank, and broadcast: what is measured (timings) must not be measured again on
every rank, where each would measure something else and the ranks would disagree."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ...model.errors import UnsupportedModelError


def root_decides(fn: Callable[[], Tensor], empty: Tensor, comm, root: int, what: str) -> Tensor:
    """``fn()`` computed on ``root`` and broadcast. If it fails there, every rank fails too (the others
    are told through the broadcast instead of waiting on it). The ranks meet first, so the others wait
    (idle) while ``root`` measures: on processes sharing cores, another rank still tracing its model would
    slow what ``fn`` times."""
    error = None
    value = empty
    comm.barrier(what)
    if comm.rank == root:
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others were told
            error = exc
    flag = comm.broadcast(torch.tensor([1.0 if error is not None else 0.0], dtype=torch.float64), root, what)
    if float(flag) != 0.0:  # every rank raises the root's error: a refusal stays a refusal everywhere
        told = comm.all_gather_objects(None if error is None else (type(error).__name__, str(error)), what)
        if error is not None:
            raise error
        kind, message = told[root]
        if kind == UnsupportedModelError.__name__:
            raise UnsupportedModelError(message)
        raise RuntimeError(f"pyg_pipe: rank {root} failed while {what}: {kind}: {message}")
    return comm.broadcast(value, root, what)
