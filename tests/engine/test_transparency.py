"""The pipeline is invisible where the algorithm is exact, and keeps its invariants where it is not.

Engine-level: real gloo processes, real PyG layers, compared with single-process PyG.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, sync_module_state
from tests.dist import run_distributed
from tests.models import MODELS, forward_backward, make_model, small_graph

ATOL = 1e-5


def _reference(model, x, edge_index, y, mask, steps, lr):
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    outs, losses, grads = [], [], []
    for _ in range(steps):
        out = ref(x, edge_index)
        loss = F.cross_entropy(out[mask], y[mask])
        opt.zero_grad()
        loss.backward()
        outs.append(out.detach())
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        opt.step()
    return ref, outs, losses, grads


def assert_exact_training(name, model, engine, x, edge_index, y, mask):
    """Three SGD+momentum steps through ``engine`` equal plain PyG: output, loss, the gradients of the
    parameters this rank's stage owns (no others), the parameters after syncing, and inference."""
    ref, outs, losses, grads = _reference(model, x, edge_index, y, mask, steps=3, lr=0.05)
    engine.install()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        out, loss = forward_backward(model, opt, x, edge_index, y, mask)
        torch.testing.assert_close(out, outs[step], atol=ATOL, rtol=0, msg=f"{name}: output, step {step}")
        assert abs(loss.item() - losses[step]) < ATOL, (name, step)
        for pname, p in model.named_parameters():
            if engine.owners[pname] == engine.stage_index:
                torch.testing.assert_close(p.grad, grads[step][pname], atol=ATOL, rtol=0,
                                           msg=f"{name}: grad of {pname}, step {step}")
            else:
                assert p.grad is None, f"{name}: stage {engine.stage_index} computed a gradient for {pname}"
        opt.step()
    sync_module_state(model, engine.owners, engine.owner_ranks)
    for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=0, msg=f"{name}: parameter {pname} after 3 steps")
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x, edge_index), ref.eval()(x, edge_index), atol=ATOL, rtol=0)
    engine.uninstall()


def _exact_worker(rank, world, names, num_layers):
    x, edge_index, y, mask = small_graph()
    for name in names:
        torch.manual_seed(0)
        model = make_model(name, num_layers=num_layers)
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=1), Comm(torch.device("cpu")), num_stages=world)
        assert_exact_training(name, model, engine, x, edge_index, y, mask)


@pytest.mark.parametrize("world", [2, 4])
def test_one_chunk_equals_single_process(world):
    """One chunk: output, loss, every gradient and every parameter after 3 steps equal plain PyG."""
    run_distributed(_exact_worker, world, MODELS, 4, timeout=240)
