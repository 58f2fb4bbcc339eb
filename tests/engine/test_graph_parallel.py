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


def _expect_errors(rank, world, cases):
    for case in cases:
        _expect_error(rank, world, case)


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


def test_bad_partitions_fail_on_every_rank_without_hanging():
    """Every rank raises the same clear error (checked before any collective could wait on it), and the
    next case runs on the same processes: nothing was left waiting."""
    run_distributed(_expect_errors, 4, ["more_ways_than_vertices", "empty_partition"], timeout=120)


def expected_halo_bytes(edge_index, perm, ptr, ways, pi, widths, grad_widths):
    """Halo bytes of one hybrid step, counted from the graph and the chunk order alone.

    Forward: at every site, each chunk sends every other way the rows its chunks read (one width per
    site). Backward: each reader chunk sends back the gradient of the rows of other ways it read fresh
    (their chunk runs at its clock or earlier), at every site whose rows need a gradient.
    """
    N, C = perm.numel(), ptr.numel() - 1
    cpw = C // ways
    new = torch.empty_like(perm)
    new[perm] = torch.arange(N)
    chunk = torch.bucketize(torch.arange(N), ptr[1:], right=True)
    src, dst = new[edge_index[0]], new[edge_index[1]]
    reader, owner = chunk[dst], chunk[src]
    cross_way = (reader // cpw) != (owner // cpw)
    # forward: distinct (owner row, reader way) pairs
    mirrors = torch.unique(src[cross_way] * ways + reader[cross_way] // cpw).numel()
    # backward: distinct (reader chunk, row) pairs read fresh from another way
    clock_of_index = torch.empty(cpw, dtype=torch.long)
    clock_of_index[torch.tensor(pi)] = torch.arange(cpw)
    clock = clock_of_index[torch.arange(C) % cpw]
    fresh = cross_way & (clock[owner] <= clock[reader])
    reads = torch.unique(reader[fresh] * N + src[fresh]).numel()
    return sum(widths) * mirrors * 4, sum(grad_widths) * reads * 4


def _lr0_worker(rank, world, name):
    """Hybrid with several chunks per way: with lr = 0 the history stays exact, so every step's
    forward equals the exact one; the halo bytes of every step equal the count from the graph and
    the step's chunk order, forward and backward."""
    x, edge_index, y, mask = small_graph()
    torch.manual_seed(0)
    model = make_model(name, num_layers=4)
    with torch.no_grad():
        ref = model(x, edge_index)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=8), Comm(torch.device("cpu")), num_stages=2, ways=2)
    engine.install()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    # rows exchanged per site: GCN sends lin(x), 16, 16 and 3 wide for layers 2-4 (layer 1 reads the
    # input features); GCNII sends its 16-wide input at all 4 layers (even the first layer's input is
    # computed by the model). Degrees come from the inputs, nothing is exchanged for them.
    widths = [16, 16, 3] if name == "gcn" else [16, 16, 16, 16]
    grad_widths = widths
    for step in range(4):
        engine.comm.reset_counters()
        out, loss = forward_backward(model, opt, x, edge_index, y, mask)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0, msg=f"{name}: step {step}")
        opt.step()
        totals = engine.comm.totals()
        fwd, bwd = expected_halo_bytes(edge_index, engine.plan.perm, engine.plan.ptr, 2,
                                       engine.runtime.schedule.local_order(step), widths, grad_widths)
        assert totals["halo_forward"] == fwd, (step, totals, fwd)
        assert totals["halo_backward"] == bwd, (step, totals, bwd)
    engine.uninstall()


@pytest.mark.parametrize("name", ["gcn", "gcnii"])
def test_hybrid_with_history_keeps_exact_forward_at_lr0(name):
    run_distributed(_lr0_worker, 4, name, timeout=240)


def _allreduce_worker(rank, world, stages, ways):
    """The ``weight_allreduce`` counter against what ``all_reduce`` is actually given (a ring all-reduce
    of n values over W ranks moves 2·(W-1)·n values in all)."""
    import torch.distributed as dist
    given = []
    original = dist.all_reduce

    def recording(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        size = dist.get_world_size(group)
        if tensor.is_floating_point() and tensor.numel() > 2:  # not planning collectives or uint8 flags
            given.append(2 * (size - 1) * tensor.numel() * tensor.element_size() / size)
        return original(tensor, op=op, group=group, async_op=async_op)

    x, edge_index, y, mask = small_graph()
    torch.manual_seed(0)
    model = make_model("gcn", num_layers=4)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=ways), Comm(torch.device("cpu")), num_stages=stages,
                           ways=ways)
    engine.install()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    forward_backward(model, opt, x, edge_index, y, mask)  # plans first (planning collectives not counted)
    engine.comm.reset_counters()
    dist.all_reduce = recording
    try:
        forward_backward(model, opt, x, edge_index, y, mask)
    finally:
        dist.all_reduce = original
    counted = engine.comm.totals()["weight_allreduce"]
    total_given = torch.tensor([sum(given)], dtype=torch.float64)
    dist.all_reduce(total_given)
    assert counted == round(float(total_given)) > 0, (counted, float(total_given))
    if stages == 1:  # graph parallel: every parameter, summed over all ways
        assert counted == 2 * (ways - 1) * sum(p.numel() for p in model.parameters()) * 4
    engine.uninstall()


@pytest.mark.parametrize("stages,ways", [(1, 2), (2, 2)])
def test_weight_allreduce_bytes_are_what_all_reduce_is_given(stages, ways):
    run_distributed(_allreduce_worker, stages * ways, stages, ways, timeout=240)
