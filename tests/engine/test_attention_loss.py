"""PyG's SuperGAT example adds the layers' auxiliary attention loss (``SuperGATConv.get_attention_loss()``) to its
training loss. That loss reads the attention logits the layer computed last, inside the engine's run of the model
(the last chunk's, from filler halo rows, already backpropagated by the engine): refused by name in training, on
every rank, never one chunk's loss in silence nor a cryptic autograd error; the layer itself runs exactly (the
zoo) and a loss without the term trains as on one process."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import SuperGATConv

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from pyg_pipe.model.errors import UnsupportedModelError
from tests.dist import run_distributed
from tests.zoo import zoo_graph


class SuperGAT(torch.nn.Module):
    """The model of PyG's ``examples/super_gat.py`` (dropout 0, so that runs can be compared)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv1 = SuperGATConv(c_in, 8, heads=8, attention_type="MX", edge_sample_ratio=0.8, is_undirected=True)
        self.conv2 = SuperGATConv(8 * 8, c_out, heads=8, concat=False, attention_type="MX", edge_sample_ratio=0.8,
                                  is_undirected=True)

    def forward(self, x, edge_index):
        x = F.elu(self.conv1(x, edge_index))
        return F.log_softmax(self.conv2(x, edge_index), dim=-1)


def _steps(model, x, ei, y, mask, steps: int = 3, attention: bool = True):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        torch.manual_seed(step)  # the negative sampling's draws, the same in both runs
        model.train()
        out = model(x, ei)
        loss = F.nll_loss(out[mask], y[mask])
        if attention:
            loss = loss + 4.0 * (model.conv1.get_attention_loss() + model.conv2.get_attention_loss())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_without_the_attention_loss_the_example_trains_as_one_process():
    """The example's loss less the attention term: 3 SGD steps with the engine (one chunk) equal one process."""
    x, g, y, mask = zoo_graph()
    torch.manual_seed(0)
    model = SuperGAT(x.size(1), int(y.max()) + 1)
    ref = copy.deepcopy(model)
    want = _steps(ref, x, g["edge_index"], y, mask, attention=False)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=1), Comm(torch.device("cpu")), num_stages=1)
    engine.install()
    try:
        got = _steps(model, x, g["edge_index"], y, mask, attention=False)
    finally:
        engine.uninstall()
    assert got == pytest.approx(want, abs=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunks,streaming", [(1, False), (4, False), (4, True)])
def test_the_attention_loss_is_refused_in_one_process(chunks, streaming):
    x, g, y, mask = zoo_graph()
    torch.manual_seed(0)
    model = SuperGAT(x.size(1), int(y.max()) + 1)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, streaming=streaming), Comm(torch.device("cpu")),
                           num_stages=1)
    engine.install()
    try:
        with pytest.raises(UnsupportedModelError, match=rf"SuperGATConv 'conv1': get_attention_loss\(\).*"
                                                        rf"1 stage\(s\), {chunks} chunk\(s\).*Leave the attention"):
            _steps(model, x, g["edge_index"], y, mask, steps=1)
        model.eval()  # (in eval mode PyG's own answer, 0, stands)
        assert float(model.conv1.get_attention_loss()) == 0.0
    finally:
        engine.uninstall()
    assert "get_attention_loss" not in model.conv1.__dict__  # uninstalled: the layer's own method again


def _pipeline(rank, world):
    x, g, y, mask = zoo_graph()
    torch.manual_seed(0)
    model = SuperGAT(x.size(1), int(y.max()) + 1)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=2, balance="layers"), Comm(torch.device("cpu")),
                           num_stages=world)
    engine.install()
    try:
        with pytest.raises(UnsupportedModelError, match=r"2 stage\(s\), 2 chunk\(s\)"):
            _steps(model, x, g["edge_index"], y, mask, steps=1)
    finally:
        engine.uninstall()


def test_the_attention_loss_is_refused_on_every_rank_of_a_pipeline():
    run_distributed(_pipeline, 2, timeout=180)
