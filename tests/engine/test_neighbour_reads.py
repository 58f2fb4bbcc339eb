"""A custom layer that reads its neighbours' rows in ``forward``, outside ``propagate``
(``x[edge_index[0]]``): with a cut graph the layer runs on its chunk's rows, and neighbour rows join
them only inside ``propagate``, so such a read would miss them. It is refused on every rank before
training, naming the layer and the fix (it used to fail with an ``IndexError`` on one rank while the
others waited). Where nothing is cut, or the layer is given its true halo rows (one chunk; streaming on
one device), it runs and equals plain PyG. A read at the edges' destinations (``x[edge_index[1]]``, the
chunk's own rows) is not a neighbour read: it runs, and equals plain PyG in every mode (it used to be
refused with the others).

Each mode is one launch running every layer; the modes are :func:`tests.harness.check_mode`'s.
"""
import pytest
import torch
from torch import nn
from torch_geometric.nn import GCNConv, MessagePassing
from torch_geometric.utils import scatter

from tests.dist import run_distributed
from tests.harness import check_mode, three_layers
from tests.zoo import zoo_graph

H = 12


class ReadsBefore(MessagePassing):
    """Adds the mean of its neighbours' rows, gathered by hand before ``propagate``."""

    def __init__(self, i, o):
        super().__init__(aggr="mean")
        self.lin = nn.Linear(i, o)

    def forward(self, x, edge_index):
        x = self.lin(x)
        near = scatter(x[edge_index[0]], edge_index[1], dim=0, dim_size=x.size(0), reduce="mean")
        return self.propagate(edge_index, x=x) + near


class ReadsAfter(MessagePassing):
    """A per-edge score from both ends, computed after ``propagate`` (``index_select`` on unpacked rows)."""

    def __init__(self, i, o):
        super().__init__(aggr="mean")
        self.lin = nn.Linear(i, o)

    def forward(self, x, edge_index):
        x = self.lin(x)
        out = self.propagate(edge_index, x=x)
        row, col = edge_index
        score = (x.index_select(0, row) * x.index_select(0, col)).sum(-1).tanh()
        return out + scatter(score, col, dim=0, dim_size=x.size(0), reduce="mean")[:, None]


class ReadsWithGather(MessagePassing):
    """The neighbour rows through ``gather`` with an expanded index, on a graph with self loops added."""

    def __init__(self, i, o):
        super().__init__(aggr="mean")
        self.lin = nn.Linear(i, o)

    def forward(self, x, edge_index):
        x = self.lin(x)
        loops = torch.arange(x.size(0)).repeat(2, 1)
        ei = torch.cat([edge_index, loops], dim=1)
        src = x.gather(0, ei[0].view(-1, 1).expand(-1, x.size(1)))
        return self.propagate(edge_index, x=x) + scatter(src, ei[1], dim=0, dim_size=x.size(0), reduce="max")


class ReadsDestinations(MessagePassing):
    """Reads only its edges' destinations by hand: a gate per edge from the destination's row (``x[col]``), and
    a max over each vertex's in-edges with self loops added (``index_select`` at ``ei[1]``)."""

    def __init__(self, i, o):
        super().__init__(aggr="add")
        self.lin = nn.Linear(i, o)

    def forward(self, x, edge_index):
        x = self.lin(x)
        row, col = edge_index
        gate = x[col].sum(-1).sigmoid()
        ei = torch.cat([edge_index, torch.arange(x.size(0)).repeat(2, 1)], dim=1)
        own = scatter(x.index_select(0, ei[1]).tanh(), ei[1], dim=0, dim_size=x.size(0), reduce="max")
        return self.propagate(edge_index, x=x, gate=gate) + own

    def message(self, x_j, gate):
        return gate.unsqueeze(-1) * x_j


LAYERS = [ReadsBefore, ReadsAfter, ReadsWithGather]


def _model(cls):  # the custom layer after a GCN layer: its input was computed on the chunk
    return three_layers(lambda: GCNConv(8, H), lambda: cls(H, H), lambda: cls(H, 3))


def _worker(rank, world, mode, outcomes):
    x, g, y, mask = zoo_graph()
    for cls in LAYERS + [ReadsDestinations]:
        got = check_mode(mode, _model(cls), dict(x=x, edge_index=g["edge_index"]), y, mask, world)
        if rank == 0:
            outcomes.put((cls.__name__, got))


CUT = {"graph_parallel": 2, "chunks": 2, "graph_parallel_chunks": 2}
WHOLE = {"pipeline": 2, "streaming": 1}


def _run(mode, world):
    import torch.multiprocessing as mp
    outcomes = mp.get_context("forkserver").Manager().Queue()
    run_distributed(_worker, world, mode, outcomes, timeout=300)
    return dict(outcomes.get() for _ in range(len(LAYERS) + 1))


@pytest.mark.parametrize("mode", list(CUT))
def test_neighbour_reads_outside_propagate_are_refused_on_every_rank_when_the_graph_is_cut(mode):
    got_all = _run(mode, CUT[mode])
    assert got_all.pop("ReadsDestinations") == "exact"  # the chunk's own rows: not a neighbour read
    for layer, got in got_all.items():
        assert got.startswith("refused:"), (layer, got)  # the same on every rank (check_mode agrees)
        assert "layer 'conv2' runs on part of the vertices" in got, got
        assert "outside propagate" in got and "message()" in got and "num_chunks=1" in got, got


@pytest.mark.parametrize("mode", list(WHOLE))
def test_neighbour_reads_run_exactly_when_the_layer_has_its_true_halo_rows(mode):
    for layer, got in _run(mode, WHOLE[mode]).items():
        assert got == "exact", (layer, got)
