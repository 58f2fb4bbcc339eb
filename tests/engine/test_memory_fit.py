"""``num_chunks="auto"`` under a memory budget: the first step's peak estimated before it, the chunk count raised
until it fits (:func:`pyg_pipe.engine.plan.chunk_cost.fit_memory`)."""
import copy
import logging

import torch

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from pyg_pipe.engine.plan import chunk_cost
from pyg_pipe.engine.plan.memory_fit import fit_memory, probe_scale
from pyg_pipe.engine.plan.first_step import (PassMemory, chunking_bytes, first_step_peak, fresh_reads, history_rows,
                                             stage_shares)
from pyg_pipe.engine.pass_memory import training_pass_memory
from pyg_pipe.engine.step.layers import LayerHooks
from pyg_pipe.graph.partition import make_chunks
from pyg_pipe.model.inputs import CallInputs
from pyg_pipe.model.split import stage_groups
from pyg_pipe.model.trace import forward_function, trace
from tests.dist import run_distributed
from tests.models import forward_backward, make_model, small_graph
from tests.zoo import zoo_graph


def test_history_rows_are_the_rows_the_runtime_keeps():
    """The count the estimate takes for the history (both ends of every edge between chunks) is the number of rows
    the runtime's history buffers hold, on a graph of several components."""
    x, g, y, mask = zoo_graph()
    ei = g["edge_index"]
    for chunks in (2, 4, 8):
        torch.manual_seed(0)
        model = make_model("gcn", c_in=x.size(1), c_out=int(y.max()) + 1)
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, balance="layers", streaming=False),
                               Comm(torch.device("cpu")), num_stages=1)
        engine.install()
        try:
            forward_backward(model, torch.optim.SGD(model.parameters(), lr=0.1), x, ei, y, mask)
            rt = engine.runtime
            held = rt.history.rows.numel() if rt.history.rows is not None else x.size(0)
            assert history_rows([ei], rt.plan.perm, rt.plan.ptr, 1) == held, chunks
        finally:
            engine.uninstall()


def test_history_rows_with_ways_count_both_ends_with_an_end_in_the_way():
    ei = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 0]])  # a ring of 6, chunks {0,1} {2,3} {4,5}, 1 a way
    perm, ptr = torch.arange(6), torch.tensor([0, 2, 4, 6])
    assert history_rows([ei], perm, ptr, 1) == 6
    assert history_rows([ei], perm, ptr, 3) == 4  # way 0: 1->2 and 5->0 cross, ends 1, 2, 5, 0


def _pass_memory(model, x, ei, chunks: int = 4):
    """:func:`training_pass_memory` of ``model`` over the first of ``chunks`` chunks, and the model's layer groups."""
    inputs = CallInputs((x, ei), {})
    program = trace(model, inputs.args, inputs.kwargs)
    groups, _ = stage_groups(program)
    N = x.size(0)
    perm, ptr = make_chunks(ei, N, chunks)
    hooks = LayerHooks(model)
    hooks.install()
    try:
        return training_pass_memory(model, forward_function(model), program, groups, inputs, torch.device("cpu"),
                                    (perm, ptr), (perm, torch.tensor([0, N]))), groups
    finally:
        hooks.remove()


def test_a_pass_measures_what_crosses_a_cut_and_the_sites_and_changes_nothing():
    """PyG's GCN (4 layers, hidden 16, 3 classes): one hidden value (16 floats a row) crosses every cut between
    layers; the three layers that do not read the inputs join halo rows of what they propagate (``GCNConv``
    propagates ``lin(x)``: 16, 16 and 3 floats); autograd saves something for every row. The pass leaves no
    gradient, running statistic or random stream changed."""
    x, g, y, _ = zoo_graph()
    model = make_model("gcn", c_in=x.size(1), c_out=3)
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    m, _ = _pass_memory(model, x, g["edge_index"])
    assert m.boundary == 16 * 4
    assert m.history == (16 + 16 + 3) * 4
    assert m.saved > 16 * 4 and m.params == sum(p.numel() * 4 for p in model.parameters())
    assert m.cache > 0 and m.way_cache > 0
    assert torch.equal(torch.get_rng_state(), rng) and all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_the_measuring_pass_leaves_no_activation_alive():
    """The pass records a graph it never runs backward; the storages autograd saves are counted by a pack hook,
    which must not hand back a saved output itself (it would hold its own ``grad_fn``: a cycle through autograd's
    nodes that Python's collector cannot free, which kept a chunk's activations for the whole run)."""
    import gc
    x, g, _, _ = zoo_graph()
    model = make_model("gcnii", c_in=x.size(1), c_out=3)  # (GCN2Conv stack: relu saves its output)

    def graphs():
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)

    before = graphs()
    m, _ = _pass_memory(model, x, g["edge_index"])
    assert m.saved > 0 and graphs() == before


