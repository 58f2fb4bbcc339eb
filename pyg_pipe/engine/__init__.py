"""The execution engine: plan, runtime and step, and the concepts they are built from.

The module map, and how one training step flows through it, is in ``docs/architecture.md``.
"""
from .comm import CATEGORIES, Comm, RemoteRankError
from .config import PipelineConfig
from .engine import GNNPipeEngine
from .formulas import gnnpipe_bytes, graph_parallel_bytes, halo_rows, ring_halo_bytes, ring_halo_rows
from .plan import refuse_graph_builders
from .weights import sync_module_state

__all__ = ["Comm", "CATEGORIES", "RemoteRankError", "GNNPipeEngine", "PipelineConfig", "refuse_graph_builders",
           "sync_module_state", "gnnpipe_bytes", "graph_parallel_bytes", "halo_rows", "ring_halo_rows",
           "ring_halo_bytes"]
