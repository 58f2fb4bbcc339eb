"""Bad input through a real Trainer: every rank stops with the original error, nothing hangs."""
import time

import lightning.pytorch as pl
import pytest
from torch_geometric.loader import DataLoader as PygDataLoader
from torch_geometric.nn import GCN

from pyg_pipe import GNNPipeStrategy
from tests.lit import NodeClassifier, graph_loader
from tests.models import as_data, make_model, small_graph


def fit(lit, train, devices=2, **kw):
    t = pl.Trainer(strategy=GNNPipeStrategy(start_method="spawn", comm_timeout=60, **kw), accelerator="cpu",
                   devices=devices, max_epochs=2, logger=False, enable_checkpointing=False)
    t.fit(lit, train_dataloaders=train)


@pytest.fixture(scope="module")
def data():
    return as_data(*small_graph())


class PerRankData(pl.LightningDataModule):
    """A data module that (wrongly) builds a different random graph on every rank."""

    def setup(self, stage):
        self.data = as_data(*small_graph(seed=self.trainer.global_rank))

    def train_dataloader(self):
        return graph_loader(self.data)


def test_data_that_differs_between_ranks():
    with pytest.raises(Exception, match=r"graph differs between ranks \(attributes: .*x.*seed"):
        pl.Trainer(strategy=GNNPipeStrategy(start_method="spawn"), accelerator="cpu", devices=2, max_epochs=1,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False).fit(NodeClassifier(make_model("gcn")), datamodule=PerRankData())


def test_nan_loss(data):
    bad = data.clone()
    bad.x = bad.x.clone()
    bad.x[3, 0] = float("nan")
    with pytest.raises(Exception, match="non-finite loss.*gradient_clip_val"):
        fit(NodeClassifier(make_model("gcn")), graph_loader(bad))


def test_loader_with_several_graphs(data):
    with pytest.raises(Exception, match=r"Batch of 2 graphs.*many small graphs.*strategy='ddp'"):
        fit(NodeClassifier(make_model("gcn")), PygDataLoader([data, data], batch_size=2))


def test_a_failing_rank_stops_the_others_quickly(data):
    start = time.monotonic()
    with pytest.raises(Exception, match="boom on rank 1"):
        fit(NodeClassifier(make_model("gcn"), fail_on_rank=1), graph_loader(data), num_chunks=4)
    assert time.monotonic() - start < 60


def test_hybrid_grid_must_match_the_devices():
    from pyg_pipe import GraphParallelStrategy, HybridStrategy
    with pytest.raises(ValueError, match=r"stages x ways = 6 devices, but the Trainer runs 4"):
        pl.Trainer(strategy=HybridStrategy(stages=2, ways=3), accelerator="cpu", devices=4, logger=False)
    with pytest.raises(ValueError, match=r"stages=3 does not divide the 4 devices"):
        pl.Trainer(strategy=HybridStrategy(stages=3), accelerator="cpu", devices=4, logger=False)
    with pytest.raises(ValueError, match=r"num_chunks=3 must be a multiple of the 2 graph-parallel ways"):
        HybridStrategy(ways=2, num_chunks=3)
    with pytest.raises(ValueError, match=r"ways=0 must be a positive integer"):
        HybridStrategy(ways=0)
    with pytest.raises(TypeError, match="does not take `num_chunks`"):
        GraphParallelStrategy(num_chunks=4)
    with pytest.raises(ValueError, match=r"ways=2\): late_gradients=True is built for one way per stage"):
        pl.Trainer(strategy=HybridStrategy(stages=2, ways=2, num_chunks=8, late_gradients=True), accelerator="cpu",
                   devices=4, logger=False)
    # one chunk a way reads nothing stale: accepted
    pl.Trainer(strategy=GraphParallelStrategy(late_gradients=True), accelerator="cpu", devices=4, logger=False)


def test_too_many_stages_is_refused_before_any_worker_starts(data):
    """A grid the model cannot fill fails in the launching process, in a few lines, naming the fix."""
    from pyg_pipe import HybridStrategy
    start = time.monotonic()
    t = pl.Trainer(strategy=HybridStrategy(stages=4, ways=1, start_method="spawn"), accelerator="cpu", devices=4,
                   max_epochs=1, logger=False, enable_checkpointing=False)
    with pytest.raises(Exception, match=r"4 pipeline stages but the model has 2 message-passing layers.*"
                                        r"strategy='gnnpipe'"):
        t.fit(NodeClassifier(GCN(8, 16, 2, 3)), train_dataloaders=graph_loader(data))
    assert time.monotonic() - start < 10  # no process was started


def test_pooling_is_refused_before_any_worker_starts(data):
    from torch_geometric.nn import GraphUNet
    t = pl.Trainer(strategy=GNNPipeStrategy(start_method="spawn"), accelerator="cpu", devices=2, max_epochs=1,
                   logger=False, enable_checkpointing=False)
    with pytest.raises(Exception, match=r"'pools.0' \(TopKPooling\) builds a new graph"):
        t.fit(NodeClassifier(GraphUNet(8, 16, 3, depth=2)), train_dataloaders=graph_loader(data))


def _spawn_trainer():
    return pl.Trainer(strategy=GNNPipeStrategy(start_method="spawn", comm_timeout=60), accelerator="cpu", devices=2,
                      max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)


@pytest.mark.parametrize("case", ["float", "out of range", "pairs", "x rows"])
def test_a_malformed_graph_is_refused_in_the_launching_process(data, case):
    """Raised as itself (not wrapped in a worker's ProcessRaisedException): before any worker started."""
    import pyg_pipe
    bad = data.clone()
    if case == "float":
        bad.edge_index = bad.edge_index.float()
        expected = (TypeError, r"data.edge_index has dtype torch.float32.*data.edge_index.long\(\)")
    elif case == "out of range":
        bad.edge_index = bad.edge_index.clone()
        bad.edge_index[0, 0] = data.num_nodes + 3
        expected = (ValueError, rf"vertex ids from 0 to {data.num_nodes + 3}, but the graph has {data.num_nodes} "
                                rf"vertices \(x's {data.num_nodes} rows\)")
    elif case == "pairs":
        bad.edge_index = bad.edge_index.t().contiguous()
        expected = (ValueError, r"has shape \(\d+, 2\); an edge_index has shape \[2, E\].*\.t\(\)\.contiguous\(\)")
    else:
        bad.num_nodes = data.num_nodes + 1
        expected = (ValueError, rf"data.x has {data.num_nodes} rows but data.num_nodes is {data.num_nodes + 1}")
    with pytest.raises(expected[0], match=expected[1]):
        _spawn_trainer().fit(NodeClassifier(make_model("gcn")), datamodule=pyg_pipe.FullGraphDataModule(bad))


def test_a_heterogeneous_graph_is_named():
    from torch_geometric.data import HeteroData

    import pyg_pipe
    with pytest.raises(TypeError, match="HeteroData: heterogeneous graphs are not supported.*to_homogeneous"):
        pyg_pipe.FullGraphDataModule(HeteroData())
