"""``num_chunks="auto"`` (pyg_pipe/engine/plan/chunk_cost.py): the cost model's choice, and the plan's
use of it: one count on every rank, decided once (a resume does not measure again), integers override."""
import os

import pytest
import torch

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from pyg_pipe.engine.plan import chunk_cost
from pyg_pipe.engine.plan.chunk_cost import choose, fit, predicted_step, shared_cores
from tests.dist import run_distributed
from tests.models import forward_backward, make_model, small_graph


def test_fit_recovers_a_line():
    a, b = fit([(100, 0.5 + 100 * 0.01), (25, 0.5 + 25 * 0.01)])
    assert a == pytest.approx(0.5) and b == pytest.approx(0.01)
    assert fit([(100, 1.0), (25, 2.0)]) == (1.5, 0.0)  # (timing noise: a slower small chunk: all fixed cost)


def test_choice_is_the_fewest_chunks_near_the_fastest():
    N, S, W = 1000, 2, 1
    # no cost per chunk: more chunks are always faster; the fewest within 10 % of the fastest
    c = choose(0.0, 1.0, N, S, W)
    best = min(c.predicted.values())
    assert c.predicted[c.per_way] <= 1.1 * best
    assert all(c.predicted[k] > 1.1 * best for k in c.predicted if k < c.per_way)
    assert c.per_way == 16 and max(c.predicted) == 64
    # a larger cost per chunk never asks for more chunks
    ks = [choose(a, 1.0, N, S, W).per_way for a in (0.0, 10.0, 100.0, 1000.0, 1e5)]
    assert ks == sorted(ks, reverse=True) and ks[-1] == 1
    # one stage has no bubble: one chunk a way (exact)
    assert choose(0.0, 1.0, N, 1, 4).per_way == 1
    # chunks never outnumber the vertices of a way
    assert max(choose(0.0, 1.0, 12, 4, 2).predicted) == 4
    assert predicted_step(1.0, 0.0, N, 2, 1, 4) == pytest.approx(1.0 / 2 * 5)


def test_processes_sharing_cores_make_the_bubble_no_idle_time():
    """4 single-thread processes on 2 cores: a stage waiting in the bubble gives its core away, so the step is
    at least the machine's share of all the work; with the fit measured there (a random 20k-vertex graph,
    docs/gnnpipe.md) the choice is 4 chunks, the grid's fastest, not 8 (1.45x slower)."""
    assert shared_cores(2, 2, 1, 2) == 0.0 and shared_cores(2, 4, 1, 2) == 0.0  # (one core each: no sharing)
    assert shared_cores(4, 4, 1, 2) == 0.5 and shared_cores(2, 2, 2, 2) == 1.0
    a, b, N = 4.16e-3, 25.5e-6, 20000
    assert choose(a, b, N, 4, 1).per_way == 8 and choose(a, b, N, 4, 1, shared=0.5).per_way == 4
    # the term is a lower bound: it never makes a step shorter
    assert all(predicted_step(a, b, N, 4, 1, k, 0.5) >= predicted_step(a, b, N, 4, 1, k) for k in (1, 2, 4, 8, 64))
    assert "share the cores" in choose(a, b, N, 4, 1, shared=0.5).line(4, 1)


def test_one_chunk_a_way_is_predicted_from_its_own_pass():
    """The probes' line through small chunks' rows leaves out their halo rows, which one chunk of the whole graph
    does not read: on a 2-layer GCN and a random 20k-vertex graph (docs/gnnpipe.md) it put one chunk at 35.7 ms
    against a measured pass of 13.6 – 16.2 ms, and chose 4 chunks, 1.5 – 1.9 x slower than one. With the pass over
    one chunk a way measured, ``k = 1`` is predicted from it (the others still from the line)."""
    a, b, N = 1.11e-3, 1.73e-6, 20000
    assert choose(a, b, N, 2, 1).per_way == 4
    c = choose(a, b, N, 2, 1, whole=16.2e-3)
    assert c.per_way == 1 and c.predicted[1] == pytest.approx(16.2e-3)
    assert c.predicted[4] == pytest.approx(choose(a, b, N, 2, 1).predicted[4])
    assert "one chunk a way 16.2 ms, measured" in c.line(2, 1)
    # a deep model, where one chunk's pass is long: the bubble is worth chunks (the 16-layer GCNII's fit and pass)
    assert choose(8.92e-3, 9.74e-6, N, 2, 1, whole=0.262).per_way == 4
    # measured over the first of W contiguous chunks (a way's share), where it runs; a failure leaves the line
    seen = []
    assert chunk_cost.measure_whole(lambda perm, ptr: seen.append(ptr.tolist()) or 0.5, 100, 4) == 0.5
    assert seen == [[0, 25, 50, 75, 100]]

    def fails(perm, ptr):
        raise RuntimeError("out of memory")
    assert chunk_cost.measure_whole(fails, 100, 1) is None and chunk_cost.measure_whole(None, 100, 1) is None
    # a pass that fails is said in the line, the line's prediction standing for one chunk
    chunks, line, _ = chunk_cost.auto_chunks(lambda perm, ptr: a + b * int(ptr[1] - ptr[0]), N, 2, 1, 8, whole_of=fails)
    assert chunks == 4 and "one chunk a way could not be timed (RuntimeError: out of memory)" in line
    chunks, line, predicted = chunk_cost.auto_chunks(lambda perm, ptr: a + b * int(ptr[1] - ptr[0]), N, 2, 1, 8,
                                                     whole_of=lambda perm, ptr: 16.2e-3)
    assert (chunks, predicted) == (1, pytest.approx(16.2e-3)) and "one chunk a way" in line
    # under a memory budget that scales the probes down (scale > 1) the whole way's pass is not run
    chunks, line, _ = chunk_cost.auto_chunks(lambda perm, ptr: a + b * int(ptr[1] - ptr[0]), N, 2, 1, 8, scale=2,
                                             whole_of=fails)
    assert "one chunk a way" not in line


