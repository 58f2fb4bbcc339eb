"""Module state the model's forward changes, refused where the forward does not run once a call.

A forward may keep state on its modules: a step counter (``self.t += 1``), a running average kept as a buffer
(``self.avg.mul_(0.9).add_(...)``), torch's spectral norm (its ``weight_u`` buffer advances one power iteration a
call). On one device that state changes once a call. Under the engine the forward runs once per chunk where a way has
several, and as a traced program in pipeline stages and in streaming, where a Python number read in the forward is
fixed when the forward is traced and an in-place update runs on every chunk: the state would advance several times a
call, or never, and later chunks would read other values than one device does. A counter scaling the hidden rows ran
off by 0.20 (2 stages, one chunk or four) and 0.40 (2 ways of 2 chunks) against one process with no error until
2026-11-28; a running average updated in place failed in autograd.

So the first call of each mode (training, evaluation) compares the modules' state before and after it: each buffer
(by its values' fingerprint, :func:`~pyg_pipe.model.inputs.fingerprint`) and each public number attribute (``int`` /
``float``, not a flag). Where the call did not run the forward once, untraced, on this process (one chunk a way and
one stage, as graph parallelism does), a change is refused on every rank, naming the module, the attribute and the
fix; the numbers are put back first. The statistics of the graph-wide norms the engine runs itself (BatchNorm's
running averages, :mod:`..runtime.statistics`) are the engine's and not compared."""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from ...model.errors import UnsupportedModelError
from ...model.inputs import fingerprint
from ...model.norms import needs_statistics


def checked(module: torch.nn.Module, comm, fill: bool, plan: Callable[[], object], run: Callable[[], object]):
    """``run()``, the first call of a mode, with the state it changed checked (:func:`check`), from before
    ``plan()`` (which traces the forward, and whose passes over a chunk put back the buffers they change)."""
    before = snapshot(module)
    rt = plan()
    out = run()
    check(module, before, rt, fill, comm)
    return out


def snapshot(module: torch.nn.Module) -> Dict[str, Tuple]:
    """The state of ``module``'s submodules: ``"path.name" -> ("buffer", fingerprint of its values)`` or
    ``("number", value)``."""
    out: Dict[str, Tuple] = {}
    for path, m in module.named_modules():
        if needs_statistics(m):
            continue
        prefix = f"{path}." if path else ""
        for name, t in m._buffers.items():
            if t is not None:
                out[prefix + name] = ("buffer", fingerprint(t))
        for name, value in vars(m).items():
            if type(value) in (int, float) and not name.startswith("_"):
                out[prefix + name] = ("number", value)
    return out


def runs_once(rt, fill: bool) -> bool:
    """Whether the forward ran once, untraced, on this process in a call of ``rt``'s plan."""
    plan = rt.plan
    return plan.sizes is None and not plan.streaming and (not fill or plan.chunks_per_way == 1)


def check(module: torch.nn.Module, before: Dict[str, Tuple], rt, fill: bool, comm) -> None:
    """After the first call of a mode (``fill``: a training fill, else an exact pass): refuse, on every rank, state
    the call changed where it did not run the forward once."""
    after = snapshot(module)
    changed: List[str] = [key for key, was in before.items() if after.get(key) != was]
    found = None
    if changed and not runs_once(rt, fill):
        key = changed[0]
        path, _, name = key.rpartition(".")
        owner = module.get_submodule(path)
        was, now = before[key], after.get(key)
        what = f"the values of its buffer `{name}`" if was[0] == "buffer" else \
            f"its attribute `{name}` ({was[1]!r} before the call, {now[1] if now else None!r} after)"
        plan = rt.plan
        how = (f"runs as a traced program in {'streaming' if plan.streaming else f'{plan.stages} pipeline stages'}, "
               f"where a Python number is fixed when traced and an in-place update runs on every chunk"
               if plan.sizes is not None or plan.streaming else
               f"runs once per chunk ({plan.chunks_per_way} a process, num_chunks={plan.num_chunks})")
        who = f"Module '{path}' ({type(owner).__name__})" if path else f"The model ({type(module).__name__})"
        found = (f"{who} changes {what} in its forward"
                 f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''}. Under pyg_pipe the forward {how}, "
                 f"so this state would not change once a call as on one device, and later chunks would read other "
                 f"values. Keep such state outside the model's forward (update it in the LightningModule, e.g. in "
                 f"on_train_batch_end, and pass it in), or train with strategy='graph_parallel' (one chunk a process, "
                 f"the forward untraced), where it changes once a call.")
    refusal = next((r for r in comm.all_gather_objects(found, "the state check") if r is not None), None)
    if refusal is not None:
        for key, was in before.items():  # (numbers put back; a buffer changed in place keeps what the call wrote)
            if was[0] == "number":
                path, _, name = key.rpartition(".")
                setattr(module.get_submodule(path), name, was[1])
        raise UnsupportedModelError(refusal)
