"""Invariants of GNNPipe with several chunks, where history makes the algorithm approximate.

* Forward: with lr = 0 (weights never change) and no dropout, history always equals the exact
  embeddings, so every step's loss and output equal single-process PyG (shuffling and snapshots on).
* Validation after chunked training is exact: after 3 Adam steps with 2 or 8 chunks, the eval forward
  (which runs one chunk per way, no history) equals the plain model with the same synchronised weights.
* Gradients: when chunks are the connected components of the graph no chunk reads another's rows,
  so even with many chunks gradients and parameters after 3 steps equal single-process PyG.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, sync_module_state
from tests.dist import run_distributed
from tests.models import MODELS, forward_backward, make_model, small_graph

ATOL = 1e-5


def _lr0_worker(rank, world, names, chunks):
    x, edge_index, y, mask = small_graph()
    for name in names:
        torch.manual_seed(0)
        model = make_model(name)
        ref = copy.deepcopy(model)
        with torch.no_grad():
            ref_out = ref(x, edge_index)
        ref_loss = F.cross_entropy(ref_out[mask], y[mask]).item()
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, snapshot_period=2),
                               Comm(torch.device("cpu")), num_stages=world)
        engine.install()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for step in range(5):
            out, loss = forward_backward(model, opt, x, edge_index, y, mask)
            opt.step()
            assert abs(loss.item() - ref_loss) < ATOL, f"{name}, {chunks} chunks, step {step}: {loss.item()} vs {ref_loss}"
            torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
        engine.uninstall()


@pytest.mark.parametrize("world", [2])
def test_lr0_loss_equals_single_process(world):
    run_distributed(_lr0_worker, world, MODELS + ["gcn_cached"], 8, timeout=240)


def _inference_worker(rank, world, names):
    x, edge_index, y, mask = small_graph()
    for name in names:
        for chunks in (2, 8):
            torch.manual_seed(0)
            model = make_model(name)
            engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks), Comm(torch.device("cpu")),
                                   num_stages=world)
            engine.install()
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            for step in range(3):
                out, loss = forward_backward(model, opt, x, edge_index, y, mask)
                opt.step()
                assert torch.isfinite(out).all()
            sync_module_state(model, engine.owners, engine.owner_ranks)
            model.eval()
            with torch.no_grad():
                got = model(x, edge_index)
            engine.uninstall()
            with torch.no_grad():
                want = model(x, edge_index)  # the plain PyG model, same weights, one process
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"{name}, {chunks} chunks")


@pytest.mark.parametrize("world", [2])
def test_validation_after_chunked_training_equals_plain_model(world):
    run_distributed(_inference_worker, world, MODELS, timeout=240)


def components_graph(parts=4, size=15, seed=0):
    """``parts`` disconnected random graphs of ``size`` vertices, with contiguous ids."""
    xs, eis, ys = [], [], []
    for p in range(parts):
        x, ei, y, _ = small_graph(num_nodes=size, num_edges=45, seed=seed + p)
        xs.append(x), eis.append(ei + p * size), ys.append(y)
    x, ei, y = torch.cat(xs), torch.cat(eis, 1), torch.cat(ys)
    mask = torch.rand(parts * size, generator=torch.Generator().manual_seed(seed)) < 0.7
    return x, ei, y, mask


def _component_chunks(edge_index, num_nodes, num_chunks):
    return torch.arange(num_nodes), torch.linspace(0, num_nodes, num_chunks + 1).long()


def _components_worker(rank, world, names):
    x, edge_index, y, mask = components_graph()
    for name in names:
        torch.manual_seed(0)
        model = make_model(name)
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=4, partition=_component_chunks),
                               Comm(torch.device("cpu")), num_stages=world)
        engine.install()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            out, loss = forward_backward(model, opt, x, edge_index, y, mask)
            ref_out, ref_loss = forward_backward(ref, ref_opt, x, edge_index, y, mask)
            torch.testing.assert_close(out, ref_out.detach(), atol=ATOL, rtol=0)
            for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
                if engine.owners[pname] == rank:
                    torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0, msg=f"{name}: grad {pname}")
            opt.step()
            ref_opt.step()
        sync_module_state(model, engine.owners, engine.owner_ranks)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=ATOL, rtol=0)
        engine.uninstall()


def test_component_chunks_give_exact_gradients():
    run_distributed(_components_worker, 2, MODELS, timeout=240)
