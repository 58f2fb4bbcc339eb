"""DropEdge and DropNode in the model's forward (PyG's ``dropout_edge``, ``dropout_node``): one draw a step over the
whole graph, the same on every rank, chunk, stage and replay (:mod:`pyg_pipe.engine.step.dropedge`).

The reference is plain PyG in one process on the whole graph, keeping the edges the engine's draw keeps at that step
(``graph.chunks.edge_keep``; for DropNode the edges between the vertices ``graph.chunks.node_keep`` keeps, and the
features of the dropped vertices zeroed with the vertex mask it returns): the engine's results must equal it where
the algorithm is exact (one chunk a way, streaming), over several steps whose masks differ."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import GCNConv, SAGEConv
from torch_geometric.utils import dropout_edge, dropout_node

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, sync_module_state
from pyg_pipe.graph.chunks import edge_keep, node_keep
from tests.dist import run_distributed
from tests.harness import ranges
from tests.zoo import zoo_graph

P = 0.3


class DropEdgeNet(torch.nn.Module):
    """GCN (degrees normalised over the kept edges: their halo part completed by the engine) then SAGE, both on the
    edges DropEdge keeps."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.conv3 = GCNConv(8, 16), SAGEConv(16, 16), GCNConv(16, 3)

    def forward(self, x, edge_index):
        edge_index, _ = dropout_edge(edge_index, p=P, training=self.training)
        x = self.conv1(x, edge_index).relu()
        x = self.conv2(x, edge_index).relu()
        return self.conv3(x, edge_index)


class PerLayerDropEdge(DropEdgeNet):
    """A new draw before every layer: on two stages, the second draws the forward's second and third."""

    def forward(self, x, edge_index):
        x = self.conv1(x, dropout_edge(edge_index, p=P, training=self.training)[0]).relu()
        x = self.conv2(x, dropout_edge(edge_index, p=P, training=self.training)[0]).relu()
        return self.conv3(x, dropout_edge(edge_index, p=P, training=self.training)[0])


class FlipThenDrop(DropEdgeNet):
    """DropEdge on the transposed graph (a transpose of an input is understood, and drawn over like one)."""

    def forward(self, x, edge_index):
        edge_index, _ = dropout_edge(edge_index.flip(0), p=P, training=self.training)
        x = self.conv1(x, edge_index).relu()
        x = self.conv2(x, edge_index).relu()
        return self.conv3(x, edge_index)


class DropNodeNet(DropEdgeNet):
    """DropNode (GRAND's augmentation): the edges between the kept vertices, and the dropped vertices' features
    zeroed with the mask ``dropout_node`` returns."""

    def forward(self, x, edge_index):
        edge_index, _, kept = dropout_node(edge_index, p=P, training=self.training)
        x = self.conv1(x * kept.unsqueeze(-1).to(x.dtype), edge_index).relu()
        x = self.conv2(x, edge_index).relu()
        return self.conv3(x, edge_index)


def reference(model: DropEdgeNet, x, edge_index, step: int, call: int = 0):
    """The model on one device, on the edges the engine's draws keep at ``step`` (training mode): the ``k``-th call of
    the forward keeps ``edge_keep(E, p, seed, step, k)``."""
    if isinstance(model, FlipThenDrop) and model.training:
        edge_index = edge_index.flip(0)
    if isinstance(model, DropNodeNet):
        kept = node_keep(x.size(0), P, 0, step, (call, 0), x.device) if model.training else \
            torch.ones(x.size(0), dtype=torch.bool, device=x.device)
        edge_index = edge_index[:, kept[edge_index[0]] & kept[edge_index[1]]]
        h = model.conv1(x * kept.unsqueeze(-1).to(x.dtype), edge_index).relu()
        return model.conv3(model.conv2(h, edge_index).relu(), edge_index)

    def kept(k):
        return edge_index[:, edge_keep(edge_index.size(1), P, 0, step, (call, k), edge_index.device)]
    calls = [0, 1, 2] if isinstance(model, PerLayerDropEdge) else [0, 0, 0]
    h = model.conv1(x, kept(calls[0])).relu()
    h = model.conv2(h, kept(calls[1])).relu()
    return model.conv3(h, kept(calls[2]))


