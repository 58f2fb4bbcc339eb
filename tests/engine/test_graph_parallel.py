"""Graph parallelism and hybrid parallelism are exact: equal to single-process PyG within 1e-5.

Real gloo processes, real PyG layers. Ways exchange halo rows at every layer (forward and
backward) and all-reduce weight gradients, so outputs, gradients and parameters after a few
optimizer steps equal one process running plain PyG.
"""
import pytest
import torch

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, sync_module_state
from tests.dist import run_distributed
from tests.engine.test_transparency import ATOL, _reference
from tests.models import MODELS, forward_backward, make_model, small_graph


def _graph_with_loops_and_isolated():
    x, edge_index, y, mask = small_graph(num_nodes=64)
    # vertices 60..63 are isolated; a few self loops on others
    keep = (edge_index < 60).all(0)
    loops = torch.tensor([[0, 5, 17], [0, 5, 17]])
    return x, torch.cat([edge_index[:, keep], loops], 1), y, mask


def _exact_worker(rank, world, names, stages, ways, graph):
    x, edge_index, y, mask = _graph_with_loops_and_isolated() if graph == "loops" else small_graph()
    for name in names:
        torch.manual_seed(0)
        model = make_model(name, num_layers=4)
        ref, outs, losses, grads = _reference(model, x, edge_index, y, mask, steps=3, lr=0.05)
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=ways), Comm(torch.device("cpu")),
                               num_stages=stages, ways=ways)
        engine.install()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            out, loss = forward_backward(model, opt, x, edge_index, y, mask)
            torch.testing.assert_close(out, outs[step], atol=ATOL, rtol=0, msg=f"{name}: output, step {step}")
            assert abs(loss.item() - losses[step]) < ATOL, (name, step)
            for pname, p in model.named_parameters():
                if engine.owners[pname] == engine.stage_index:
                    torch.testing.assert_close(p.grad, grads[step][pname], atol=ATOL, rtol=0,
                                               msg=f"{name}: grad of {pname}, step {step}, rank {rank}")
                else:
                    assert p.grad is None, f"{name}: rank {rank} computed a gradient for {pname}"
            opt.step()
        sync_module_state(model, engine.owners, engine.owner_ranks)
        for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p, q, atol=ATOL, rtol=0, msg=f"{name}: parameter {pname} after 3 steps")
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(x, edge_index), ref.eval()(x, edge_index), atol=ATOL, rtol=0)
        engine.uninstall()


@pytest.mark.parametrize("world", [2, 4])
def test_graph_parallel_equals_single_process(world):
    """S = 1, W = P: outputs, loss, gradients, parameters after 3 steps and inference equal plain PyG."""
    run_distributed(_exact_worker, world, MODELS, 1, world, "random", timeout=300)


def test_hybrid_one_chunk_per_way_equals_single_process():
    """2 stages x 2 ways with one chunk per way is exact too."""
    run_distributed(_exact_worker, 4, MODELS, 2, 2, "random", timeout=300)


def test_isolated_vertices_and_self_loops():
    run_distributed(_exact_worker, 3, ["gcn", "sage", "gat"], 1, 3, "loops", timeout=240)
