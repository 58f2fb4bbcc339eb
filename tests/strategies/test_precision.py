"""Mixed precision through a real Trainer: ``precision="bf16-mixed"`` (Lightning's autocast on the CPU here) trains
under ``graph_parallel`` and ``gnnpipe`` as one process does under the same precision, and the drain's recomputations
(``recompute=True``) run under the autocast the fill ran under, so they give what keeping the activations gives."""
import lightning.pytorch as pl
import pytest
import torch
from torch_geometric.nn import GCN

from pyg_pipe import GNNPipeStrategy, GraphParallelStrategy
from tests.lit import NodeClassifier, graph_loader
from tests.models import as_data, small_graph


def _train(strategy, devices, precision="bf16-mixed"):
    data = as_data(*small_graph())
    torch.manual_seed(0)
    lit = NodeClassifier(GCN(8, 16, 3, 3))
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=4, precision=precision, logger=False,
               enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False).fit(lit, train_dataloaders=graph_loader(data))
    return torch.cat([p.detach().flatten() for p in lit.parameters()])


@pytest.fixture(scope="module")
def one_process():
    return _train("auto", 1)


@pytest.mark.parametrize("name", ["graph_parallel", "gnnpipe"])
def test_bf16_mixed_trains_as_one_process(name, one_process):
    if name == "graph_parallel":  # rows summed in another order, rounded to bf16: within its precision
        got, atol = _train(GraphParallelStrategy(start_method="spawn", comm_timeout=60), 2), 1e-3
    else:  # one chunk through 2 stages: the same operations on the same rows
        got, atol = _train(GNNPipeStrategy(start_method="spawn", comm_timeout=60, num_chunks=1), 2), 1e-5
    torch.testing.assert_close(got, one_process, atol=atol, rtol=0)


def test_bf16_mixed_recomputation_runs_under_the_fills_autocast():
    kept = _train(GNNPipeStrategy(start_method="spawn", comm_timeout=60, num_chunks=4, recompute=False), 2)
    again = _train(GNNPipeStrategy(start_method="spawn", comm_timeout=60, num_chunks=4, recompute=True), 2)
    torch.testing.assert_close(again, kept, atol=0, rtol=0)