def _train(rank, world, stages, ways, chunks, streaming, device="cpu", make=DropEdgeNet, calls=1):
    device = torch.device(device)
    x, g, y, mask = zoo_graph()
    x, y, mask, edge_index = x.to(device), y.to(device), mask.to(device), g["edge_index"].to(device)
    torch.manual_seed(0)
    model = make().to(device)
    if world > 1:
        sync_module_state(model, {}, [0])
    ref = copy.deepcopy(model)
    cfg = dict(num_chunks=chunks, partition=ranges if streaming else "greedy")
    if streaming:
        cfg["streaming"] = True
    engine = GNNPipeEngine(model, PipelineConfig(**cfg), Comm(device, timeout=60), num_stages=stages, ways=ways)
    engine.install()
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        for step in range(5):  # (on a GPU: two eager steps, then the capture, which DropEdge turns down)
            outs = [model(x, edge_index) for _ in range(calls)]  # (two calls: two views, each its own draw)
            out = torch.cat(outs, 1)
            loss = sum(F.cross_entropy(o[mask], y[mask]) for o in outs)
            opt.zero_grad()
            loss.backward()
            opt.step()
            wants = [reference(ref, x, edge_index, step, call) for call in range(calls)]
            want = torch.cat(wants, 1)
            ref_loss = sum(F.cross_entropy(w[mask], y[mask]) for w in wants)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            torch.testing.assert_close(out, want, atol=1e-5, rtol=0, msg=lambda m: f"step {step}: {m}")
        sync_module_state(model, engine.owners, engine.owner_ranks)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        model.eval()
        ref.eval()
        with torch.no_grad():  # inference keeps every edge, as PyG's does
            torch.testing.assert_close(model(x, edge_index), ref(x, edge_index), atol=1e-5, rtol=0)
    finally:
        engine.uninstall()


@pytest.mark.parametrize("make", [DropEdgeNet, PerLayerDropEdge, FlipThenDrop, DropNodeNet],
                         ids=["one_draw", "a_draw_per_layer", "on_the_transpose", "dropnode"])
@pytest.mark.parametrize("mode,world,stages,ways,chunks,streaming", [
    ("graph_parallel", 2, 1, 2, 2, False),
    ("pipeline", 2, 2, 1, 1, False),
    ("streaming", 1, 1, 1, 4, True),
])
def test_dropedge_equals_one_device_keeping_the_same_edges(mode, world, stages, ways, chunks, streaming, make):
    if world == 1:
        _train(0, 1, stages, ways, chunks, streaming, "cpu", make)
    else:
        run_distributed(_train, world, stages, ways, chunks, streaming, "cpu", make, timeout=120)


@pytest.mark.parametrize("stages,ways,streaming", [(1, 2, False), (1, 1, True)], ids=["graph_parallel", "streaming"])
def test_a_model_called_twice_in_a_step_draws_twice(stages, ways, streaming):
    """Contrastive views: each call of the model in a step keeps edges of its own draw, as two calls on one device."""
    if streaming:
        _train(0, 1, 1, 1, 4, True, "cpu", DropEdgeNet, 2)
    else:
        run_distributed(_train, 2, stages, ways, 2, False, "cpu", DropEdgeNet, 2, timeout=120)


@pytest.mark.gpu
def test_dropedge_streamed_on_a_gpu_is_not_captured_and_equals_one_device():
    """On a GPU a streamed step is captured as CUDA graphs after two eager steps (step/capture.py); a replay would
    keep the captured step's edges, so a model with DropEdge stays eager, and equals one device every step."""
    _train(0, 1, 1, 1, 4, True, "cuda")


@pytest.mark.parametrize("name", ["dropout_edge", "dropout_node"])
def test_outside_the_engine_the_draws_are_pygs(name):
    """Installed or not, a call outside a chunk (the reference, a data transform) is PyG's own draw (the name in this
    module, where the models' forward finds it, is the engine's while it is installed)."""
    x, g, y, mask = zoo_graph()
    engine = GNNPipeEngine(DropNodeNet(), PipelineConfig(num_chunks=1), Comm(torch.device("cpu")), num_stages=1)
    engine.install()
    try:
        assert globals()[name].__name__ == f"chunk_{name}"
        torch.manual_seed(3)
        got = globals()[name](g["edge_index"], p=P)
    finally:
        engine.uninstall()
    torch.manual_seed(3)
    want = globals()[name](g["edge_index"], p=P)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
