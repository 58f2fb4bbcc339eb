"""Modules whose output at a vertex depends on the rows of all vertices: graph-wide statistics.

BatchNorm (mean and variance over the rows), InstanceNorm, GraphNorm, PairNorm, PyG's ``LayerNorm``
in graph mode, ... A chunk holds only its own rows, so the engine computes these statistics itself
(:mod:`pyg_pipe.engine.runtime.statistics`), and the tracer keeps each such module whole
(:mod:`pyg_pipe.model.trace`).
"""
from __future__ import annotations

import torch

BATCH_NORM = torch.nn.modules.batchnorm._BatchNorm


def graph_wide_modules() -> tuple:
    """Module classes other than BatchNorm whose output at a vertex depends on all vertices' rows. (Not torch's
    ``InstanceNorm1d`` / ``2d`` / ``3d``: on vertex rows, ``(N, C, L)`` or ``(N, F)``, each vertex is normalised
    over its own values, so the row check judges each call (:func:`needs_statistics`).)"""
    from torch_geometric.nn import norm as pyg_norm
    classes = []
    # (not DiffGroupNorm: per row but for the BatchNorm inside it, which is one of these modules itself)
    for name in ("InstanceNorm", "GraphNorm", "PairNorm", "MeanSubtractionNorm", "GraphSizeNorm"):
        cls = getattr(pyg_norm, name, None)
        if cls is not None:
            classes.append(cls)
    return tuple(classes)


def needs_statistics(module: torch.nn.Module) -> bool:
    """True for modules computing statistics over vertices (in the mode they are in)."""
    from torch_geometric.nn import LayerNorm as PygLayerNorm
    if isinstance(module, BATCH_NORM):
        return True
    if isinstance(module, PygLayerNorm):
        return module.mode != "node"
    if isinstance(module, torch.nn.modules.instancenorm._InstanceNorm) and \
            not isinstance(module, graph_wide_modules()):  # torch's: its running statistics average the instances
        return module.track_running_stats
    return isinstance(module, graph_wide_modules())


def takes_historical_statistics(module: torch.nn.Module) -> bool:
    """Whether ``per_chunk_statistics="history"`` covers the module: its output is a function of its rows and of
    the whole graph's per-feature sums ``Σ x``, ``Σ x²`` and row count (BatchNorm, PyG's BatchNorm, GraphNorm,
    InstanceNorm, graph-mode LayerNorm, PairNorm, MeanSubtractionNorm, GraphSizeNorm; on one graph, no batch
    vector)."""
    from torch_geometric.nn import BatchNorm as PygBatchNorm
    from torch_geometric.nn import (GraphNorm, GraphSizeNorm, InstanceNorm, LayerNorm, MeanSubtractionNorm,
                                    PairNorm)
    if isinstance(module, LayerNorm):
        return module.mode == "graph"
    return isinstance(module, (BATCH_NORM, PygBatchNorm, GraphNorm, InstanceNorm, PairNorm, MeanSubtractionNorm,
                               GraphSizeNorm))
