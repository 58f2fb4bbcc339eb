"""Checks shared by the engine tests: run a model through the engine on every rank and compare it with
plain single-process PyG.

Each check runs every step on every rank whatever happens (so ranks stay in step), then all ranks
agree on the outcome: ``"exact"``, ``"refused: <message>"`` (an :class:`UnsupportedModelError` raised
before the first step), or ``"different: <what>"`` / ``"crash: <error>"``.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pyg_pipe import UnsupportedModelError
from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, sync_module_state
from pyg_pipe.engine.tree import flatten

ATOL = 1e-5


def ranges(edge_index, num_nodes: int, num_chunks: int):
    """A partitioner: chunks of consecutive vertices (the graph's own order)."""
    return torch.arange(num_nodes), torch.linspace(0, num_nodes, num_chunks + 1).long()


def three_layers(first: Callable[[], torch.nn.Module], second: Callable[[], torch.nn.Module],
                 third: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    """A model class of three layers called on ``(x, edge_index)``, a ReLU between them (each made by its
    callable, in order, when the model is built)."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2, self.conv3 = first(), second(), third()

        def forward(self, x, edge_index):
            x = self.conv1(x, edge_index).relu()
            return self.conv3(self.conv2(x, edge_index).relu(), edge_index)
    return Model


def loss_of(out, y, mask):
    """Cross-entropy of the output, or the sum over the tensors of a structured output (a tuple, a dict)."""
    return sum(F.cross_entropy(t[mask], y[mask]) for t in _leaves(out))


def _leaves(out):
    return flatten(out)[0]


def _diff(a, b) -> float:
    """The largest absolute difference between two outputs of the same structure."""
    return max((x - y).abs().max().item() for x, y in zip(_leaves(a), _leaves(b)))


def _engine(model, stages, ways, chunks, **cfg):
    cfg.setdefault("partition", "greedy")
    return GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, **cfg), Comm(torch.device("cpu"), timeout=60),
                         num_stages=stages, ways=ways)


def _agree(outcome: str) -> str:
    """Every rank reports the worst outcome any rank saw (refused < exact < different < crash)."""
    if not dist.is_initialized():
        return outcome
    every: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, outcome)
    order = ["exact", "refused", "different", "crash"]
    return max(every, key=lambda o: order.index(o.split(":")[0]))


def _build(make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The model, with every rank holding rank 0's initial state (as the strategies ensure; some PyG
    layers leave parameters uninitialised until used)."""
    torch.manual_seed(0)
    model = make()
    if dist.is_initialized():
        sync_module_state(model, {}, [0])
    return model


def check_exact(make: Callable[[], torch.nn.Module], inputs: Dict, y, mask, stages: int, ways: int,
                steps: int = 3, lr: float = 0.05, chunks: Optional[int] = None, **cfg) -> str:
    """One chunk per way (or streaming, where every read is fresh at any number of ``chunks``): ``steps``
    SGD+momentum steps through the engine equal plain PyG (output, loss, the gradients this rank's
    stage owns, every parameter after syncing), then inference."""
    model = _build(make)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    engine = _engine(model, stages, ways, chunks or ways, **cfg)
    worst, what = 0.0, ""
    try:
        engine.install()
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        for step in range(steps):
            torch.manual_seed(step)
            out = model(**inputs)
            loss = loss_of(out, y, mask)
            opt.zero_grad()
            loss.backward()
            torch.manual_seed(step)
            ref_out = ref(**inputs)
            ref_loss = loss_of(ref_out, y, mask)
            ref_opt.zero_grad()
            ref_loss.backward()
            err = _diff(out, ref_out)
            if err > worst:
                worst, what = err, f"output at step {step}"
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                if p.grad is not None and q.grad is not None and engine.owners.get(name, 0) == engine.stage_index:
                    err = (p.grad - q.grad).abs().max().item()
                    if err > worst:
                        worst, what = err, f"gradient of {name} at step {step}"
            opt.step()
            ref_opt.step()
        sync_module_state(model, engine.owners, engine.owner_ranks)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            err = (p - q).abs().max().item()
            if err > worst:
                worst, what = err, f"parameter {name} after {steps} steps"
        model.eval()
        ref.eval()
        with torch.no_grad():
            err = _diff(model(**inputs), ref(**inputs))
        if err > worst:
            worst, what = err, "inference"
        outcome = "exact" if worst <= ATOL else f"different: {what} off by {worst:.2e}"
    except UnsupportedModelError as exc:
        outcome = f"refused: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
        outcome = f"crash: {type(exc).__name__}: {exc}"
    finally:
        engine.uninstall()
    return _agree(outcome)


def check_lr0(make: Callable[[], torch.nn.Module], inputs: Dict, y, mask, stages: int, ways: int, chunks: int,
              steps: int = 3, **cfg) -> str:
    """Several chunks, lr = 0, no dropout: history starts exact and weights never change, so every
    step's training forward (and the inference after) equals plain PyG."""
    model = _build(make)
    with torch.no_grad():
        ref = copy.deepcopy(model)(**inputs)
    engine = _engine(model, stages, ways, chunks, **cfg)
    worst, what = 0.0, ""
    try:
        engine.install()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for step in range(steps):
            out = model(**inputs)
            loss = loss_of(out, y, mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
            err = _diff(out, ref)
            if err > worst:
                worst, what = err, f"training forward at step {step}"
        with torch.no_grad():
            err = _diff(model(**inputs), ref)
        if err > worst:
            worst, what = err, "inference"
        outcome = "exact" if worst <= ATOL else f"different: {what} off by {worst:.2e}"
    except UnsupportedModelError as exc:
        outcome = f"refused: {exc}"
    except Exception as exc:  # noqa: BLE001
        outcome = f"crash: {type(exc).__name__}: {exc}"
    finally:
        engine.uninstall()
    return _agree(outcome)


#: the modes the sweeps run, and the world size each needs
MODES = {"graph_parallel": 2, "pipeline": 2, "chunks": 2, "graph_parallel_chunks": 2, "hybrid": 4, "streaming": 1,
         "streaming_disk": 1}


def check_mode(mode: str, make: Callable[[], torch.nn.Module], inputs: Dict, y, mask, world: int) -> str:
    """One model in one mode of the sweeps:

    * ``graph_parallel``: ``world`` ways, one chunk each: :func:`check_exact`;
    * ``pipeline``: ``world`` stages, one chunk: :func:`check_exact`;
    * ``chunks``: ``world`` stages, 4 chunks of consecutive vertices, not shuffled (the first chunk to
      run can be a whole component, with no halo): :func:`check_lr0`;
    * ``graph_parallel_chunks``: one stage, ``world`` ways of 2 chunks each: :func:`check_lr0`;
    * ``hybrid``: 2 stages x 2 ways, 8 chunks, shuffled, greedy partition: :func:`check_lr0`.
    * ``streaming``: one device, 4 chunks of consecutive vertices, streamed group by group:
      :func:`check_exact` at lr > 0 (every read is fresh); ``streaming_disk``: the same with every
      buffer in memory-mapped files (``offload="disk"``, a budget of 0 bytes on the device).
    """
    if mode == "streaming":
        return check_exact(make, inputs, y, mask, 1, 1, chunks=4, partition=ranges, streaming=True)
    if mode == "streaming_disk":
        return check_exact(make, inputs, y, mask, 1, 1, chunks=4, partition=ranges, streaming=True, offload="disk",
                           offload_budget=0)
    if mode == "graph_parallel":
        return check_exact(make, inputs, y, mask, 1, world)
    if mode == "pipeline":
        return check_exact(make, inputs, y, mask, world, 1)
    if mode == "chunks":
        return check_lr0(make, inputs, y, mask, world, 1, 4, partition=ranges, shuffle_chunks=False)
    if mode == "graph_parallel_chunks":
        return check_lr0(make, inputs, y, mask, 1, world, 2 * world)
    return check_lr0(make, inputs, y, mask, 2, 2, 8)
