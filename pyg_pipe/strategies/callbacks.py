"""Callbacks the strategies add to the Trainer: communication, timeline and staleness logging, and gradient
clipping by the norm over all stages."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional

import torch
from lightning.pytorch.callbacks import Callback

from ..engine import CATEGORIES

log = logging.getLogger("pyg_pipe")


def _metric(value, pl_module) -> torch.Tensor:
    """A float64 metric on the module's device: Lightning syncs logged tensors where they are, and NCCL
    cannot reduce a CPU tensor (found on the first GPU run: every epoch end failed)."""
    return torch.tensor(float(value), dtype=torch.float64, device=pl_module.device)


class CommLogger(Callback):
    """Logs the pipeline's communication of every training epoch: ``comm/bytes`` (summed over all
    ranks) and ``comm/<category>`` for each category of :mod:`pyg_pipe.engine.comm` the grid sends."""

    def __init__(self, strategy):
        self.strategy = strategy
        self._epoch: Dict[str, int] = {}

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._epoch = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.strategy.comm is None:
            return
        for k, v in self.strategy.comm.totals(reduce=True).items():
            self._epoch[k] = self._epoch.get(k, 0) + v
        self.strategy.comm.reset_counters()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self._epoch:
            return
        self.strategy.comm_history.append(dict(self._epoch))
        # the counts are already summed over ranks (the same on every rank): sync_dist only keeps
        # Lightning from asking for it
        log = dict(on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
        pl_module.log("comm/bytes", _metric(self._epoch["total"], pl_module), **log)
        for cat in self.categories:
            pl_module.log(f"comm/{cat}", _metric(self._epoch.get(cat, 0), pl_module), **log)

    @property
    def categories(self) -> List[str]:
        """The categories this grid can send (pipeline ones with stages, halo ones with ways)."""
        engine = self.strategy.engine
        stages, ways = (engine.num_stages, engine.ways) if engine is not None and engine.grid is not None else (2, 2)
        skip = set()
        if stages == 1:
            skip |= {"stage_activations", "stage_gradients", "carried"}
        if ways == 1:
            skip |= {"halo_forward", "halo_backward", "weight_allreduce"}
        return [c for c in CATEGORIES if c not in skip]


class TimelineLogger(Callback):
    """Logs where the stages' time went in each training epoch (:mod:`pyg_pipe.engine.runtime.timeline`):
    ``time/compute``, ``time/wait`` and ``time/bubble`` in seconds per step, and ``time/bubble_share``
    (bubble ÷ all three), each the largest over the ranks; per stage ``time/compute/stage<s>`` (the
    largest over its ways), and ``time/stage_imbalance``, the slowest stage's compute ÷ the stages' mean
    (1.0: balanced; a stage above it sets the pipeline's pace, and ``balance`` or ``split_points`` move
    layers off it). Recorded on CPU devices only.

    With ``num_chunks="auto"`` it also checks the cost model (:mod:`pyg_pipe.engine.plan.chunk_cost`): once
    :data:`CHECK_STEPS` steps after the first (which plans and fills history exactly) have run, the measured
    step (compute + wait + bubble, the largest over the ranks, median over those steps) is set against the
    step predicted for the chosen count, in one line (logged and added to ``strategy.notes``) and in
    ``strategy.plan_check``. Where no timeline is recorded (GPUs), the measured step is the training step's
    wall time, the device synchronised at its start and end for those steps only (it then also holds the
    optimizer step and Lightning's own work)."""

    #: steps after the first measured before the prediction is checked
    CHECK_STEPS = 3

    def __init__(self, strategy):
        self.strategy = strategy
        self._steps: List[Dict[str, float]] = []
        self._totals: List[float] = []   # per step after the first: compute + wait + bubble on this rank
        self._seen = 0                   # steps recorded so far in the run
        self._started: Optional[float] = None  # no timeline: when this step started (wall clock)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._steps = []

    def _checking(self, engine) -> bool:
        plan = engine.plan if engine is not None else None
        return plan is not None and plan.predicted_step is not None and self.strategy.plan_check is None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        engine = self.strategy.engine
        if engine is not None and not engine.timeline.on and (engine.plan is None or self._checking(engine)):
            self._started = _synchronized(self.strategy.root_device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        engine = self.strategy.engine
        if engine is None:
            return
        if engine.timeline.on:
            new = engine.timeline.take()
            self._steps += new
            totals = [s["compute"] + s["wait"] + s["bubble"] for s in new]
        elif self._started is not None:
            totals = [_synchronized(self.strategy.root_device) - self._started]
            self._started = None
        else:
            totals = []
        self._check(engine, totals)

    def _check(self, engine, totals: List[float]) -> None:
        """The predicted step against the measured ones (class docstring); a collective, once, on every rank
        at the same step (the prediction is broadcast with the count, so every rank decides alike)."""
        plan = engine.plan
        if not self._checking(engine):
            return
        for t in totals:
            if self._seen > 0:
                self._totals.append(t)
            self._seen += 1
        if len(self._totals) < self.CHECK_STEPS:
            return
        comm = self.strategy.comm
        ranks = comm.all_gather_objects(self._totals, "checking the predicted step") if comm.distributed \
            else [self._totals]
        steps = sorted(max(r[i] for r in ranks) for i in range(len(self._totals)))
        measured, predicted = steps[len(steps) // 2], plan.predicted_step
        self.strategy.plan_check = {"num_chunks": plan.num_chunks, "predicted_step_s": predicted,
                                    "measured_step_s": measured, "steps": len(steps)}
        what = "compute + wait + bubble" if engine.timeline.on else "the training step's wall time"
        line = (f"pyg_pipe: num_chunks='auto' ({plan.num_chunks} chunks): the measured step is {measured:.3g} s "
                f"against the predicted {predicted:.3g} s ({measured / predicted:.2f}x; the median of {len(steps)} "
                f"steps after the first, {what}, the largest over the ranks).")
        log.info(line)
        engine.notes.append(line)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        engine = self.strategy.engine
        if engine is None or not engine.timeline.on:  # the same on every rank: every rank logs, or none
            return
        n = max(len(self._steps), 1)
        per_step = {k: sum(s[k] for s in self._steps) / n for k in ("compute", "wait", "bubble")}
        total = sum(per_step.values())
        per_step["bubble_share"] = per_step["bubble"] / total if total > 0 else 0.0
        comm, grid = self.strategy.comm, engine.grid
        if comm is not None and comm.distributed and grid is not None:  # every rank's stage and compute, once
            stages: Dict[int, float] = {}
            for stage, compute in comm.all_gather_objects((grid.stage, per_step["compute"]),
                                                          "gathering the timeline"):
                stages[stage] = max(stages.get(stage, 0.0), compute)
            for stage, compute in sorted(stages.items()):
                per_step[f"compute/stage{stage}"] = compute
            mean = sum(stages.values()) / len(stages)
            per_step["stage_imbalance"] = max(stages.values()) / mean if mean > 0 else 1.0
        log = dict(on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
        for k, v in per_step.items():  # the per-stage values are the same on every rank (gathered above)
            pl_module.log(f"time/{k}", _metric(v, pl_module), **log)


def _synchronized(device: torch.device) -> float:
    """The wall clock once ``device`` has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StalenessLogger(Callback):
    """Logs how stale the historical rows read in each training epoch were (:mod:`pyg_pipe.engine.runtime.staleness`):
    ``staleness/max_drift`` (the largest per-site relative drift), ``staleness/drift/<site>``,
    ``staleness/stale_share`` (stale halo reads ÷ all halo reads), ``staleness/mean_age`` (optimizer
    updates) and ``staleness/refreshes`` (exact refills the bounds ``max_age`` / ``max_staleness`` asked
    for). Every rank's steps are gathered once per epoch, so all ranks log the same keys and values;
    nothing is logged when no rank read history (one chunk per way, streaming, ``staleness_meter=False``)."""

    def __init__(self, strategy):
        self.strategy = strategy
        self._steps: List[dict] = []
        self._refreshes = 0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._steps = []
        engine = self.strategy.engine
        self._refreshes = engine.meter.refreshes if engine is not None else 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        engine = self.strategy.engine
        if engine is not None:
            self._steps += engine.meter.take()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        engine, comm = self.strategy.engine, self.strategy.comm
        if engine is None or not engine.meter.on:  # the same on every rank
            return
        from ..engine.runtime.staleness import summarize
        steps = self._steps
        if comm is not None and comm.distributed:
            steps = [s for rank in comm.all_gather_objects(steps, "gathering the staleness meter") for s in rank]
        if not steps:
            return
        metrics = summarize(steps)
        metrics["refreshes"] = float(engine.meter.refreshes - self._refreshes)  # the same on every rank
        for k, v in metrics.items():
            # the same on every rank (gathered above): sync_dist only keeps Lightning from asking for it
            pl_module.log(f"staleness/{k}", _metric(v, pl_module), on_step=False, on_epoch=True,
                          sync_dist=True, reduce_fx="max")


class MemoryCheck(Callback):
    """Predicts the peak memory of a training step on this process once the first step (with its optimizer
    step) has run (:mod:`pyg_pipe.engine.plan.memory_cost`; pipelines, not streaming) and logs it in one line
    (also in ``strategy.notes``); the strategy sets it against the fit's measured peak at the end
    (``strategy.memory_check``)."""

    def __init__(self, strategy):
        self.strategy = strategy

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from ..engine.plan.memory_cost import predict
        from ..engine.step.chunk import decide_recompute
        strategy, engine = self.strategy, self.strategy.engine
        rt = engine.runtime if engine is not None else None
        if strategy.memory_prediction is not None or rt is None or rt.plan.streaming or not rt.memory.done:
            return
        meter = strategy._memory
        prediction = predict(rt, pl_module.parameters(), trainer.optimizers,
                             meter.in_use() if meter is not None else None)
        if rt.recompute_pending:  # recompute="auto": decided now, from this prediction (optimizer state counted)
            engine.notes.append(decide_recompute(rt, prediction))
            prediction = replace(prediction, recompute=bool(rt.recompute))
        strategy.memory_prediction = prediction
        line = prediction.line()
        log.info(line)
        engine.notes.append(line)


def memory_check(prediction, measured: List[int]) -> dict:
    """``strategy.memory_check``: per rank, the predicted peak (bytes, by part) against the measured one
    (``measured``, the fit's net peak per rank); the line that says it."""
    ranks = [dict(p or {}, measured_peak_bytes=m) for p, m in zip(prediction, measured)]
    told = [r for r in ranks if r.get("predicted_peak_bytes")]
    if not told:
        return {"ranks": ranks, "line": None}
    worst = max(told, key=lambda r: abs(r["measured_peak_bytes"] / r["predicted_peak_bytes"] - 1.0))
    line = ("pyg_pipe: peak memory per process, measured against predicted (MB): " + ", ".join(
        f"{r['measured_peak_bytes'] / 2**20:.0f} / {r['predicted_peak_bytes'] / 2**20:.0f}" for r in told)
        + f"; the farthest {worst['measured_peak_bytes'] / worst['predicted_peak_bytes']:.2f}x.")
    log.info(line)
    return {"ranks": ranks, "line": line}


class GlobalNormClipping(Callback):
    """``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")`` over the whole model.

    Each rank holds the gradients of its stage only, so the norm Lightning computes per rank is not the
    model's. Before the optimizer step (Lightning's ``on_before_optimizer_step``, after AMP unscaling and
    before Lightning clips) every rank adds the squared norms of the gradients it owns (replicated
    parameters counted once), one all-reduce sums them, and all ranks scale by the same factor as one
    process would. Lightning's own clipping then finds every rank's norm within the bound and leaves the
    gradients unchanged. (With manual optimization, call ``trainer.strategy.clip_gradients_by_global_norm``.)
    """

    def __init__(self, strategy):
        self.strategy = strategy

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        algorithm = trainer.gradient_clip_algorithm
        norm = algorithm is None or algorithm == "norm"
        if trainer.gradient_clip_val and norm and pl_module.automatic_optimization:
            self.strategy.clip_gradients_by_global_norm(optimizer, float(trainer.gradient_clip_val))


def clip_by_global_norm(optimizer, owned: Callable[[torch.nn.Parameter], bool], max_norm: float, comm,
                        device) -> None:
    """``clip_grad_norm_`` over the whole model: each rank adds the squared norms of the gradients it
    ``owned`` (replicated parameters are owned by one rank), one all-reduce sums them, and every rank
    scales its gradients by the same factor."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if owned(p):
            sq += p.grad.detach().double().pow(2).sum()
    if comm is not None:
        comm.all_reduce(sq, None, "the gradient norm")
    coef = float(max_norm) / (float(sq.sqrt()) + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)