def _estimates(m, graphs, N, stages, counts, offloaded=False):
    """The first step's estimated peak for each count of chunks a way, contiguous chunks."""
    out = {}
    for k in counts:
        perm, ptr = torch.arange(N), torch.linspace(0, N, k + 1).round().long()
        structures, edges = chunking_bytes(graphs, perm, ptr, 1)
        out[k] = first_step_peak(m, N, stages, 1, k, structures, edges, history_rows(graphs, perm, ptr, 1),
                                 0 if offloaded else 2, offloaded=offloaded,
                                 pending_rows=fresh_reads(graphs, perm, ptr)).peak  # (one way: fresh reads)
    return out


def test_the_count_is_raised_to_the_fewest_chunks_whose_first_step_fits(caplog):
    """Given a chunk's measures (here fixed: the decision, not the probe, is under test), the time model's count is
    doubled until the estimate fits the budget; where no count fits, the history goes to host memory if that
    fits (the fewest chunks that do), else the time model's count stays and a warning names the fix; without a
    budget on a CPU nothing changes."""
    x, edge_index, _, _ = small_graph(num_nodes=240, num_edges=960)
    N = x.size(0)
    inputs = CallInputs((x, edge_index), {})
    m = PassMemory(saved=40_000.0, boundary=128.0, history=2048.0, cache=16.0, way_cache=16.0, params=4096.0)
    counts = (2, 4, 8, 16, 32, 64)
    est = _estimates(m, [edge_index], N, 2, counts)
    off = _estimates(m, [edge_index], N, 2, counts, offloaded=True)
    assert est[2] > est[4] > est[8]  # (the activations of a chunk shrink faster than the history grows here)
    assert all(off[k] < est[k] for k in counts)
    comm = Comm(torch.device("cpu"))

    def cut(n):
        return torch.arange(N), torch.linspace(0, N, n + 1).round().long()

    def run(budget, **knobs):
        config = PipelineConfig(num_chunks="auto", memory_budget=budget, **knobs)
        notes = []
        return fit_memory(m, budget, config, inputs, 2, 1, 2, *cut(2), cut, comm, 0, notes), notes

    got, notes = run((est[4] + est[8]) // 2)
    assert (got.chunks, got.peak, got.offload) == (8, est[8], None) and torch.equal(got.ptr, cut(8)[1])
    assert "it fits (the 2 chunks the time model chose would not)" in notes[0]
    got, notes = run(est[2] + 1)
    assert (got.chunks, got.peak, got.offload) == (2, est[2], None) and "it fits." in notes[0]
    floor = min(est.values())  # no count fits on the device; with the history in host memory the fewest that fit
    got, notes = run(floor - 1)
    want = min(k for k in counts if off[k] <= floor - 1)
    assert (got.chunks, got.peak, got.offload) == (want, off[want], "host"), (got, off, est)
    assert torch.equal(got.ptr, cut(want)[1]) and "offload='host', chosen here" in notes[0]
    got, notes = run(floor - 1, offload="disk")  # (a tier the user set is kept: then nothing more to move)
    assert got.offload is None
    with caplog.at_level(logging.WARNING, logger="pyg_pipe"):
        got, notes = run(1000)
    assert (got.chunks, got.peak, got.offload) == (2, est[2], None) and torch.equal(got.ptr, cut(2)[1])
    assert "does not fit" in notes[0] and "more devices" in notes[0] and "does not fit" in caplog.text
    assert fit_memory(m, None, PipelineConfig(num_chunks="auto"), inputs, 2, 1, 2, *cut(2), cut, comm, 0).peak \
        is None


def test_under_a_tight_budget_the_time_model_times_smaller_chunks():
    """The time model's larger probe holds the whole model's activations over N / (2 S W) rows; where that is more
    than half the room its chunks are made smaller, by powers of 2 (and the timing then samples those)."""
    m = PassMemory(saved=1000.0, boundary=0.0, history=0.0, cache=0.0, way_cache=0.0, params=0.0)
    N, S, W = 8000, 2, 1                     # the larger probe: 2000 rows, 2 MB
    assert probe_scale(m, 10 ** 7, N, S, W) == 1
    assert probe_scale(m, 2 * 10 ** 6, N, S, W) == 2
    assert probe_scale(m, 10 ** 6, N, S, W) == 4
    assert probe_scale(m, 1, N, S, W) == 2048  # (down to a row)
    rows = []

    def seconds_of(perm, ptr):
        rows.append(int(ptr[1] - ptr[0]))
        return 1e-3 * (1 + rows[-1] / 100)
    chunk_cost.measure(seconds_of, N, S, W, scale=4)
    assert rows == [N // (2 * 2 * 4), N // (8 * 2 * 4)]


def _worker(rank, world):
    x, edge_index, y, mask = small_graph()
    comm = Comm(torch.device("cpu"))
    torch.manual_seed(0)
    model = make_model("gcnii")
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks="auto", memory_budget=10 ** 10), comm, num_stages=world)
    engine.install()
    try:
        forward_backward(model, torch.optim.SGD(model.parameters(), lr=0.01), x, edge_index, y, mask)
        plan = engine.plan
        got = comm.all_gather_objects((plan.num_chunks, plan.first_step_peak), "test")
        assert got[0] == got[1] and got[0][1] is not None and got[0][1] > 0, got
        if rank == 0:
            assert any("the first step with" in n and "it fits" in n for n in engine.notes), engine.notes
    finally:
        engine.uninstall()


