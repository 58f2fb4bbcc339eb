"""NCCL-readiness, checked on CPU: the per-chunk loop never waits on the host.

Every operation a rank runs while it processes one chunk (forward: inputs, stage link, layers, halo
exchange, history; backward: gradients, routing, stage link) is recorded with a ``TorchDispatchMode``;
reading a tensor's value on the host (``aten._local_scalar_dense``: ``.item()``, ``int(t)``,
``.tolist()``) or ``aten.nonzero`` would stall a GPU stream and is counted. After the first step
(planning: shapes are learned once with small headers) the count must be zero, in a hybrid grid that
exercises everything: 2 stages x 2 ways, 4 chunks per way, degrees, history, cross-way gradients, and
the drain's replays of chunks (``recompute=True``). The ring halo exchange (:mod:`pyg_pipe.engine.runtime.ring`) is
checked on 1 stage x 4 ways, 2 chunks per way: rings of 4 with rows forwarded and gradients summed on the way.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch_geometric.nn import GCNConv, GraphConv

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from pyg_pipe.engine.step import pipeline as step
from tests.dist import run_distributed
from tests.zoo import zoo_graph

SYNCS = {"_local_scalar_dense", "nonzero"}


class HostSyncs(TorchDispatchMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCS:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([GraphConv(8, 12), GCNConv(12, 12), GraphConv(12, 12), GCNConv(12, 3)])

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < 3:
                x = x.relu()
        return x


def _worker(rank, world, stages=2, ways=2, halo_exchange="all_to_all"):
    counts, ran = {}, {"run_chunk": 0, "drain_chunk": 0}
    originals = {name: getattr(step, name) for name in ran}
    armed = [False]  # after the first step (planning learns shapes with small headers)

    def counted(name):
        def run(*args, **kwargs):
            if not armed[0]:
                return originals[name](*args, **kwargs)
            ran[name] += 1
            with HostSyncs(counts):
                return originals[name](*args, **kwargs)
        return run

    for name in ran:
        setattr(step, name, counted(name))
    try:
        x, g, y, mask = zoo_graph()
        torch.manual_seed(0)
        model = Net()
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=8, balance="layers", recompute=True,
                                                     halo_exchange=halo_exchange),
                               Comm(torch.device("cpu")), num_stages=stages, ways=ways)
        engine.install()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for i in range(3):
            armed[0] = i > 0
            out = model(x, g["edge_index"])
            opt.zero_grad()
            F.cross_entropy(out[mask], y[mask]).backward()
            opt.step()
        engine.uninstall()
    finally:
        for name, fn in originals.items():
            setattr(step, name, fn)
    # 2 steps x cpw chunks, and the drain's replays of the cpw - 1 chunks a step that recompute keeps no activations of
    cpw = 8 // ways
    assert ran == {"run_chunk": 2 * cpw + 2 * (cpw - 1), "drain_chunk": 2 * cpw}, \
        f"rank {rank}: the checked code ran {ran} times"
    assert counts == {}, f"rank {rank}: host synchronisations in the per-chunk loop: {counts}"


def test_no_host_synchronisation_in_the_per_chunk_loop():
    run_distributed(_worker, 4, timeout=240)


def test_no_host_synchronisation_in_the_ring_halo_exchange():
    run_distributed(_worker, 4, 1, 4, "ring", timeout=240)
