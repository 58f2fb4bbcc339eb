"""The execution engine: chunked graphs, the GNNPipe schedule, and counted communication."""
from .chunks import Chunk, ChunkedGraph
from .comm import CATEGORIES, Comm, RemoteRankError, gnnpipe_bytes, graph_parallel_bytes, halo_rows
from .pipeline import GNNPipeEngine, PipelineConfig, sync_module_state

__all__ = ["Chunk", "ChunkedGraph", "Comm", "CATEGORIES", "RemoteRankError", "GNNPipeEngine", "PipelineConfig",
           "sync_module_state", "gnnpipe_bytes", "graph_parallel_bytes", "halo_rows"]
