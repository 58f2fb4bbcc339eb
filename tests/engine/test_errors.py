"""Bad input is refused before training, identically on every rank, with the problem and the fix named."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch_geometric.data import Batch, Data
from torch_geometric.nn import GCN, GCNConv, SAGEConv
from torch_geometric.utils import add_self_loops, to_undirected

from pyg_pipe import GNNPipeStrategy, UnsupportedModelError
from pyg_pipe.engine import Comm, CommFailure, GNNPipeEngine, PipelineConfig
from pyg_pipe.engine.context import current
from pyg_pipe.strategies.batch import check_batch
from tests.dist import run_distributed
from tests.models import small_graph


def run_single(model, chunks=1, **cfg):
    """One process, one stage, one way: the engine on its own."""
    x, edge_index, y, mask = small_graph()
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, **cfg), Comm(torch.device("cpu")), num_stages=1)
    engine.install()
    try:
        return model(x, edge_index)
    finally:
        engine.uninstall()


@pytest.mark.parametrize("chunks", [0, -1])
def test_chunks_below_one(chunks):
    with pytest.raises(ValueError, match="num_chunks"):
        PipelineConfig(num_chunks=chunks).validate()
    with pytest.raises(ValueError, match="num_chunks"):
        GNNPipeStrategy(num_chunks=chunks)


def test_unknown_options_fail_at_construction():
    with pytest.raises(ValueError, match="partition='kmeans' must be one of"):
        GNNPipeStrategy(partition="kmeans")
    with pytest.raises(ValueError, match="balance='fast'"):
        GNNPipeStrategy(balance="fast")
    with pytest.raises(ValueError, match="snapshot_period=0"):
        GNNPipeStrategy(snapshot_period=0)
    with pytest.raises(ValueError, match="SplitPoint.BEGINNING"):
        GNNPipeStrategy(split_points={"convs.1": "beginning"})


def test_more_chunks_than_nodes():
    with pytest.raises(ValueError, match=r"num_chunks=61 is larger than the number of vertices \(60\)"):
        run_single(GCN(8, 16, 2, 3), chunks=61)


class SelfLoops(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = GCNConv(8, 3)

    def forward(self, x, edge_index):
        edge_index = torch.cat([edge_index, edge_index.flip(0)], 1)
        return self.conv(x, edge_index)


def test_graph_built_inside_forward_names_the_layer_and_the_fix():
    with pytest.raises(UnsupportedModelError, match=r"Layer 'conv' \(GCNConv\) receives a graph computed inside "
                                                    r"forward.*in the data pipeline.*another graph passed to forward"):
        run_single(SelfLoops())


class TrainingLabels(nn.Module):
    """Takes the labels of the training vertices alone beside a per-vertex mask, as PyG's ``CorrectAndSmooth.correct``
    does (``y_true`` has ``mask.sum()`` rows), and checks them against each other."""

    def __init__(self):
        super().__init__()
        self.conv = SAGEConv(8, 3)

    def forward(self, x, edge_index, y_train, mask):
        out = self.conv(x, edge_index)
        assert y_train.size(0) == int(mask.sum())
        return out


def test_an_error_on_part_of_the_graph_says_what_is_cut():
    """The first pass over part of the graph raises (the mask is cut, the training labels are not): the error names
    the method, what is cut and the way out, with the original error as its cause."""
    x, edge_index, y, mask = small_graph()
    model = TrainingLabels()
    model(x, edge_index, y[mask], mask)  # whole: fine
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=4), Comm(torch.device("cpu")), num_stages=1)
    engine.install()
    try:
        with pytest.raises(UnsupportedModelError, match=r"(?s)TrainingLabels.forward raised AssertionError.* on its "
                                                        r"first pass over part of the graph. With num_chunks=4.*"
                                                        r"y\[train_mask\].*one device") as info:
            model(x, edge_index, y[mask], mask)
        assert isinstance(info.value.__cause__, AssertionError)
    finally:
        engine.uninstall()


def _stuck_peer(rank, world):
    """Rank 1 stalls in its first pass (before its first layer), rank 0 waits for its halo rows and times out."""
    store = dist.distributed_c10d._get_default_store()
    x, edge_index, y, mask = small_graph()
    torch.manual_seed(0)
    model = GCN(8, 16, 2, 3)
    stalled = []

    def stall(module, args):
        if current() is not None and not stalled:  # (inside the pass, not in planning)
            stalled.append(True)
            store.wait(["test/released"])
    if rank == 1:
        model.convs[0].register_forward_pre_hook(stall)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=2), Comm(torch.device("cpu"), timeout=3),
                           num_stages=1, ways=2)
    engine.install()
    try:
        with pytest.raises(CommFailure, match="Another rank (is stuck or died|stopped)") as info:
            model(x, edge_index)
        assert not isinstance(info.value, UnsupportedModelError)
    finally:
        engine.uninstall()
        if rank == 0:
            store.set("test/released", "1")
            store.wait(["test/done"])  # (rank 0 hosts the store: it outlives rank 1's wait in it)
        else:
            store.set("test/done", "1")


def test_a_silent_peer_in_the_first_pass_is_not_blamed_on_the_model():
    """The first pass over part of the graph wraps the model's own errors (above), not the transport's: a peer that
    stops answering there is the wait's error as it is, on both ranks."""
    run_distributed(_stuck_peer, 2, timeout=90)


