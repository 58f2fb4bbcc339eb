"""The engine's knobs: what each means, and their validation when they are set."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Union

import torch

from ..model.trace import SplitPoint
from .plan.schedule import SHUFFLES


@dataclass
class PipelineConfig:
    """The engine's knobs: every one of them is also an argument of the strategies
    (:class:`pyg_pipe.GNNPipeStrategy`, :class:`pyg_pipe.HybridStrategy`,
    :class:`pyg_pipe.GraphParallelStrategy`); docs/gnnpipe.md says when to use which.

    Attributes:
        num_chunks: chunks the graph is cut into. ``"auto"`` (the default): the fewest chunks a way whose
            predicted step is within 10 % of the fastest, from a training pass of the model timed once on two
            chunkings (:mod:`.plan.chunk_cost`; logged, saved in checkpoints; one per way for a single
            stage; streaming on one device: from memory). ``None``: 4 per stage for each way, one per way
            for a single stage. At most |V|. One chunk per way gives exact model parallelism; more chunks
            shrink the pipeline bubble but read neighbours from historical embeddings.
        grid: the rank grid: ``"pipeline"`` (the default): one stage a device, with graph-parallel ways added when
            the model has fewer layer groups than devices; ``"auto"``: stages x ways from a cost model of the step
            (a chunk's training pass timed on two sizes, graph parallelism's pass timed with its halo exchanges, the
            link between two ranks timed; :mod:`.plan.grid_cost`; logged, saved in checkpoints; the chunk count is
            then ``num_chunks``'s).
            ``HybridStrategy`` and ``GraphParallelStrategy`` fix their grid.
        shuffle_chunks: T1, a new chunk order every step (the same on every stage): ``True`` (default) draws
            them in pairs, an order and then its reverse, so that over two steps every chunk reads every other
            chunk of its way fresh once; ``"independent"`` draws each step's alone (GNNPipe's T1); ``False``
            keeps the chunks' own order (:mod:`.plan.schedule`).
        snapshot_period: T2, historical embeddings snapshotted every this many steps and restored in
            between (``None``: off). 11 by default: as good as the GNNPipe authors' 23 or better in every
            setting measured (GCNII, ResGCN+ and GAT; 8 and 32 chunks; 16 and 32 layers; docs/convergence.md).
        unbiased_gradients: T3, cross-chunk gradients of fresh reads scaled by 2, stale ones dropped.
        late_gradients: the gradients of stale reads, dropped otherwise, reach their owners in the next
            step's drain (PipeGCN's stale feature gradients); nothing is dropped, so T3's scaling is off.
            Every read's gradient then arrives on average once (exactly once without T1, at lr = 0), at
            the cost of one more buffer per call site. One way per stage (not with ``ways > 1``).
            Experimental: training diverged with it in docs/convergence.md's study (a share of the gradient
            lags).
        balance: ``"time"`` (each layer timed once on a chunk and stages split by cost; decided once, saved
            and reused), ``"layers"`` (equal layer counts) or a list with the number of message-passing
            layers of every stage.
        partition: the vertex partitioner for chunks: ``"auto"`` (METIS via ``pymetis`` when installed, else
            a locality-preserving greedy fallback), ``"metis"``, ``"greedy"``, ``"random"``, ``"contiguous"``,
            or a callable ``(edge_index, num_nodes, num_chunks) -> (perm, ptr)``.
        seed: seed of the partitioner and of the chunk order.
        per_chunk_statistics: how graph-wide statistics (BatchNorm, GraphNorm, ...) run when a way has
            several chunks: ``False`` refuses them, ``True`` takes each chunk's own rows (approximate, as
            GPipe does for micro-batches), ``"history"`` (norms computed from sums: BatchNorm, GraphNorm,
            InstanceNorm, graph-mode LayerNorm, PairNorm, MeanSubtractionNorm, GraphSizeNorm) the whole graph's, other
            chunks' sums from their latest run (approximate, exact at lr = 0 after the first step; not with
            streaming; :mod:`.runtime.statistics`); ``"auto"`` (default): ``"history"`` when every such module
            is one of those and the pipeline runs (one log line), else ``False``. With one chunk per way they
            are exact.
        split_points: ``{"module.name": SplitPoint.BEGINNING | SplitPoint.END}``: cut the pipeline before /
            after that module (the convention of ``torch.distributed.pipelining``; calling
            ``pyg_pipe.pipe_split()`` in the forward does the same).
        recompute: keep only each chunk's stage inputs during the fill and recompute its activations in the
            drain (bit-identical; ``"auto"``: when a way runs several chunks, the first step replays them and
            the memory model (:mod:`.plan.memory_cost`) then predicts the peak of keeping them: kept from
            the second step on if that fits ``memory_budget``; docs/memory.md). Streaming replays each chunk's
            forward in the backward the same way; ``False`` keeps every chunk's activations instead (a third
            less compute), ``"auto"`` keeps them when they fit a quarter of the free memory (measured in the
            first step's replays).
        memory_budget: bytes a pipeline process may hold for what the memory model counts (graph
            structures and history, gradients and optimizer state, activations and pending gradients, the
            drain's working set), for ``recompute="auto"`` and for ``num_chunks="auto"`` (its count is doubled
            until the first step's peak, estimated before it from one training pass over a chunk, fits; where
            none does, the history goes to host memory if that fits and ``offload`` is unset:
            :mod:`.plan.memory_fit`). ``None`` (default): keeping must fit the device's free memory after the
            first step, less 10 %, and on an accelerator the first step the least free memory of the ranks,
            less 10 %; on a CPU the count is then chosen from time alone. Not the process's whole
            footprint (the CUDA context, Python); ``torch.cuda.set_per_process_memory_fraction`` also bounds
            the free memory read.
        offload, offload_budget, offload_dir: historical embeddings (and, streaming, the values between
            layer groups) beyond ``offload_budget`` bytes on the device (``"auto"``: half the free memory;
            ``None``: none once ``offload`` is set) go to ``"host"`` memory or ``"disk"`` (memory-mapped files
            in ``offload_dir``, a temporary directory by default); identical results (docs/memory.md).
        streaming: on one device, run the model layer group by layer group over all chunks (NGra chunk
            streaming, :mod:`.step.stream`): exact like plain PyG, holding one chunk of one layer on the
            device, with the values between groups in the memory tiers (``"auto"``: on one device with
            several chunks or an offload tier; ``False``: one pipeline stage with historical embeddings).
        cuda_graphs: streaming on one CUDA device, capture the training step as CUDA graphs after two eager
            steps and replay it (:mod:`.step.capture`: the host's Python per chunk and layer leaves the step;
            the same results). Models drawing random numbers (dropout), offload tiers and captures that fail
            stay uncaptured, with one log line saying why. ``False``: never capture.
        overlap: post the receives of the next chunk's values (fill) and gradients (drain) before computing
            the current chunk, so transfers between stages run during compute (:mod:`.runtime.link`); the
            same results, bit for bit.
        boundary_dtype: ``torch.bfloat16`` (or ``torch.float16``) for the activations and gradients crossing
            stage cuts and halos in training passes: half the bytes, approximate (docs/gnnpipe.md measures
            it); validation, test, predict and the exact pass keep the values' own dtype. ``None``: as computed.
        history_dtype: ``torch.bfloat16`` (or ``torch.float16``) for the historical rows kept between steps (and
            their snapshots): half the history's memory, the stale rows read rounded to it (approximate;
            docs/gnnpipe.md measures it); fresh rows, gradients and exact results are unchanged. ``None``: as
            computed.
        timeline_trace: a file path: every rank's chunks (compute, waits for transfers, the bubble) written
            there as one Chrome trace when training ends (Perfetto or ``chrome://tracing``;
            :mod:`.runtime.timeline`). The per-step sums are logged as ``time/compute``, ``time/wait``,
            ``time/bubble`` and ``time/bubble_share`` in any case (CPU devices; docs/benchmarks.md).
        staleness_meter: measure how far the historical rows each training step read were from the fresh
            ones (with dropout: how far the rows moved between exact probes without it, one forward pass
            without gradients every ``snapshot_period`` steps), per call site, and log it per epoch:
            ``staleness/max_drift``, ``staleness/drift/<site>``, ``staleness/stale_share``,
            ``staleness/mean_age`` (:mod:`.runtime.staleness`; a few index-selects after each fill).
        max_age: refresh the history with an exact pass (one forward of the whole model, no gradients) before
            a step whose stale reads would be more than this many optimizer updates old (``0``: every step, an
            exact training forward; ``None``: no bound but T2's).
        max_staleness: refresh it before the next step when the largest per-site drift of a step
            (``staleness/max_drift``, over all ranks) exceeds this, e.g. ``0.1`` (``None``: no bound); with a
            forward that draws random numbers (dropout), when the probes' drift per update times the age of
            the rows the next step would read does (:mod:`.runtime.staleness`). How often either bound
            refreshed is logged as ``staleness/refreshes``.
        smoothing: a momentum ``γ`` in [0, 1): stale neighbours are read as a moving average over steps of
            their historical rows, ``s ← γ·s + (1-γ)·h`` (PipeGCN's smoothing; :mod:`.runtime.history`);
            fresh ones as computed. ``None``: the last rows (docs/convergence.md measures both).
        halo_exchange: how graph-parallel ways (``graph_parallel``, hybrid) exchange halo rows and their
            gradients at every layer: ``"all_to_all"`` (every way sends every other way the rows it reads, one
            grouped exchange) or ``"ring"`` (NGra's ring: rows pass hop by hop between neighbouring ways,
            gradients are summed on the way back; the same values, each rank talks to 2 peers, but at least
            as many bytes; :mod:`.runtime.ring`, docs/graph_parallel.md). Nothing changes without ways.
    """

    num_chunks: Optional[Union[int, str]] = "auto"
    grid: str = "pipeline"
    shuffle_chunks: Union[bool, str] = True
    snapshot_period: Optional[int] = 11
    unbiased_gradients: bool = True
    late_gradients: bool = False
    balance: Union[str, Sequence[int]] = "time"
    partition: Union[str, Callable] = "auto"
    seed: int = 0
    per_chunk_statistics: Union[bool, str] = "auto"
    split_points: Optional[Dict[str, SplitPoint]] = None
    recompute: Union[bool, str] = "auto"
    memory_budget: Optional[int] = None
    offload: Optional[str] = None
    offload_budget: Union[None, int, str] = None
    offload_dir: Optional[str] = None
    streaming: Union[bool, str] = "auto"
    cuda_graphs: bool = True
    overlap: bool = True
    boundary_dtype: Optional["torch.dtype"] = None
    history_dtype: Optional["torch.dtype"] = None
    timeline_trace: Optional[str] = None
    staleness_meter: bool = True
    max_age: Optional[int] = None
    max_staleness: Optional[float] = None
    smoothing: Optional[float] = None
    halo_exchange: str = "all_to_all"

    @property
    def chunks_given(self) -> int:
        """``num_chunks`` when it is a number, else 1 (``None`` or ``"auto"``: decided by the plan)."""
        return self.num_chunks if isinstance(self.num_chunks, int) else 1

    def streams(self, devices: int) -> bool:
        """Whether a run on ``devices`` devices streams (``streaming="auto"``: one device, and several chunks
        or an offload tier or budget asked for)."""
        if self.streaming == "auto":
            return devices == 1 and (self.chunks_given > 1 or self.offload is not None
                                     or self.offload_budget is not None)
        return bool(self.streaming)

    def validate(self) -> None:
        """Raises ``ValueError`` naming the first knob with a value the engine cannot use, and the fix."""
        if self.num_chunks is not None and self.num_chunks != "auto" and (
                not isinstance(self.num_chunks, int) or isinstance(self.num_chunks, bool) or self.num_chunks < 1):
            raise ValueError(f"num_chunks={self.num_chunks!r} must be a positive integer, 'auto' (from a measured cost "
                             f"model) or None (4 per stage).")
        if self.grid not in ("pipeline", "auto"):
            raise ValueError(f"grid={self.grid!r} must be 'pipeline' (one stage a device) or 'auto' (stages x ways "
                             f"from a measured cost model); HybridStrategy(stages=, ways=) fixes the grid by hand.")
        if self.shuffle_chunks not in SHUFFLES or not isinstance(self.shuffle_chunks, (bool, str)):
            raise ValueError(f"shuffle_chunks={self.shuffle_chunks!r} must be True (a new chunk order every step, "
                             f"in pairs: an order, then its reverse), 'independent' (each step's order drawn alone) "
                             f"or False (the chunks' own order).")
        if self.snapshot_period is not None and (not isinstance(self.snapshot_period, int)
                                                 or isinstance(self.snapshot_period, bool) or self.snapshot_period < 1):
            raise ValueError(f"snapshot_period={self.snapshot_period!r} must be a positive integer, or None to "
                             f"turn periodic snapshots off.")
        if self.per_chunk_statistics not in (True, False, "history", "auto"):
            raise ValueError(f"per_chunk_statistics={self.per_chunk_statistics!r} must be 'auto' ('history' for "
                             f"norms computed from sums, such as BatchNorm, in the pipeline, else refused), False "
                             f"(refuse graph-wide statistics with several chunks per way), True (each chunk's own "
                             f"rows) or 'history' (the whole graph's: other chunks' sums from their latest run).")
        if self.recompute not in (True, False, "auto"):
            raise ValueError(f"recompute={self.recompute!r} must be True, False or 'auto' (recompute when the "
                             f"predicted peak of keeping every chunk's activations would not fit memory_budget).")
        if self.memory_budget is not None and (not isinstance(self.memory_budget, int)
                                               or isinstance(self.memory_budget, bool) or self.memory_budget < 1):
            raise ValueError(f"memory_budget={self.memory_budget!r} must be a positive number of bytes (what a "
                             f"process may hold for the graph, history, gradients, optimizer state and "
                             f"activations), or None (the device's free memory after the first step).")
        if self.boundary_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"boundary_dtype={self.boundary_dtype!r} must be torch.bfloat16 or torch.float16 (the "
                             f"dtype activations and gradients travel in between stages and ways), or None to send "
                             f"them as computed.")
        if self.history_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"history_dtype={self.history_dtype!r} must be torch.bfloat16 or torch.float16 (the "
                             f"dtype historical rows are kept in), or None to keep them as computed.")
        if self.timeline_trace is not None and not isinstance(self.timeline_trace, (str, os.PathLike)):
            raise ValueError(f"timeline_trace={self.timeline_trace!r} must be a file path (the Chrome trace to "
                             f"write) or None.")
        if not isinstance(self.staleness_meter, bool):
            raise ValueError(f"staleness_meter={self.staleness_meter!r} must be True (measure the drift of the "
                             f"historical rows each step reads) or False.")
        if self.max_age is not None and (not isinstance(self.max_age, int) or isinstance(self.max_age, bool)
                                         or self.max_age < 0):
            raise ValueError(f"max_age={self.max_age!r} must be a number of optimizer updates (>= 0; 0 refreshes "
                             f"before every step) or None for no bound.")
        if self.max_staleness is not None:
            if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, (int, float)) \
                    or not self.max_staleness >= 0:
                raise ValueError(f"max_staleness={self.max_staleness!r} must be a relative drift (a number >= 0, e.g. "
                                 f"0.1) or None for no bound.")
            if not self.staleness_meter:
                raise ValueError("max_staleness needs the drift the staleness meter measures: set "
                                 "staleness_meter=True, or bound the age with max_age instead.")
        if self.halo_exchange not in ("all_to_all", "ring"):
            raise ValueError(f"halo_exchange={self.halo_exchange!r} must be 'all_to_all' (every way sends every "
                             f"other way the rows it reads) or 'ring' (rows pass hop by hop between neighbouring "
                             f"ways).")
        if self.smoothing is not None and (isinstance(self.smoothing, bool)
                                           or not isinstance(self.smoothing, (int, float))
                                           or not 0.0 <= self.smoothing < 1.0):
            raise ValueError(f"smoothing={self.smoothing!r} must be a momentum in [0, 1) (e.g. 0.5: stale rows read as "
                             f"the average of the steps' rows, halving each step) or None to read the last rows.")
        if not isinstance(self.late_gradients, bool):
            raise ValueError(f"late_gradients={self.late_gradients!r} must be True (stale reads' gradients reach their "
                             f"owners one step late) or False (dropped; T3 scales the fresh ones).")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs={self.cuda_graphs!r} must be True (capture the streamed step on one CUDA "
                             f"device) or False.")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap={self.overlap!r} must be True (post the next chunk's receives before "
                             f"computing the current one) or False.")
        if self.streaming not in (True, False, "auto"):
            raise ValueError(f"streaming={self.streaming!r} must be True, False or 'auto' (stream on one device "
                             f"with several chunks or an offload tier).")
        if self.offload not in (None, "host", "disk"):
            raise ValueError(f"offload={self.offload!r} must be None (history on the device), 'host' or 'disk'.")
        if not (self.offload_budget in (None, "auto") or (isinstance(self.offload_budget, int)
                                                          and not isinstance(self.offload_budget, bool)
                                                          and self.offload_budget >= 0)):
            raise ValueError(f"offload_budget={self.offload_budget!r} must be a number of bytes (>= 0), 'auto' (half "
                             f"the free memory) or None (offload every buffer).")
        if self.offload_dir is not None and not os.path.isdir(self.offload_dir):
            raise ValueError(f"offload_dir={self.offload_dir!r} is not an existing directory; create it or pass "
                             f"None for a temporary one.")
        from ..graph.partition import PARTITION_METHODS
        if not callable(self.partition) and self.partition not in PARTITION_METHODS:
            raise ValueError(f"partition={self.partition!r} must be one of {', '.join(PARTITION_METHODS)} or a "
                             f"callable (edge_index, num_nodes, num_chunks) -> (perm, ptr).")
        if isinstance(self.balance, str) and self.balance not in ("time", "layers"):
            raise ValueError(f"balance={self.balance!r} must be 'time', 'layers' or a list of layers per stage.")
        for name, point in (self.split_points or {}).items():
            if not isinstance(point, SplitPoint):
                raise ValueError(f"split_points={{{name!r}: {point!r}}}: use SplitPoint.BEGINNING or SplitPoint.END "
                                 f"(from pyg_pipe or torch.distributed.pipelining).")
