"""A model called several times in one training step, as contrastive and siamese GNNs do (DGI, GRACE,
BGRL, GraphCL run an encoder on the graph and on a corrupted or augmented copy): each call is computed
as on one device, and the weight gradients of all calls are summed once.

The encoder is a plain PyG model; the step calls it on the graph, then a second time on one of: the
same input, ``2x + 1``, the rows permuted (DGI's corruption), the input under ``torch.no_grad()``
(BGRL's target), or a copy of the graph with edges dropped (GRACE's augmentation, new every step).
The loss uses both outputs. Checked in every mode, one process launch per mode:

* exact modes (graph parallel, a pipeline with one chunk, the ways pyg_pipe adds for a one-layer
  encoder with ``num_chunks=1``, hybrid with one chunk per way): outputs of both calls every step and
  the parameters after 3 SGD steps equal one process;
* chunks whose boundaries are the graph's components (no chunk reads another's rows): the same, with
  the history of each call in play;
* hybrid with 8 chunks at lr = 0: every call's training forward equals one process every step (each
  call reads its own history, never the other call's rows).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GCNConv, SAGEConv

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, sync_module_state
from tests.dist import run_distributed
from tests.harness import ranges
from tests.zoo import zoo_graph

ATOL = 1e-5
SECOND = ["same", "affine", "permuted", "no_grad", "dropped_edges"]


class Encoder(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        dims = [8] + [12] * layers
        self.convs = nn.ModuleList(GCNConv(a, b) if i % 2 == 0 else SAGEConv(a, b)
                                   for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])))

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = x.relu()
        return x


def _second(kind, encoder, x, edge_index, step):
    if kind == "same":
        return encoder(x, edge_index)
    if kind == "affine":
        return encoder(2 * x + 1, edge_index)
    if kind == "permuted":
        return encoder(x[torch.randperm(x.size(0), generator=torch.Generator().manual_seed(7))], edge_index)
    if kind == "no_grad":
        with torch.no_grad():
            return encoder(x, edge_index)
    keep = torch.rand(edge_index.size(1), generator=torch.Generator().manual_seed(100 + step)) < 0.8
    return encoder(x, edge_index[:, keep])


def _loss(a, b, y, mask):
    """A supervised term and an agreement term between the two views (as contrastive losses do)."""
    return F.cross_entropy(a[mask, :3], y[mask]) + (a * b).sum(1).sigmoid().mean()


def _run(model, opt, kind, x, edge_index, y, mask, step):
    a = model(x, edge_index)
    b = _second(kind, model, x, edge_index, step)
    opt.zero_grad()
    _loss(a, b, y, mask).backward()
    opt.step()
    return a.detach(), b.detach()


def _worker(rank, world, stages, ways, chunks, lr, layers, graph, cfg):
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph(sizes=graph)
    edge_index = g["edge_index"]
    for kind in SECOND:
        torch.manual_seed(0)
        model = Encoder(layers)
        ref = copy.deepcopy(model)
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, balance="layers", **cfg),
                               Comm(torch.device("cpu"), timeout=60), num_stages=stages, ways=ways)
        engine.install()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
        for step in range(3):
            got = _run(model, opt, kind, x, edge_index, y, mask, step)
            want = _run(ref, ref_opt, kind, x, edge_index, y, mask, step)
            for call, (a, b) in enumerate(zip(got, want)):
                torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=f"{kind}: call {call}, step {step}")
        sync_module_state(model, engine.owners, engine.owner_ranks)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=ATOL, rtol=0, msg=f"{kind}: {name} after 3 steps")
        engine.uninstall()


def _components(edge_index, num_nodes, num_chunks):
    """Chunks that are the zoo graph's components (16 vertices each)."""
    return torch.arange(num_nodes), torch.arange(0, num_nodes + 1, 16)


CASES = {  # world, (stages, ways, chunks, lr, layers, component sizes, config)
    "graph_parallel": (2, (1, 2, 2, 0.5, 2, (16, 48), {})),
    "pipeline": (2, (2, 1, 1, 0.5, 2, (16, 48), {})),
    "ways_added": (2, (None, None, 1, 0.5, 1, (16, 48), {})),
    "hybrid": (4, (2, 2, 2, 0.5, 2, (16, 48), {})),
    "component_chunks": (2, (2, 1, 4, 0.5, 2, (16, 16, 16, 16), {"partition": _components})),
    "hybrid_chunks_lr0": (4, (2, 2, 8, 0.0, 2, (16, 48), {})),
}


@pytest.mark.parametrize("mode", list(CASES))
def test_a_model_called_twice_per_step_is_computed_as_on_one_device(mode):
    world, args = CASES[mode]
    run_distributed(_worker, world, *args, timeout=300)


def _chunks_fit_the_ways(rank, world):
    """With fewer layers than devices pyg_pipe adds graph-parallel ways; a configured chunk count that
    does not fit them becomes the next multiple, and the run says so once."""
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph()
    engine = GNNPipeEngine(Encoder(1), PipelineConfig(num_chunks=3, partition=ranges),
                           Comm(torch.device("cpu"), timeout=60), num_stages=None, ways=None)
    engine.install()
    engine.module(x, g["edge_index"]).sum().backward()
    engine.uninstall()
    assert (engine.num_stages, engine.ways, engine.plan.num_chunks) == (1, 2, 4)
    assert sum("using num_chunks=4" in n for n in engine.notes) == 1, engine.notes


def test_chunk_count_fits_the_ways_pyg_pipe_added():
    run_distributed(_chunks_fit_the_ways, 2, timeout=120)
