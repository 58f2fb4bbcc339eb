"""``grid="auto"`` (pyg_pipe/engine/plan/grid_cost.py): the step predicted for each stages x ways x chunks,
the choice from it, the halo count it uses, and the engine's use of it: one grid on every rank, decided once
(a resume and a later engine of the strategy measure nothing), and fixed grids left alone."""
import pytest
import torch

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from pyg_pipe.engine.plan import grid_cost
from pyg_pipe.engine.plan.grid_cost import GridCosts, candidates, choose, halo_rows, predicted_step
from tests.dist import run_distributed
from tests.models import forward_backward, make_model, small_graph


def costs(halo=(0, 1000, 1500), **kw):
    """A 10,000-vertex graph whose ways 1, 2, 4 read ``halo`` rows from the others; a way's pass (timed whole, with
    its exchanges) costs as much as a chunk of its rows and its halo, and the exchanges at the link's speed."""
    N, a, b, alpha, beta, h = 10000, 0.01, 1e-5, 1e-4, kw.get("beta", 1e9), 3840.0
    exchanges = [2 * 15 * alpha + 2 * H * h / beta for H in halo]
    base = dict(num_nodes=N, a=a, b=b, alpha=alpha, beta=beta, h=h, sites=15, c=512.0, p=1e6,
                halos=dict(zip((1, 2, 4), halo)),
                ways={W: a + b * (N / W + halo[j]) + exchanges[j] for j, W in enumerate((1, 2, 4))}, shared=0.0,
                overlap=True)
    return GridCosts(**{**base, **kw})


def test_the_step_formula():
    m = costs()
    t = lambda r: m.a + m.b * r  # noqa: E731
    # one stage, two ways: the ways' pass as timed (with its exchanges and the weight gradients')
    assert predicted_step(m, 1, 2, 1) == pytest.approx(m.ways[2])
    # two stages of two ways, two chunks a way (not timed): a chunk's pass and its share of the halo exchanges,
    # the first chunk's values crossing the cut, the weight all-reduce
    halo = 2 * (15 / 2) * m.alpha + 2 * (1000 / 2) * (3840 / 2) / m.beta
    cut = 2 * (m.alpha + 2500 * 512 / m.beta)
    assert predicted_step(costs(halo=(0, 1000, 1000)), 2, 2, 2) == pytest.approx(
        (t(2500) / 2 + halo) * 3 + cut + 2 * 0.5 * (m.p / 2) / m.beta)
    # ... where the ways' timed pass showed what an exchanging call costs beyond its compute and bytes, that
    call = grid_cost.exchange_call(m.ways[2] + 0.03, m.a + m.b * 5000, 1000 * 3840 / m.beta, 15, m.alpha)
    assert call > m.alpha
    e = 2 * (15 / 2) * call + 2 * (1000 / 2) * (3840 / 2) / m.beta
    assert predicted_step(costs(halo=(0, 1000, 1000), calls={2: call}), 2, 2, 2) == pytest.approx(
        (t(2500) / 2 + e) * 3 + cut + 2 * 0.5 * (m.p / 2) / m.beta)
    assert grid_cost.exchange_call(0.01, 0.02, 0.0, 15, m.alpha) == m.alpha  # (never below the link's latency)
    # processes sharing cores: at least the machine's share of all the work (a timed way's pass shared it already)
    assert predicted_step(costs(shared=1.0), 2, 1, 4) == pytest.approx(1 * 4 * t(2500))
    assert predicted_step(costs(shared=1.0), 1, 2, 1) == pytest.approx(predicted_step(m, 1, 2, 1))
    # two stages, one way, four chunks: 5 ticks of half a chunk's pass (the link is shorter: overlapped), and the
    # first chunk's crossing of the cut, forward and backward
    link = 2 * (m.alpha + 2500 * 512 / m.beta)
    assert predicted_step(m, 2, 1, 4) == pytest.approx(t(2500) / 2 * 5 + link)
    # without overlap the link adds to every tick
    assert predicted_step(costs(overlap=False), 2, 1, 4) == pytest.approx((t(2500) / 2 + link) * 5)
    # a link slower than the compute sets the pace
    slow = costs(beta=1e6)
    assert predicted_step(slow, 2, 1, 4) == pytest.approx(2 * (slow.alpha + 2500 * 512 / 1e6) * 6)


