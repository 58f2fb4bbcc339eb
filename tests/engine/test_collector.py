"""The engine's fill and drain run with the process's older objects frozen out of the garbage collector's passes
(``pyg_pipe/engine/collector.py``), and leave the collector as they found it."""
import gc

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import GCN

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from tests.zoo import zoo_graph


@pytest.mark.parametrize("streaming", [True, False])
def test_the_fill_and_drain_freeze_older_objects_and_put_them_back(streaming):
    x, g, y, mask = zoo_graph()
    ei = g["edge_index"]
    torch.manual_seed(0)
    model = GCN(8, 12, num_layers=3, out_channels=3)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=4, streaming=streaming), Comm(torch.device("cpu")),
                           num_stages=1)
    seen = []
    model.convs[1].register_forward_pre_hook(lambda m, a: seen.append((gc.get_freeze_count(), torch.is_grad_enabled())))
    engine.install()
    try:
        for _ in range(2):  # (the first step's planning passes run before the fill: the second is checked)
            seen.clear()
            out = model(x, ei)
            assert gc.get_freeze_count() == 0  # (the fill's window closed with it)
            F.cross_entropy(out[mask], y[mask]).backward()
            assert gc.get_freeze_count() == 0
        assert seen and all(frozen > 0 for frozen, _ in seen)  # every chunk's layer call, fill and drain's replays

        gc.freeze()  # a process that froze its objects itself: left frozen (unfreezing would empty the count)
        try:
            out = model(x, ei)
            F.cross_entropy(out[mask], y[mask]).backward()
            assert gc.get_freeze_count() > 0
        finally:
            gc.unfreeze()
    finally:
        engine.uninstall()
