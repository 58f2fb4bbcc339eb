"""Graph-wide norms (BatchNorm, GraphNorm, graph-mode LayerNorm, ...) when a way runs several chunks: which run
with historical statistics, which per chunk, which are refused before training (``per_chunk_statistics``; the
statistics themselves are :mod:`..runtime.statistics` and :mod:`..step.norms`)."""
from __future__ import annotations

import logging
from typing import List, Optional, Union

import torch

from ...model.errors import UnsupportedModelError
from ...model.norms import needs_statistics, takes_historical_statistics

log = logging.getLogger("pyg_pipe")


def resolve_statistics(setting: Union[bool, str], module: torch.nn.Module, chunks_per_way: int, streaming: bool,
                       notes: Optional[List[str]] = None) -> Union[bool, str]:
    """``per_chunk_statistics="auto"`` (the default): with several chunks per way in the pipeline, BatchNorm and
    GraphNorm on vertex rows take historical statistics (``"history"``: measured within 0.1 point of one
    process, docs/convergence.md), told in one line; anything else is as ``False`` (refused before training,
    naming the choices). A BatchNorm inside a message-passing layer is included: on the vertex rows the layer
    computes (GIN's MLP after aggregation, GENConv's) it takes historical statistics; one in the layer's message
    function normalises over edges, which history does not cover, and is refused by name when the layer first
    runs, on every rank (:mod:`..step.norms`); so is a GraphNorm there."""
    if setting != "auto":
        return setting
    if chunks_per_way == 1 or streaming:
        return False
    norms = [name for name, m in module.named_modules() if needs_statistics(m)]
    covered = [name for name, m in module.named_modules() if takes_historical_statistics(m)]
    if not norms or not set(norms) <= set(covered):
        return False
    named = ", ".join(f"'{n}'" for n in norms[:3]) + (", ..." if len(norms) > 3 else "")
    note = (f"pyg_pipe: graph-wide norms ({named}) with {chunks_per_way} chunks per way: the whole graph's "
            f"statistics with other chunks' sums from their latest run "
            f"(per_chunk_statistics='history'; pass num_chunks equal to the ways for exact statistics, or "
            f"per_chunk_statistics=False to refuse).")
    log.info(note)
    if notes is not None and note not in notes:
        notes.append(note)
    return "history"


def refuse_statistics(module: torch.nn.Module, chunks_per_way: int, ways: int, history: bool = False,
                      streaming: bool = False) -> None:
    """Refuses graph-wide statistics when a way runs several chunks (the pipeline never holds all rows).

    ``history`` (``per_chunk_statistics="history"``): the norms computed from per-feature sums
    (:func:`~pyg_pipe.model.norms.takes_historical_statistics`) run with historical sums
    (:mod:`..runtime.statistics`), except when streaming; every other graph-wide module is still refused."""
    for name, m in module.named_modules():
        if not needs_statistics(m):
            continue
        if history and takes_historical_statistics(m):
            if streaming:
                raise UnsupportedModelError(
                    f"Module '{name}' ({type(m).__name__}): per_chunk_statistics='history' runs in the pipeline "
                    f"schedule, not in NGra streaming on one device. Pass streaming=False (or "
                    f"per_chunk_statistics=True for each chunk's own statistics).")
            continue
        if history:
            raise UnsupportedModelError(
                f"Module '{name}' ({type(m).__name__}) normalises with statistics over all vertices; "
                f"per_chunk_statistics='history' covers BatchNorm, GraphNorm, InstanceNorm, graph-mode LayerNorm, "
                f"PairNorm, MeanSubtractionNorm and GraphSizeNorm. Use per_chunk_statistics=True "
                f"(each chunk's own rows, approximate), num_chunks={ways} (exact; one chunk per way) or a per-vertex "
                f"norm (torch.nn.LayerNorm, torch_geometric.nn.LayerNorm(mode='node')).")
        raise UnsupportedModelError(
            f"Module '{name}' ({type(m).__name__}) normalises with statistics over all vertices, but with "
            f"{chunks_per_way} chunks per way the pipeline never holds all vertices at once. Use "
            f"num_chunks={ways} (exact; one chunk per way), opt into per-chunk statistics "
            f"(per_chunk_statistics=True, approximate, as GPipe does for micro-batches; for norms computed from "
            f"sums, such as BatchNorm, per_chunk_statistics='history', the whole graph's with other chunks' sums from "
            f"their latest run), or a per-vertex norm (torch.nn.LayerNorm, torch_geometric.nn.LayerNorm(mode='node')).")