def test_candidates():
    assert {(S, W) for S, W, _ in candidates(4, 16, 1000, None, True)} == {(4, 1), (2, 2), (1, 4)}
    assert [k for S, W, k in candidates(4, 16, 1000, None, True) if S == 1] == [1]  # one stage: no bubble
    assert max(k for _, _, k in candidates(4, 16, 1000, None, True)) == 64
    assert {(S, W) for S, W, _ in candidates(4, 2, 1000, None, True)} == {(2, 2), (1, 4)}  # a stage a layer
    assert {(S, W) for S, W, _ in candidates(4, 16, 1000, None, False)} == {(4, 1)}  # late_gradients: no ways
    assert candidates(4, 16, 1000, 6, True) == [(4, 1, 6), (2, 2, 3)]  # num_chunks=6: the ways must divide it
    assert candidates(4, 16, 1000, 8, True) == [(4, 1, 8), (2, 2, 4), (1, 4, 2)]


def test_the_choice_follows_the_link():
    # a fast link: graph parallelism (one chunk a way: exact) is as fast as the best pipeline
    fast = choose(costs(), candidates(2, 16, 10000, None, True))
    assert (fast.stages, fast.ways, fast.per_way) == (1, 2, 1)
    # a slow link with a large halo: the pipeline, whose link carries only the cut's rows
    slow = choose(costs(beta=2e7, halo=(0, 5000, 5000)), candidates(2, 16, 10000, None, True))
    assert (slow.stages, slow.ways) == (2, 1) and slow.per_way > 1
    # the choice is the fewest chunks a way within 10 % of the fastest
    best = min(slow.predicted.values())
    assert slow.predicted[(2, 1, slow.per_way)] <= 1.1 * best
    assert all(v > 1.1 * best for (S, W, k), v in slow.predicted.items() if k < slow.per_way)
    assert "grid='auto': 2 stages x 1 way" in slow.line() and "GB/s" in slow.line()


def test_under_a_memory_room_the_choice_is_among_the_grids_that_fit():
    options = candidates(2, 16, 10000, None, True)
    fast = choose(costs(), options)
    assert (fast.stages, fast.ways, fast.per_way) == (1, 2, 1)  # (the time alone: graph parallelism)
    # graph parallelism holds the whole model's activations over half the vertices: estimated not to fit, while
    # the pipeline from 4 chunks on does
    peaks = {o: (900 if o[1] == 2 else 800 // o[2] + 300) for o in options}
    tight = choose(costs(), options, room=600, peaks=peaks)
    assert (tight.stages, tight.ways) == (2, 1) and peaks[(2, 1, tight.per_way)] <= 600
    assert tight.per_way == min(k for S, W, k in options if W == 1 and peaks[(S, W, k)] <= 600 and
                                tight.predicted[(S, W, k)] <= 1.1 * min(tight.predicted[o] for o in options
                                                                         if peaks[o] <= 600))
    assert "candidates' first steps are estimated to fit" in tight.line()
    # nothing fits: the time alone decides, and the line says so
    none = choose(costs(), options, room=10, peaks=peaks)
    assert (none.stages, none.ways, none.per_way) == (1, 2, 1) and "no candidate's first step" in none.line()


def test_halo_rows_counts_the_most_loaded_way():
    # two triangles joined by the edges 2 -> 3, 4 -> 0 and 5 -> 0: parts {0, 1, 2} and {3, 4, 5}
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5, 2, 4, 5], [1, 2, 0, 4, 5, 3, 3, 0, 0]])
    ptr = torch.tensor([0, 3, 6])
    assert halo_rows(torch.arange(6), ptr, edge_index, 6) == 2  # part 0 reads 4 and 5; part 1 reads 2
    assert halo_rows(torch.tensor([3, 4, 5, 0, 1, 2]), ptr, edge_index, 6) == 2  # (numbered the other way)
    assert halo_rows(torch.arange(6), torch.tensor([0, 6]), edge_index, 6) == 0


