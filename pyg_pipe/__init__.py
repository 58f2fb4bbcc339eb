"""pyg_pipe: pipelined full-graph training of unchanged PyTorch Geometric models across many devices.

``import pyg_pipe`` registers the Lightning strategies, so ``Trainer(strategy="gnnpipe")``,
``"graph_parallel"`` and ``"gnnpipe_hybrid"`` work.
"""
from lightning.pytorch.strategies import StrategyRegistry

from .data import FullGraphDataModule
from .engine import GNNPipeEngine, PipelineConfig
from .model import SplitPoint, UnsupportedModelError, pipe_split
from .strategies import GNNPipeStrategy, GraphParallelStrategy, HybridStrategy

for _cls in (GNNPipeStrategy, HybridStrategy, GraphParallelStrategy):
    _cls.register_strategies(StrategyRegistry)

__version__ = "0.1.0"
__all__ = ["FullGraphDataModule", "GNNPipeEngine", "GNNPipeStrategy", "GraphParallelStrategy", "HybridStrategy",
           "PipelineConfig", "SplitPoint", "UnsupportedModelError", "pipe_split"]
