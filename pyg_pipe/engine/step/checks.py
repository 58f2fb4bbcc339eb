"""The checks a pass makes on what the user's model does with a cut graph, shared by the pipelined pass
(:mod:`.pipeline`) and the streamed one (:mod:`.stream`): operations that combine vertex rows outside
layers (:mod:`.rows`, on the first pass of each kind of call, agreed by every rank) and the model's output."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...model.errors import UnsupportedModelError
from ...model.inputs import CallInputs, call_tensors
from ..runtime.program import signature
from ..runtime.runtime import Runtime
from . import row_messages as texts
from .rows import RowCheck


def call_kind(rt: Runtime, inputs: CallInputs, sig: Optional[tuple] = None) -> tuple:
    """What the row check tells calls apart by: the mode, which arguments are tensors, ``None`` or which Python values
    (``sig``, :func:`~..runtime.program.signature`, computed if not given), and the tensors' dtypes."""
    sig = signature(rt.module, inputs) if sig is None else sig
    return sig, tuple(t.dtype for t in call_tensors(inputs))


def row_check(rt: Runtime, rows: int, kind: tuple) -> Optional[RowCheck]:
    """A check for operations that combine vertex rows outside layers (:mod:`.rows`), on the first
    pass of each kind of call (:func:`call_kind`) of a plan that cuts the graph (the same pass on every rank). A
    call that takes another path through the forward (labels as integers, not one-hot; a flag) is checked on its
    own first pass; until 2026-11-29 only the first of each mode was."""
    plan = rt.plan
    if plan.num_chunks == 1 or kind in rt.rows_checked:
        return None
    cut = f"num_chunks={plan.num_chunks}" + (f" over {plan.ways} graph-parallel ways" if plan.ways > 1 else "")
    return RowCheck(rows, rt.module_names, cut)


def verdict(rt: Runtime, check: RowCheck, kind: tuple) -> None:
    """After the checked pass: every rank raises the same error if any rank found an operation."""
    rt.rows_checked.add(kind)
    check.verdict(rt.comm)


def run_checked(rt: Runtime, check: Optional[RowCheck], runner, args, kwargs, given) -> tuple:
    """``runner.run(args, kwargs, given)``, under ``check`` where there is one (the first pass of a kind of call over
    part of the graph, :func:`row_check`); an error raised there that is not pyg_pipe's own raises the refusal the check
    recorded before it (what cutting the graph broke: a graph built from the edges, a size used as a value), else says
    what is cut (:func:`.row_messages.failed`), the original error its cause."""
    if check is None:
        return runner.run(args, kwargs, given)
    check.returned(list(given.values()))
    with check:
        try:
            return runner.run(args, kwargs, given)
        except Exception as exc:  # noqa: BLE001 - an error of the model's code on part of the graph
            if type(exc).__module__.startswith("pyg_pipe") or isinstance(exc, _NOT_THE_MODELS):
                raise  # (pyg_pipe's own: refusals, a peer's failure or silence, the streamed pass's barriers)
            raise UnsupportedModelError(check.refusal or texts.failed(method_name(rt), exc, check.cut)) from exc


#: errors a pass can meet that say nothing about the model's code on part of the graph: out of memory, and the
#: transport's own (a collective called by the model's code that lost its peer)
_NOT_THE_MODELS = (torch.OutOfMemoryError, getattr(torch.distributed, "DistError", torch.OutOfMemoryError))


def method_name(rt: Runtime) -> str:
    """``Model.method``: the method of the model the runtime distributes (``forward`` unless another)."""
    fn = rt.programs.fn
    return f"{type(rt.module).__name__}.{fn.__name__ if fn is not None else 'forward'}"


def check_output(out, rows: int, rt: Optional[Runtime] = None) -> Tensor:
    """``out`` if it has a row per vertex of the chunk (``rows``), else the refusal, naming the method distributed
    (``rt``'s) and, for one number, the fix for a method that computes the loss itself."""
    if not isinstance(out, Tensor) or out.dim() == 0 or out.size(0) != rows:
        what = f"a {type(out).__name__}" if not isinstance(out, Tensor) else f"shape {tuple(out.shape)}"
        method = method_name(rt) if rt is not None else "its forward"
        loss = (f" If {method} computes the loss itself (a shared step), call the layers in a method that returns "
                f"their output, forward(x, edge_index), and compute the loss from self(...) in {method}."
                if isinstance(out, Tensor) and out.dim() == 0 and method != "its forward"
                and not method.endswith(".forward") else "")
        raise UnsupportedModelError(
            f"The distributed model must return per-vertex tensors (one tensor, or a tuple, list or dict of them, "
            f"each with a row per vertex, of one dtype); {method} returned {what} for a chunk of {rows} vertices. "
            f"A value that is not per vertex (an auxiliary loss, one row per graph) depends on the whole graph, "
            f"which no process holds: return the per-vertex tensors it is computed from and compute it after the "
            f"model, on the whole output every rank receives; for a graph-level task on many small graphs, no "
            f"graph needs splitting: train with Lightning's strategy='ddp'.{loss}")
    return out


def same_loss(comm, grad: Tensor) -> None:
    """Every rank computed the loss from the whole output ``grad`` is the gradient of, and the ways each take the
    gradient of their own rows from theirs: the gradients must agree, or the rows would train on different losses (a
    random draw after the model, such as negative sampling, made differently on each rank). Checked once per call
    (a position-weighted sum, its largest and smallest over the ranks in one all-reduce of two numbers), with
    room for the order a device sums in."""
    g = grad.detach().reshape(-1).to(torch.float64)
    pos = torch.arange(1, g.numel() + 1, dtype=torch.float64, device=g.device) % 997 + 1
    total = (g * pos).sum()
    both = torch.stack([total, -total])
    comm.all_reduce(both, None, "the loss check", op="max")
    hi, lo = float(both[0]), -float(both[1])
    room = float(g.abs().sum()) * 997 * 1e-6 + 1e-12
    if abs(hi - lo) > room and abs(hi - lo) == abs(hi - lo):  # (not NaN: a NaN loss is the user's to see)
        raise UnsupportedModelError(
            f"The gradient of the loss with respect to the model's output differs between processes (a checksum "
            f"of it is {lo:.6g} on one and {hi:.6g} on another): pyg_pipe hands every process the "
            f"whole output, and each takes the gradient of its own vertices from its own loss, so the loss "
            f"must be computed the same on every process. A random draw after the model (negative sampling, "
            f"dropout in a decoder) must give the same values on every rank: seed it per step, e.g. "
            f"torch.manual_seed(seed + self.global_step) before negative_sampling, or draw with a "
            f"torch.Generator seeded so.")