def test_knob_is_checked():
    PipelineConfig(grid="auto").validate()
    with pytest.raises(ValueError, match="grid='stages'.*'pipeline'.*'auto'"):
        PipelineConfig(grid="stages").validate()
    import pyg_pipe
    with pytest.raises(ValueError, match="fixes the grid"):
        pyg_pipe.HybridStrategy(stages=2, ways=1, grid="auto")


def _worker(rank, world):
    x, edge_index, y, mask = small_graph()
    comm = Comm(torch.device("cpu"))
    alpha, beta = grid_cost.measure_link(comm)
    assert alpha >= 0 and beta > 0
    original = grid_cost.measure_link
    try:
        torch.manual_seed(0)
        engine = GNNPipeEngine(make_model("gcnii"), PipelineConfig(grid="auto"), comm)
        engine.install()
        opt = torch.optim.SGD(engine.module.parameters(), lr=0.01)
        for _ in range(2):
            forward_backward(engine.module, opt, x, edge_index, y, mask)
            opt.step()
        plan = engine.plan
        got = comm.all_gather_objects((plan.stages, plan.ways, plan.num_chunks, engine.grid_choice), "test")
        assert got[0] == got[1] and got[0][3] == (plan.stages, plan.ways), got
        if rank == 0:  # the rank that measured says what it chose, and why, and keeps every prediction
            assert any(n.startswith(f"pyg_pipe: grid='auto': {plan.stages} stage") for n in engine.notes)
            assert engine.grid_report.predicted[(plan.stages, plan.ways, plan.num_chunks // plan.ways)] > 0
        state = engine.state_dict()
        engine.uninstall()

        def no_measure(*_):
            raise AssertionError("measured again")
        grid_cost.measure_link = no_measure
        # a resume takes the saved grid; a later engine of the strategy (validate, fit, test) the earlier choice
        resumed = GNNPipeEngine(make_model("gcnii"), PipelineConfig(grid="auto"), comm)
        resumed.load_state_dict(state)
        again = GNNPipeEngine(make_model("gcnii"), PipelineConfig(grid="auto"), comm)
        again.grid_choice = engine.grid_choice
        for e in (resumed, again):
            e.install()
            forward_backward(e.module, torch.optim.SGD(e.module.parameters(), lr=0.01), x, edge_index, y, mask)
            assert (e.plan.stages, e.plan.ways) == (plan.stages, plan.ways)
            e.uninstall()
        # a grid given (HybridStrategy's stages=, ways=) is not chosen again
        fixed = GNNPipeEngine(make_model("gcnii"), PipelineConfig(grid="auto", num_chunks=4), comm, num_stages=1,
                              ways=2)
        fixed.install()
        forward_backward(fixed.module, torch.optim.SGD(fixed.module.parameters(), lr=0.01), x, edge_index, y, mask)
        assert (fixed.plan.stages, fixed.plan.ways, fixed.grid_choice) == (1, 2, None)
        fixed.uninstall()
    finally:
        grid_cost.measure_link = original


def _slow_link_worker(rank, world):
    """Every rank runs the grid the choice names, with the chunks given (num_chunks=4: 2 stages x 4 chunks or 2
    ways x 2 chunks), chosen by the rule (a link given slow: the cost of transfers decides), and trains."""
    x, edge_index, y, mask = small_graph()
    comm = Comm(torch.device("cpu"))
    grid_cost.measure_link = lambda comm, root=0: (1e-3, 1e5)  # (the same answer on every rank)
    torch.manual_seed(0)
    engine = GNNPipeEngine(make_model("gcnii"), PipelineConfig(grid="auto", num_chunks=4), comm)
    engine.install()
    _, loss = forward_backward(engine.module, torch.optim.SGD(engine.module.parameters(), lr=0.01), x, edge_index, y,
                            mask)
    assert torch.isfinite(loss)
    report = comm.all_gather_objects(engine.grid_report, "test")[0]
    S, W = engine.grid_choice
    assert (S, W, engine.plan.num_chunks) == (report.stages, report.ways, 4)
    assert set(report.predicted) == {(2, 1, 4), (1, 2, 2)}
    best = min(report.predicted.values())
    assert report.predicted[(S, W, 4 // W)] <= 1.1 * best
    assert all(v > 1.1 * best for (_, _, k), v in report.predicted.items() if k < 4 // W)
    engine.uninstall()


def _budget_worker(rank, world):
    """With a memory budget, every candidate's first step is estimated (as num_chunks='auto' does under one), the
    choice is among those that fit, and the line says so; the same grid on every rank. Budgets: ample (all fit),
    between the candidates' estimates (some fit: the choice is one of them), and below every one (the time decides)."""
    x, edge_index, y, mask = small_graph()
    comm = Comm(torch.device("cpu"))
    peaks = None
    for kind in ("ample", "between", "tight"):
        budget = {"ample": 1 << 34, "tight": 1 << 10}.get(kind) or sorted(peaks.values())[len(peaks) // 2]
        torch.manual_seed(0)
        engine = GNNPipeEngine(make_model("gcnii"), PipelineConfig(grid="auto", memory_budget=budget), comm)
        engine.install()
        _, loss = forward_backward(engine.module, torch.optim.SGD(engine.module.parameters(), lr=0.01), x,
                                   edge_index, y, mask)
        assert torch.isfinite(loss)
        report = comm.all_gather_objects(engine.grid_report, "test")[0]
        assert report.room == budget and set(report.peaks) == set(report.predicted)
        chosen = (report.stages, report.ways, report.per_way)
        assert engine.grid_choice == chosen[:2]
        fit = [o for o, v in report.peaks.items() if v <= budget]
        assert len(fit) == {"ample": len(report.peaks), "tight": 0}.get(kind, len(fit)), (kind, report.peaks)
        if kind == "between":
            assert 0 < len(fit) < len(report.peaks) and chosen in fit, (budget, report.peaks, chosen)
        if kind == "tight":
            assert "no candidate's first step" in report.line()
        peaks = report.peaks
        engine.uninstall()


def test_a_memory_budget_limits_the_grids_chosen_among():
    run_distributed(_budget_worker, 2, timeout=300)


def test_auto_is_one_grid_on_every_rank_and_saved():
    run_distributed(_worker, 2, timeout=240)


def test_a_chosen_grid_runs():
    run_distributed(_slow_link_worker, 2, timeout=240)


def test_halo_counts_and_the_part_a_rank_probes():
    from pyg_pipe.engine.plan.way_probe import first_part, halo_counts
    # the two triangles above: part 0 reads 4 and 5 from part 1, part 1 reads 2 from part 0
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5, 2, 4, 5], [1, 2, 0, 4, 5, 3, 3, 0, 0]])
    counts = halo_counts(torch.arange(6), torch.tensor([0, 3, 6]), edge_index, 6)
    assert counts.tolist() == [[0, 2], [1, 0]]
    perm, ptr = first_part(torch.tensor([5, 4, 3, 2, 1, 0]), torch.tensor([0, 2, 5, 6]), 1)
    assert perm.tolist() == [3, 2, 1, 5, 4, 0] and ptr.tolist() == [0, 3, 5, 6]


def _swap_worker(rank, world):
    from pyg_pipe.engine.plan.way_probe import Exchangers, _Swap
    comm = Comm(torch.device("cpu"), timeout=60)
    # way 0 holds one vertex that the three other ways all read; each of them holds two and reads one of way 0's
    counts = torch.tensor([[0, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]])
    rows = torch.ones(1 if rank == 0 else 2, 3, requires_grad=True)
    halo = _Swap.apply(rows, Exchangers(comm, counts, 4), 0)
    assert halo.shape == (int(counts[rank].sum()), 3)
    (halo * 2).sum().backward()  # the gradients go back to the rows they were sent from, summed
    assert rows.grad.shape == rows.shape and float(rows.grad.sum()) == 2 * 3 * int(counts[:, rank].sum())
    # the step's own exchanges: every way's output rows in its own count, then the gradients (one parameter has
    # one on one rank only); a count or size that did not match its peer's would fail gloo's receive
    ends = Exchangers(comm, counts, 4, torch.tensor([1, 2, 2, 2]))
    ends.output([torch.ones(1 if rank == 0 else 2, 5)])
    ends.output([torch.ones(3 if rank == 1 else 1, 2, 2)])  # (rows other than the way's count: still meets)
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    used.grad = torch.ones(3)
    if rank == 0:
        unused.grad = torch.ones(2)
    ends.gradients([used, unused])
    assert comm.all_gather_objects("met", "test") == ["met"] * 4


def test_the_probe_exchange_meets_its_peers_both_ways():
    """The ways' timed pass exchanges the partition's counts forward and the gradients back, also where one way's
    rows are read by more peers than it has rows, and then the step's own exchanges (the output rows, in each way's
    count, and the weight gradients)."""
    run_distributed(_swap_worker, 4, timeout=120)


def _failing_worker(rank, world):
    """Faults injected into the measuring: the model failing on one rank's way part leaves graph parallelism out
    (every rank agrees, the pipeline is chosen and trains); the chunk's pass failing on the measuring rank falls
    back to one stage a device on every rank, said in one line. Neither hangs."""
    from pyg_pipe.engine import profile
    x, edge_index, y, mask = small_graph()
    comm = Comm(torch.device("cpu"), timeout=60)
    timed = profile.training_pass_seconds

    def way_fails_on_rank_1(*args, **kwargs):
        if rank == 1 and kwargs.get("halo") is None and args[6:] == (1,):  # (the one pass over a way's part)
            raise RuntimeError("this way's part cannot run")
        return timed(*args, **kwargs)
    profile.training_pass_seconds = way_fails_on_rank_1
    original = grid_cost.measure_pass
    try:
        torch.manual_seed(0)
        engine = GNNPipeEngine(make_model("gcnii"), PipelineConfig(grid="auto"), comm)
        engine.install()
        _, loss = forward_backward(engine.module, torch.optim.SGD(engine.module.parameters(), lr=0.01), x,
                                   edge_index, y, mask)
        assert torch.isfinite(loss) and engine.grid_choice == (2, 1)
        said = comm.all_gather_objects(engine.notes, "test")[0]
        assert any("2 graph-parallel ways left out" in n and "this way's part cannot run" in n for n in said), said
        engine.uninstall()
        profile.training_pass_seconds = timed

        def cannot_time(*_):
            raise RuntimeError("no timing here")
        grid_cost.measure_pass = cannot_time
        engine = GNNPipeEngine(make_model("gcnii"), PipelineConfig(grid="auto"), comm)
        engine.install()
        _, loss = forward_backward(engine.module, torch.optim.SGD(engine.module.parameters(), lr=0.01), x,
                                   edge_index, y, mask)
        assert torch.isfinite(loss) and engine.grid_choice == (2, 1) and engine.plan.stages == 2
        assert any("could not time a training pass" in n and "no timing here" in n for n in engine.notes)
        engine.uninstall()
    finally:
        profile.training_pass_seconds, grid_cost.measure_pass = timed, original


def test_a_failure_while_measuring_leaves_grids_out_or_falls_back():
    run_distributed(_failing_worker, 2, timeout=240)