def test_a_float_edge_index_is_named():
    x, edge_index, y, mask = small_graph()
    engine = GNNPipeEngine(GCN(8, 16, 2, 3), PipelineConfig(num_chunks=1), Comm(torch.device("cpu")), num_stages=1)
    engine.install()
    try:
        with pytest.raises(UnsupportedModelError, match=r"argument 1 of shape \(2, \d+\) and dtype torch.float32.*"
                                                        r"edge_index.long\(\)"):
            engine.module(x, edge_index.float())
        with pytest.raises(UnsupportedModelError, match=r"data.edge_index of shape .*edge_index.long\(\)"):
            engine.module.forward(Data(x=x, edge_index=edge_index.float()))
    finally:
        engine.uninstall()


def test_batches_that_are_not_one_graph():
    x, edge_index, y, mask = small_graph()
    data = Data(x=x, edge_index=edge_index, y=y)
    check_batch(data)
    check_batch(Batch.from_data_list([data]))
    with pytest.raises(ValueError, match="Batch of 2 graphs.*FullGraphDataModule"):
        check_batch(Batch.from_data_list([data, data]))
    with pytest.raises(TypeError, match="yielded a list, not a Data"):
        check_batch([x, edge_index])


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x, edge_index):
        return self.lin(x)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = SAGEConv(8, 8), SAGEConv(8, 3)

    def forward(self, x, edge_index):
        x = self.a(x, edge_index)
        if x.sum() > 0:  # control flow on tensor values at the top level: cannot be cut into stages
            x = x.relu()
        return self.b(x, edge_index)


class GraphInForward(nn.Module):
    """Computes the graph its layers take inside forward with one of PyG's utilities."""

    def __init__(self, utility):
        super().__init__()
        self.utility = utility
        self.a, self.b = SAGEConv(8, 8), SAGEConv(8, 3)

    def forward(self, x, edge_index):
        if self.utility == "to_undirected":
            edge_index = to_undirected(edge_index, num_nodes=x.size(0))
        elif self.utility == "add_self_loops":
            edge_index, _ = add_self_loops(edge_index, num_nodes=x.size(0))
        else:  # a random graph drawn by hand (DropEdge by PyG's dropout_edge runs: test_dropedge.py)
            edge_index = edge_index[:, torch.rand(edge_index.size(1)) >= 0.2]
        return self.b(self.a(x, edge_index).relu(), edge_index)


CASES = {
    "too_few_layers": (lambda: GCN(8, 16, 1, 3),
                       r"1 message-passing layers but the pipeline has 2 stages.*gnnpipe_hybrid"),
    "no_message_passing": (MLP, "calls no MessagePassing layer"),
    "untraceable": (DataDependent, "cannot split DataDependent into pipeline stages.*graph_parallel"),
    # a graph computed in forward: the utility and the fix that works named, whether fx traces it or not
    "to_undirected": (lambda: GraphInForward("to_undirected"),
                      r"computes a graph with torch_geometric.utils.to_undirected.*T.ToUndirected"),
    "add_self_loops": (lambda: GraphInForward("add_self_loops"),
                       r"graph computed inside forward.*T.AddSelfLoops\(\).*data.edge_index2"),
    "random_graph": (lambda: GraphInForward("random"), r"graph computed inside forward.*drawn at random"),
}


def _refusals(rank, world):
    x, edge_index, y, mask = small_graph()
    for name, (make, pattern) in CASES.items():
        model = make()
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=1), Comm(torch.device("cpu"), timeout=30),
                               num_stages=2, ways=1)
        engine.install()
        with pytest.raises(UnsupportedModelError, match=pattern):
            model(x, edge_index)
        engine.uninstall()


def test_pipeline_refusals_on_every_rank():
    """Two stages requested explicitly: each case fails on both ranks with the same message, no hang."""
    run_distributed(_refusals, 2, timeout=120)


def _same_graph_worker(rank, world):
    from pyg_pipe.strategies import batch as batch_module
    from tests.models import as_data
    digests = []
    fingerprint = batch_module.fingerprint
    batch_module.fingerprint = lambda t: digests.append(1) or fingerprint(t)
    try:
        loaded, check = as_data(*small_graph(seed=0)), batch_module.SameGraph()
        tensors = sum(isinstance(v, torch.Tensor) for _, v in loaded.items())
        for _ in range(3):  # the loader's graph, and a new copy of it each step (as a GPU gets it from Lightning)
            check.check(loaded, Comm(torch.device("cpu")), loaded.clone())
        assert len(digests) == tensors, f"rank {rank}: {len(digests)} digests for {tensors} tensors in 3 steps"
        loaded.x.mul_(1.0)  # the loaded graph changed in place: compared again
        check.check(loaded, Comm(torch.device("cpu")), loaded.clone())
        assert len(digests) == 2 * tensors
    finally:
        batch_module.fingerprint = fingerprint


def test_every_rank_loaded_the_same_graph_is_checked_once_not_every_step():
    """The check that every rank loaded the same graph digests it when the loader hands out another graph (or the
    same one changed), not at every step's copy to the device (on a GPU a pass over the whole graph, every
    step)."""
    run_distributed(_same_graph_worker, 2, timeout=120)
