"""The execution engine: the schedule, history, halo exchange, stage link and the layer hooks.

One concept per module (see ``docs/architecture.md``):

================== ==============================================================================
``engine.py``      the facade the strategies call: plan, fill / drain, exact passes
``plan.py``        decisions made once per graph and model (grid, chunking, split), and resume
``grid.py``        the rank grid: S stages x W ways
``schedule.py``    the clock table and the one definition of fresh / stale
``history.py``     historical embeddings per call site, snapshots, pending cross-chunk gradients
``halo.py``        halo rows at a call site: exchange among ways, reads from history, gradient routing
``link.py``        values crossing a stage cut, per chunk, and their gradients
``layers.py``      hooks that run unchanged PyG layers on a chunk's local graph
``statistics.py``  BatchNorm and other graph-wide statistics over all ways
``rows.py``        operations combining vertex rows outside layers: found on the first pass, refused
``program.py``     what a stage runs: the user's forward, or its part of a traced program
``comm.py``        counted, failure-aware transport
``formulas.py``    the bytes each mode should send
================== ==============================================================================
"""
from .comm import CATEGORIES, Comm, RemoteRankError
from .engine import GNNPipeEngine, sync_module_state
from .formulas import gnnpipe_bytes, graph_parallel_bytes, halo_rows
from .plan import PipelineConfig

__all__ = ["Comm", "CATEGORIES", "RemoteRankError", "GNNPipeEngine", "PipelineConfig", "sync_module_state",
           "gnnpipe_bytes", "graph_parallel_bytes", "halo_rows"]
