"""Overlap (``overlap=True``, the default): a stage posts the receives of the next chunk's values (fill)
and gradients (drain) before computing the current chunk. Training with it equals training without it,
bit for bit, and the receives really were posted ahead: in a 3-stage pipeline (the middle stage receives
in both directions), with and without recomputation, and with the model called twice a step (each call
has its own chunk keys on the stage link)."""
import torch
import torch.nn.functional as F
from torch_geometric.nn.models import GAT, GCN

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, sync_module_state
from tests.dist import run_distributed
from tests.models import GCNIIStack as GCNII
from tests.zoo import zoo_graph

MODELS = {"GCNII": GCNII, "GAT": lambda: GAT(8, 12, 4, 3, heads=2, dropout=0.3),
          "GCN-twice": lambda: GCN(8, 12, 4, 3, dropout=0.2)}


def _train(name, x, ei, y, mask, chunks, overlap, **cfg):
    torch.manual_seed(0)
    model = MODELS[name]()
    sync_module_state(model, {}, [0])
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, balance="layers", overlap=overlap, **cfg),
                           Comm(torch.device("cpu"), timeout=60), num_stages=3)
    engine.install()
    try:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for step in range(3):
            torch.manual_seed(100 + step)
            out = model(x, ei)
            loss = F.cross_entropy(out[mask], y[mask])
            if name.endswith("twice"):  # a second call on a corrupted copy (DGI-style)
                loss = loss + (model(2 * x + 1, ei) - out).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        sync_module_state(model, engine.owners, engine.owner_ranks)
        return [t.detach().clone() for t in (*model.parameters(), *model.buffers())], engine.runtime.link.prefetched
    finally:
        engine.uninstall()


def _cases(rank, world, cases):
    x, g, y, mask = zoo_graph(sizes=(24, 40, 40))
    ei = g["edge_index"]
    for name, chunks, cfg in cases:
        want, none = _train(name, x, ei, y, mask, chunks, False, **cfg)
        got, ahead = _train(name, x, ei, y, mask, chunks, True, **cfg)
        assert none == 0
        # after the first step every chunk but the first of a pass (fill and drain) was posted ahead
        assert ahead > 0, (rank, name)
        for a, b in zip(want, got):
            assert torch.equal(a, b), f"{name} {chunks} chunks {cfg}: parameters differ with overlap"


def test_overlap_is_bit_identical_and_posts_receives_ahead():
    cases = [("GCNII", 6, dict(recompute=True)),
             ("GAT", 3, dict(recompute=False, snapshot_period=2)),
             ("GCN-twice", 6, dict(recompute=True))]
    run_distributed(_cases, 3, cases, timeout=300)


def test_a_bad_overlap_value_names_the_knob():
    import pytest
    with pytest.raises(ValueError, match="overlap='yes'"):
        PipelineConfig(overlap="yes").validate()