def test_a_model_that_cannot_be_timed_gets_the_fixed_rule():
    def costs(perm, ptr):
        raise RuntimeError("cannot time this layer")
    chunks, line, predicted = chunk_cost.auto_chunks(costs, 100, 2, 1, 8)
    assert chunks == 8 and predicted is None
    assert "could not time" in line and "cannot time this layer" in line and "num_chunks=<int>" in line


def test_knob_is_checked():
    PipelineConfig(num_chunks="auto").validate()
    with pytest.raises(ValueError, match="'auto'"):
        PipelineConfig(num_chunks="many").validate()


def _worker(rank, world):
    x, edge_index, y, mask = small_graph()
    comm = Comm(torch.device("cpu"))
    # every process of this test runs on this machine: p = world, of one thread each (tests/dist.py)
    cores = len(os.sched_getaffinity(0))
    assert chunk_cost.machine_share(comm, 0) == chunk_cost.shared_cores(world, world, 1, cores)
    original = chunk_cost.measure
    try:
        torch.manual_seed(0)
        model = make_model("gcnii")
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks="auto"), comm, num_stages=world)
        engine.install()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(2):
            forward_backward(model, opt, x, edge_index, y, mask)
            opt.step()
        C, predicted = engine.plan.num_chunks, engine.plan.predicted_step
        counts = comm.all_gather_objects((C, predicted), "test")
        assert counts[0] == counts[1] and C in (1, 2, 4, 8, 16, 32, 60), counts
        assert predicted is not None and predicted > 0  # the step predicted for that count, also broadcast
        if rank == 0:  # (the rank that measured says what it chose, and why)
            assert any("num_chunks='auto'" in n and f"'auto': {C} chunk" in n for n in engine.notes), engine.notes
        state = engine.state_dict()
        engine.uninstall()

        # a resume reuses the saved count: nothing is measured again
        def no_measure(*_):
            raise AssertionError("measured again on resume")
        chunk_cost.measure = no_measure
        resumed = GNNPipeEngine(make_model("gcnii"), PipelineConfig(num_chunks="auto"), comm, num_stages=world)
        resumed.load_state_dict(state)
        resumed.install()
        forward_backward(resumed.module, torch.optim.SGD(resumed.module.parameters(), lr=0.01), x, edge_index, y, mask)
        assert resumed.plan.num_chunks == C and resumed.plan.predicted_step is None  # (nothing chosen again)
        resumed.uninstall()

        # a choice an earlier engine of the strategy made (validate, fit, test) is taken, measuring nothing
        again = GNNPipeEngine(make_model("gcnii"), PipelineConfig(num_chunks="auto"), comm, num_stages=world)
        again.chunk_choice = (C, predicted)
        again.install()
        forward_backward(again.module, torch.optim.SGD(again.module.parameters(), lr=0.01), x, edge_index, y, mask)
        assert (again.plan.num_chunks, again.plan.predicted_step) == (C, predicted)
        again.uninstall()

        # an integer overrides it
        fixed = GNNPipeEngine(make_model("gcnii"), PipelineConfig(num_chunks=6), comm, num_stages=world)
        fixed.install()
        forward_backward(fixed.module, torch.optim.SGD(fixed.module.parameters(), lr=0.01), x, edge_index, y, mask)
        assert fixed.plan.num_chunks == 6 and fixed.plan.predicted_step is None
        fixed.uninstall()
    finally:
        chunk_cost.measure = original


def test_auto_is_one_count_on_every_rank_and_saved():
    run_distributed(_worker, 2, timeout=240)
