"""The execution engine, in three lifetimes, each a folder:

``plan/``     decided once per graph and model, agreed by every rank, saved in checkpoints
``runtime/``  built at once from a plan on each rank, lives as long as it
``step/``     one pass over this rank's chunks, and the hooks that run PyG's layers on a chunk

on a floor that imports nothing above it (``comm.py`` the transport, ``context.py`` what the hooks see while
a chunk runs, ``config.py`` the knobs, ``tree.py``, ``reroute.py``), with ``engine.py`` (the facade the
strategies call) and ``profile.py`` (the cost model of ``balance="time"``) on top. The module map, and how
one training step flows through it, is in ``docs/architecture.md``.
"""
from .comm import CATEGORIES, Comm, CommFailure, RemoteRankError
from .config import PipelineConfig
from .engine import GNNPipeEngine
from .plan.formulas import gnnpipe_bytes, graph_parallel_bytes, halo_rows, ring_halo_bytes, ring_halo_rows
from .plan.shape import refuse_graph_builders
from .runtime.weights import sync_module_state

__all__ = ["Comm", "CATEGORIES", "CommFailure", "RemoteRankError", "GNNPipeEngine", "PipelineConfig",
           "refuse_graph_builders", "sync_module_state", "gnnpipe_bytes", "graph_parallel_bytes", "halo_rows",
           "ring_halo_rows", "ring_halo_bytes"]
