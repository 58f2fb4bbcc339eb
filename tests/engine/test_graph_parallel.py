"""Graph parallelism and hybrid parallelism are exact: equal to single-process PyG within 1e-5.

Real gloo processes, real PyG layers. Ways exchange halo rows at every layer (forward and
backward) and all-reduce weight gradients, so outputs, gradients and parameters after a few
optimizer steps equal one process running plain PyG.
"""
import pytest
import torch

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from tests.dist import run_distributed
from tests.engine.test_transparency import ATOL, assert_exact_training
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
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=ways), Comm(torch.device("cpu")),
                               num_stages=stages, ways=ways)
        assert_exact_training(name, model, engine, x, edge_index, y, mask)


@pytest.mark.parametrize("world", [2, 4])
def test_graph_parallel_equals_single_process(world):
    """S = 1, W = P: outputs, loss, gradients, parameters after 3 steps and inference equal plain PyG."""
    run_distributed(_exact_worker, world, MODELS, 1, world, "random", timeout=300)


def test_hybrid_one_chunk_per_way_equals_single_process():
    """2 stages x 2 ways with one chunk per way is exact too."""
    run_distributed(_exact_worker, 4, MODELS, 2, 2, "random", timeout=300)


def test_isolated_vertices_and_self_loops():
    run_distributed(_exact_worker, 3, ["gcn", "sage", "gat"], 1, 3, "loops", timeout=240)


def _expect_error(rank, world, case):
    x, edge_index, y, mask = small_graph()
    model = make_model("gcn")
    if case == "more_ways_than_vertices":
        x, edge_index = x[:3], torch.tensor([[0, 1, 2], [1, 2, 0]])
        config = PipelineConfig(num_chunks=world)
    else:  # a partitioner that leaves one way without vertices
        def empty_part(edge_index, n, parts):
            return torch.arange(n), torch.tensor([0, 0, n // 3, 2 * n // 3, n])
        config = PipelineConfig(num_chunks=world, partition=empty_part)
    engine = GNNPipeEngine(model, config, Comm(torch.device("cpu"), timeout=30), num_stages=1, ways=world)
    engine.install()
    with pytest.raises(ValueError) as info:
        model(x, edge_index)
    msg = str(info.value)
    if case == "more_ways_than_vertices":
        assert "4 graph-parallel ways need at least 4 vertices, but the graph has 3" in msg, msg
    else:
        assert "empty chunks [0]" in msg and "at least one vertex" in msg, msg


@pytest.mark.parametrize("case", ["more_ways_than_vertices", "empty_partition"])
def test_bad_partitions_fail_on_every_rank_without_hanging(case):
    """Every rank raises the same clear error (checked before any collective could wait on it)."""
    run_distributed(_expect_error, 4, case, timeout=120)


def _lr0_worker(rank, world, name):
    """Hybrid with several chunks per way: with lr = 0 the history stays exact, so every step's
    forward equals the exact one; forward halo bytes equal the mirror count exactly, and only
    fresh rows' gradients travel back (at most one per reader chunk and cross-way halo row)."""
    from pyg_pipe.engine import halo_rows
    x, edge_index, y, mask = small_graph()
    torch.manual_seed(0)
    model = make_model(name, num_layers=4)
    with torch.no_grad():
        ref = model(x, edge_index)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=8), Comm(torch.device("cpu")), num_stages=2, ways=2)
    engine.install()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(4):
        engine.comm.reset_counters()
        out, loss = forward_backward(model, opt, x, edge_index, y, mask)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0, msg=f"{name}: step {step}")
        opt.step()
        totals = engine.comm.totals()
        g = engine.plan.graph
        ways_ptr = torch.stack([g.ptr[0], g.ptr[4], g.ptr[8]]).cpu()
        halo = halo_rows(edge_index, g.perm.cpu(), ways_ptr)
        widths = 3 * 16 if name != "gcnii" else 4 * 16   # values exchanged per step (x0 is row-local)
        assert totals["halo_forward"] == widths * halo * 4, (step, totals)
        # backward: each reader chunk returns the gradient of its own fresh cross-way halo rows
        cross = sum(int(((ch.halo_chunk // 4) != (ch.index // 4)).sum()) for ch in g.chunks)
        assert 0 < totals["halo_backward"] <= widths * cross * 4, (step, totals)
    engine.uninstall()


@pytest.mark.parametrize("name", ["gcn", "gcnii"])
def test_hybrid_with_history_keeps_exact_forward_at_lr0(name):
    run_distributed(_lr0_worker, 4, name, timeout=240)
