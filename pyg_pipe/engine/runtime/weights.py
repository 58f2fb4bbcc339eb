"""The model's parameters across ranks: weight gradients summed where several ranks computed parts of
them, once per backward pass, and the whole model gathered from the stages that own it.

Which gradients are partial: a stage's own parameters over the ways of the stage (each way computed
the part of its vertices), and a parameter used by several stages (a module reused at two depths)
over all ranks (ranks that do not use it add zeros).

**Once per backward pass.** The drain of every call of the model (:mod:`..step.pipeline`) runs inside
:meth:`GradientSum.collecting`: the gradients it produces for those parameters are set aside,
apart from whatever else the same backward accumulates into them (a regulariser on the weights,
computed alike on every rank, must not be summed over ranks). At the end of the backward pass
(autograd's ``queue_callback``, as ``DistributedDataParallel`` does) the parts collected from all
drains are summed over their ranks in one all-reduce per group and added to the parameters'
gradients. A model called twice in a step is summed once, with both calls' parts.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Set

import torch
from torch import Tensor

from ..comm import Comm
from ..plan.grid import RankGrid
from ...model.find import uncompiled


class GradientSum:
    """Sums partial weight gradients over the ranks that computed them (see the module docstring).

    Args:
        module: the user's model.
        param_stages: parameter name -> the stages that use it (the plan's).
        grid: the rank grid.
        comm: the transport (the all-reduce is counted as ``weight_allreduce``).
    """

    def __init__(self, module: torch.nn.Module, param_stages: Mapping[str, Set[int]], grid: RankGrid, comm: Comm):
        self.grid, self.comm = grid, comm
        params = dict(module.named_parameters())
        self.shared = [params[n] for n in params if len(param_stages.get(n, ())) > 1] if comm.world_size > 1 else []
        self.own = [params[n] for n in params if param_stages.get(n, {0}) == {grid.stage}] if grid.ways > 1 else []
        self._parts: Dict[int, Tensor] = {}

    @property
    def needed(self) -> bool:
        return bool(self.shared or self.own)

    @contextmanager
    def collecting(self) -> Iterator[None]:
        """Runs a drain with the partial parameters' gradients set aside: what it adds to them is
        collected for :meth:`reduce`, and their gradients are as before afterwards."""
        params = self.shared + self.own
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            for p, base in zip(params, before):
                part = p.grad
                if part is not None:
                    prev = self._parts.get(id(p))
                    self._parts[id(p)] = part if prev is None else prev + part
                p.grad = base

    def reduce(self) -> None:
        """Sums the collected parts over their ranks and adds them to the gradients (a collective)."""
        if not self.needed:
            return
        parts, self._parts = self._parts, {}
        if self.shared:
            self._sum(self.shared, parts, None, self.comm.world_size, self.comm.rank == 0)
        if self.own:
            self._sum(self.own, parts, self.grid.stage_group, self.grid.ways, self.grid.way == 0)

    def _sum(self, params: List[torch.nn.Parameter], parts: Dict[int, Tensor], group, size: int, first: bool) -> None:
        got = [parts.get(id(p)) for p in params]
        # which parameters got a gradient on any rank (bookkeeping, not counted): the others keep none, as on
        # one device, where an optimizer treats a missing gradient and a zero one differently
        device = next((g.device for g in got if g is not None), params[0].device)
        anywhere = torch.tensor([g is not None for g in got], dtype=torch.uint8, device=device)
        self.comm.all_reduce(anywhere, group, "which parameters have gradients", op="max")
        ref = next((g for g in got if g is not None), None)
        dtype = ref.dtype if ref is not None else params[0].dtype
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).to(dtype)
                          for p, g in zip(params, got)])
        self.comm.all_reduce_gradients(flat, group, size, first)
        off = 0
        for p, used in zip(params, anywhere.tolist()):
            n = p.numel()
            if used:
                total = flat[off:off + n].view_as(p).to(p.dtype)
                p.grad = total.clone() if p.grad is None else p.grad + total
            off += n

def sync_module_state(module: torch.nn.Module, owners: Mapping[str, int], ranks: Sequence[int], group=None,
                      comm: Optional[Comm] = None) -> None:
    """Copies every parameter and buffer from the rank of the stage that owns it to all ranks.

    Used before checkpoints and at the end of ``fit`` so that every rank (and so the user's model in
    the main process, whichever launcher ran) holds the whole trained model.

    Args:
        owners: parameter / buffer name -> owning stage (missing: stage 0).
        ranks: the rank holding each stage's authoritative copy.
        comm: the transport (default: one on the parameters' device).
    """
    module = uncompiled(module)  # (the owners are named as in the module torch.compile wrapped)
    tensors = dict(module.named_parameters())
    tensors.update(dict(module.named_buffers()))
    if comm is None:
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        comm = Comm(device)
    if comm.world_size == 1:
        return
    by_stage: Dict[int, List[Tensor]] = {}
    for name, t in tensors.items():
        by_stage.setdefault(owners.get(name, 0), []).append(t)
    with torch.no_grad():
        for s, ts in sorted(by_stage.items()):
            for dtype in sorted({t.dtype for t in ts}, key=str):
                same = [t for t in ts if t.dtype == dtype]
                flat = comm.broadcast(torch.cat([t.detach().reshape(-1) for t in same]), ranks[s],
                                      "gathering the model from its stages", group)
                off = 0
                for t in same:
                    t.copy_(flat[off:off + t.numel()].view_as(t))
                    off += t.numel()