def test_under_a_budget_the_estimate_is_one_on_every_rank():
    run_distributed(_worker, 2, timeout=240)


def _chosen_tier(rank, world):
    """The plan's choice of the host tier (``num_chunks="auto"`` when only the history off the device fits) reaches
    the runtime, is saved with the plan and taken back on a resume, and changes no result."""
    x, edge_index, y, mask = small_graph()
    comm = Comm(torch.device("cpu"))
    runs = {}
    for offload in (None, "host"):
        torch.manual_seed(0)
        model = make_model("gcnii")
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks="auto"), comm, num_stages=world)
        engine.chunk_choice = (4, None, offload)  # (as an earlier engine of the strategy decided it)
        engine.install()
        try:
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            outs = []
            for _ in range(3):
                out, _ = forward_backward(model, opt, x, edge_index, y, mask)
                opt.step()
                outs.append(None if out is None else out.detach())
            assert engine.plan.offload == offload and engine.runtime.tiers.offload == offload
            assert engine.state_dict()["plan"]["offload"] == offload
            runs[offload] = (outs, [p.detach().clone() for p in model.parameters()], engine.state_dict())
        finally:
            engine.uninstall()
    for a, b in zip(runs[None][0] + runs[None][1], runs["host"][0] + runs["host"][1]):
        assert (a is None and b is None) or torch.equal(a, b)
    resumed = GNNPipeEngine(make_model("gcnii"), PipelineConfig(num_chunks="auto"), comm, num_stages=world)
    resumed.load_state_dict(runs["host"][2])
    resumed.install()
    try:
        forward_backward(resumed.module, torch.optim.SGD(resumed.module.parameters(), lr=0.05), x, edge_index, y,
                         mask)
        assert resumed.plan.offload == "host" and resumed.runtime.tiers.offload == "host"
    finally:
        resumed.uninstall()


def test_the_host_tier_the_plan_chose_is_used_saved_and_changes_nothing():
    run_distributed(_chosen_tier, 2, timeout=240)


