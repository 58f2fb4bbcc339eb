"""Lightning strategies: how users choose a parallel mode with ``Trainer(strategy=...)``."""
from .gnnpipe import GNNPipeStrategy
from .hybrid import GraphParallelStrategy, HybridStrategy

__all__ = ["GNNPipeStrategy", "GraphParallelStrategy", "HybridStrategy"]
