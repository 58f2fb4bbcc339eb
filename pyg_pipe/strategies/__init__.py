"""Lightning strategies: how users choose a parallel mode with ``Trainer(strategy=...)``."""
from .gnnpipe import GNNPipeStrategy

__all__ = ["GNNPipeStrategy"]
