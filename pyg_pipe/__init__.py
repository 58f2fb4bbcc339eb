"""pyg_pipe: pipelined full-graph training of unchanged PyTorch Geometric models across many devices.

``import pyg_pipe`` registers the Lightning strategies, so ``Trainer(strategy="gnnpipe")``,
``"graph_parallel"`` and ``"gnnpipe_hybrid"`` work.
"""
import logging
import warnings

from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.strategies import StrategyRegistry

from .data import FullGraphDataModule
from .engine import GNNPipeEngine, PipelineConfig
from .engine.step.rowwise import declare_row_wise
from .model import SplitPoint, UnsupportedModelError, pipe_split
from .strategies import GNNPipeStrategy, GraphParallelStrategy, HybridStrategy

# Lightning 2.6 builds a pytree LeafSpec, which torch 2.13 deprecates, each time it moves a batch: a warning the
# user can do nothing about, printed several times a run. Only that message is silenced.
warnings.filterwarnings("ignore", message=r".*isinstance.treespec, LeafSpec.. is deprecated", category=FutureWarning)

for _cls in (GNNPipeStrategy, HybridStrategy, GraphParallelStrategy):
    _cls.register_strategies(StrategyRegistry)


class _RankZero(logging.Filter):
    """Passes the records of global rank 0 (Lightning's ``rank_zero_only.rank``, set by the strategy), and
    warnings from every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or getattr(rank_zero_only, "rank", 0) == 0


# What pyg_pipe decides on its own (the chunk count, recomputation, graph-parallel ways, historical statistics:
# one line each, on the logger "pyg_pipe") is shown as Lightning shows its own messages: on rank 0 at INFO,
# warnings on every rank, unless the program configured logging itself (then its handlers decide). Every
# rank's lines are also in ``strategy.notes``; ``logging.getLogger("pyg_pipe").setLevel(logging.WARNING)``
# quiets them.
_logger = logging.getLogger(__name__)
if not logging.getLogger().hasHandlers() and _logger.level == logging.NOTSET:
    _handler = logging.StreamHandler()
    _handler.addFilter(_RankZero())
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
    _logger.propagate = False

__version__ = "0.1.0"
__all__ = ["declare_row_wise", "FullGraphDataModule", "GNNPipeEngine", "GNNPipeStrategy", "GraphParallelStrategy",
           "HybridStrategy", "PipelineConfig", "SplitPoint", "UnsupportedModelError", "pipe_split"]