class _Uneven(torch.nn.Module):
    """PyG's ``GCNConv`` four times, two wide layers then two narrow ones: split by layer count, the first stage
    holds several times what the second does."""

    def __init__(self, c_in=8, wide=96, narrow=4, c_out=3):
        super().__init__()
        from torch_geometric.nn import GCNConv
        dims = [c_in, wide, wide, narrow, narrow]
        self.convs = torch.nn.ModuleList(GCNConv(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.out = torch.nn.Linear(narrow, c_out)

    def forward(self, x, edge_index):
        for conv in self.convs:
            x = conv(x, edge_index).relu()
        return self.out(x)


def test_the_pass_tells_each_group_what_it_saved_its_sites_and_what_crosses_each_cut():
    """The group-by-group detail of a training pass adds up to its totals: every storage saved is some group's, the
    sites' widths sum to a history row, the widest cut is the boundary."""
    x, g, y, _ = zoo_graph()
    m, groups = _pass_memory(_Uneven(c_in=x.size(1)), x, g["edge_index"])
    d = m.detail
    assert len(d.saved) == len(groups) == 4 and len(d.crossing) == 3
    union = {}
    for found in d.saved + [d.out]:
        union.update(found)
    assert sum(union.values()) / d.rows == m.saved
    # (lin(x) propagated; the first layer reads the inputs, whose halo rows it computes: no history there)
    assert sum(d.widths) == m.history and d.widths == [0, 96 * 4, 4 * 4, 4 * 4]
    assert max(sum(c.values()) for c in d.crossing) / d.rows == m.boundary
    wide, narrow = stage_shares(m, [2, 2], [1.0, 1.0])
    assert wide.a > 1.5 * narrow.a and wide.h > 10 * narrow.h and wide.b == 0 and narrow.b == 96 * 4  # (received)
    mean = stage_shares(m, None, [1.0, 1.0])[0]
    assert narrow.a < mean.a < wide.a
    # the drain's working set: the stage's widest group's saved bytes (without the split: the widest of all)
    per_group = [sum(found.values()) / d.rows for found in d.saved]
    assert wide.working == max(per_group[:2]) < wide.a and narrow.working == max(per_group[2:])
    assert mean.working == max(per_group)


def _widest(rank, world):
    """Under a budget the first step's estimate is the widest stage's: within 7 % of the memory model's counted peak
    of the process that holds the most after the step (the other one holds less than half of it), where the mean
    stage's was 12 % short. The budget fits any count, so the plan keeps the time model's, which is timed and so
    differs from run to run on a loaded machine (1 - 16 chunks seen): it is set to 4 here (at 2 the estimate is
    1.10 of the counted peak: on the safe side, but outside this bound)."""
    from pyg_pipe.engine.plan import plan as plan_module
    from pyg_pipe.engine.plan.memory_cost import predict
    timed = plan_module.choose_chunks
    plan_module.choose_chunks = lambda *args, **kwargs: (4, timed(*args, **kwargs)[1])
    x, edge_index, y, mask = small_graph(num_nodes=3000, num_edges=12000)
    comm = Comm(torch.device("cpu"))
    torch.manual_seed(0)
    model = _Uneven(wide=256)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks="auto", memory_budget=10 ** 10, balance="layers",
                                                 recompute=True), comm, num_stages=world)
    engine.install()
    try:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        forward_backward(model, opt, x, edge_index, y, mask)
        opt.step()
        p = predict(engine.runtime, model.parameters(), [opt])
        counted = comm.all_gather_objects(p.resident + p.state + p.held(True) + p.transient, "test")
        est = engine.plan.first_step_peak
        widest = [n for n in engine.notes if "the first step with" in n]
        if rank == 0:
            assert counted[0] > 2 * counted[1], counted
            assert 0.93 < est / counted[0] < 1.07, (est, counted)  # (measured 1.00; the mean stage: 0.88)
            assert "(stage 0, the widest)" in widest[0], widest
            assert engine.plan.chunks_per_way == 4
    finally:
        engine.uninstall()
        plan_module.choose_chunks = timed


def test_under_a_budget_the_first_step_is_estimated_for_the_widest_stage():
    run_distributed(_widest, 2, timeout=240)
