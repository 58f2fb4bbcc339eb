"""pyg_pipe: pipelined full-graph training of unchanged PyTorch Geometric models across many devices.

``import pyg_pipe`` registers the Lightning strategies, so ``Trainer(strategy="gnnpipe")``,
``"graph_parallel"`` and ``"gnnpipe_hybrid"`` work.
"""
import warnings

from lightning.pytorch.strategies import StrategyRegistry

from .data import FullGraphDataModule
from .engine import GNNPipeEngine, PipelineConfig
from .model import SplitPoint, UnsupportedModelError, pipe_split
from .strategies import GNNPipeStrategy, GraphParallelStrategy, HybridStrategy

# Lightning 2.6 builds a pytree LeafSpec, which torch 2.13 deprecates, each time it moves a batch: a warning the
# user can do nothing about, printed several times a run. Only that message is silenced.
warnings.filterwarnings("ignore", message=r".*isinstance.treespec, LeafSpec.. is deprecated", category=FutureWarning)

for _cls in (GNNPipeStrategy, HybridStrategy, GraphParallelStrategy):
    _cls.register_strategies(StrategyRegistry)

__version__ = "0.1.0"
__all__ = ["FullGraphDataModule", "GNNPipeEngine", "GNNPipeStrategy", "GraphParallelStrategy", "HybridStrategy",
           "PipelineConfig", "SplitPoint", "UnsupportedModelError", "pipe_split"]
