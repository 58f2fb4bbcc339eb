"""``strategy="graph_parallel"`` and ``strategy="gnnpipe_hybrid"``: partition-parallel and hybrid
(pipeline stages x graph-parallel ways) full-graph training (see docs/graph_parallel.md).

Both run on the engine's rank grid (:mod:`pyg_pipe.engine.plan.grid`): ``S`` stages x ``W`` ways, rank
``s·W + w``. Graph parallelism is one stage (``S = 1``, ``W = P``) with one chunk per way: every
process owns one partition of the vertices, exchanges the rows of its boundary vertices with the
other partitions at every layer, forward and backward, and all-reduces weight gradients once per
step. It is exact. Hybrid adds pipeline stages, each replicated over ``W`` ways.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from ..engine.plan.grid import check_chunks_per_way
from .gnnpipe import GNNPipeStrategy


class HybridStrategy(GNNPipeStrategy):
    """``stages`` pipeline stages x ``ways`` graph-parallel ways (``stages · ways`` = devices).

    Each stage's layers run on ``ways`` processes, each owning a partition of the vertices cut into
    ``num_chunks / ways`` chunks that flow through the stages as in GNNPipe; at every layer the ways
    exchange the rows other ways read, and weight gradients are summed over the ways of a stage.
    Use it when the model has fewer layers than there are devices, or when one stage's full-graph
    buffers do not fit a device.

    .. code-block:: python

        trainer = L.Trainer(strategy=pyg_pipe.HybridStrategy(stages=2, ways=2, num_chunks=4), devices=4)
        trainer = L.Trainer(strategy="gnnpipe_hybrid", devices=8)   # ways chosen from the model depth

    Args:
        stages: pipeline stages S (``None``: devices / ``ways``).
        ways: graph-parallel ways W per stage (``None``: devices / ``stages``; with both ``None``, the
            fewest ways ``>= 2`` that leave every stage at least one layer).
        num_chunks: chunks in all, a multiple of ``ways``; ``"auto"`` (the default): from a measured cost model
            (:mod:`pyg_pipe.engine.plan.chunk_cost`; ``W`` when S = 1), ``None``: ``4·S`` per way.
            ``num_chunks == ways`` is exact: no historical embeddings, no pipeline overlap.
        **kwargs: as for :class:`~pyg_pipe.GNNPipeStrategy`.
    """

    strategy_name = "gnnpipe_hybrid"

    def __init__(self, stages: Optional[int] = None, ways: Optional[int] = None,
                 num_chunks: Optional[Union[int, str]] = "auto",
                 **kwargs: Any) -> None:
        for name, value in (("stages", stages), ("ways", ways)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer (or None to derive it from the "
                                 f"devices).")
        grid = kwargs.pop("grid", "pipeline")
        if grid != "pipeline":
            raise ValueError(f"grid={grid!r}: {type(self).__name__} fixes the grid (stages=, ways=); "
                             f"pass grid='auto' to pyg_pipe.GNNPipeStrategy to have stages x ways chosen.")
        super().__init__(num_chunks=num_chunks, grid="pipeline", **kwargs)
        if ways is not None and isinstance(num_chunks, int):
            check_chunks_per_way(num_chunks, ways)
        self.stages, self.ways = stages, ways

    def _grid(self):
        return self.stages, self.ways, 2

    def _configure_launcher(self) -> None:
        # the device count is known here, in the main process: refuse a bad grid before any process starts
        P = self.num_nodes * self.num_processes
        S, W, _ = self._grid()
        if S is not None and W is not None and S * W != P:
            raise ValueError(f"{type(self).__name__}(stages={S}, ways={W}) needs stages x ways = {S * W} devices, but "
                             f"the Trainer runs {P} (devices x num_nodes); make stages x ways equal the device count.")
        for name, v in (("stages", S), ("ways", W)):
            if v is not None and P % v:
                raise ValueError(f"{type(self).__name__}: {name}={v} does not divide the {P} devices; choose a "
                                 f"divisor of the device count.")
        chunks = self.config.chunks_given if isinstance(self.config.num_chunks, int) else None  # else: the plan's
        if W is not None and chunks is not None:
            check_chunks_per_way(chunks, W)
        if W is None and S is not None:
            W = P // S
        several = chunks > W if chunks is not None and W is not None else S is not None and S > 1  # default: 4·S a way
        if self.config.late_gradients and W is not None and W > 1 and several:
            raise ValueError(f"{type(self).__name__}(ways={W}): late_gradients=True is built for one way per stage "
                             f"(the stale reads of other ways' rows would need their gradients sent next step). Use "
                             f"GNNPipeStrategy, or late_gradients=False.")
        super()._configure_launcher()


class GraphParallelStrategy(HybridStrategy):
    """Exact partition-parallel full-graph training: the baseline GNNPipe is measured against.

    Every process owns one partition of the vertices (METIS via ``pymetis`` when installed, else a
    locality-preserving greedy partitioner; see ``partition``). At every message-passing layer,
    forward and backward, partitions exchange the rows of their boundary (halo) vertices; weight
    gradients are all-reduced once per step. Degree-completing edges keep GCN normalisation, mean
    aggregation and attention softmax global, so results equal single-device PyG.

    .. code-block:: python

        trainer = L.Trainer(strategy="graph_parallel", accelerator="gpu", devices=8)

    Args:
        partition: ``"auto"``, ``"metis"``, ``"greedy"``, ``"random"``, ``"contiguous"`` or a callable
            ``(edge_index, num_nodes, parts) -> (perm, ptr)`` (see :class:`~pyg_pipe.GNNPipeStrategy`).
        seed: partitioner seed.
        **kwargs: ``model``, ``comm_timeout`` and the DDP arguments of :class:`~pyg_pipe.GNNPipeStrategy`.
    """

    strategy_name = "graph_parallel"

    def __init__(self, partition: Any = "auto", seed: int = 0, **kwargs: Any) -> None:
        for name in ("num_chunks", "stages", "ways", "shuffle_chunks", "snapshot_period", "unbiased_gradients",
                     "balance"):
            if name in kwargs:
                raise TypeError(f"GraphParallelStrategy does not take `{name}`: it always runs one partition per "
                                f"device. Use pyg_pipe.HybridStrategy to combine it with pipeline stages.")
        super().__init__(stages=1, ways=None, num_chunks=None, shuffle_chunks=False, snapshot_period=None,
                         unbiased_gradients=False, partition=partition, seed=seed, **kwargs)
