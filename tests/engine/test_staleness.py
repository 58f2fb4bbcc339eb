"""The staleness policy, checked where stale rows differ from fresh ones: the chunked training forward
with a learning rate > 0 equals a reference that reads exactly what the policy says.

The reference is plain PyTorch on the whole graph, written from the algorithm's definition
(``docs/gnnpipe.md``), not from the engine's data structures. For every layer that reads computed
rows it keeps a |V|-row history ``H``:

* before the first step, ``H`` holds the exact layer inputs (an exact pass with the initial weights);
* at the start of step ``t``, T2: when ``t % R == 0`` ``H`` is copied to a snapshot, otherwise ``H`` is
  restored from the snapshot;
* smoothing (when on): then ``H`` is replaced by the average ``S ← γ·S + (1-γ)·H`` (``S = H`` at the
  first step);
* T1: the chunks of every way run in the order ``randperm(C / W)`` seeded with ``seed·1000003 + t`` at an
  even step ``t``, and in the reverse of step ``t - 1``'s order at an odd one;
  at each position the chunks of all ways at that position run together, layer by layer: their fresh
  rows are written into ``H`` and each layer reads its input rows from ``H`` (fresh for chunks that ran
  earlier in the step or at the same position on another way, the snapshot's otherwise);
* the first layer reads the input features, which are always true.

The staleness meter (:mod:`pyg_pipe.engine.runtime.staleness`) is checked against the same reference: per
step and per layer that reads history, the relative drift of the stale rows read (rows whose owner
chunk runs later in the order: ``‖H_end − H_read‖ / ‖H_end‖`` over them, a row read by two chunks
counted twice), the share of halo reads that were stale and their age in optimizer updates.

Each step the reference gets the engine's current weights (so the gradient policy, tested in
``test_backward.py``, plays no part) and its own history; with lr > 0 the weights change every step,
so a wrong order, a missing write, a wrong snapshot step or a restore of the wrong version makes the
outputs differ. One process (1 stage x 1 way, 4 chunks) and 2 stages x 2 ways (8 chunks).
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GraphConv, SAGEConv

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from tests.dist import run_distributed
from tests.harness import ranges
from tests.zoo import zoo_graph

PERIOD, STEPS, SEED = 3, 7, 5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = GraphConv(8, 12)
        self.conv2 = SAGEConv(12, 12)
        self.conv3 = GraphConv(12, 3)

    def forward(self, x, edge_index):
        h = self.conv1(x, edge_index).relu()
        h = self.conv2(h, edge_index).relu()
        return self.conv3(h, edge_index)


class Reference:
    """GNNPipe's forward with history, on the whole graph (see the module docstring)."""

    def __init__(self, model: Net, x, edge_index, ptr, ways: int, smoothing=None):
        self.model, self.x, self.edge_index = model, x, edge_index
        self.smoothing, self.average = smoothing, None
        self.ptr, self.ways = ptr.tolist(), ways
        self.cpw = (len(self.ptr) - 1) // ways
        with torch.no_grad():  # history starts at the exact layer inputs
            h1 = model.conv1(x, edge_index).relu()
            self.history = [h1, model.conv2(h1, edge_index).relu()]
        self.snapshot = None
        self.origin = self.snapshot_origin = 0  # the step whose weights computed the history's / snapshot's rows
        self.meter = None                       # the last step's (drift per layer, stale share, age)

    def forward(self, step: int) -> torch.Tensor:
        m, x, ei = self.model, self.x, self.edge_index
        if step % PERIOD == 0 or self.snapshot is None:
            self.snapshot = [h.clone() for h in self.history]
            self.snapshot_origin = self.origin
            age = step - self.origin
        else:
            self.history = [s.clone() for s in self.snapshot]
            age = step - self.snapshot_origin
        if self.smoothing is not None:  # smoothing: the rows a step starts with are averaged over steps
            g = self.smoothing
            self.average = [h.clone() for h in self.history] if self.average is None else \
                [g * a + (1 - g) * h for a, h in zip(self.average, self.history)]
            self.history = [a.clone() for a in self.average]
        read = [h.clone() for h in self.history]   # what a stale read sees
        drawn = step - step % 2  # T1's pairs: an order, then its reverse
        order = torch.randperm(self.cpw, generator=torch.Generator().manual_seed(SEED * 1_000_003 + drawn)).tolist()
        order = order[::-1] if step % 2 else order
        position = torch.empty(x.size(0), dtype=torch.long)  # each vertex's chunk's position in its way's order
        for pos, k in enumerate(order):
            for w in range(self.ways):
                c = w * self.cpw + k
                position[self.ptr[c]:self.ptr[c + 1]] = pos
        stale_ids, halo_reads = [], 0
        for c in range(len(self.ptr) - 1):
            inside = lambda v: (v >= self.ptr[c]) & (v < self.ptr[c + 1])  # noqa: E731
            src, dst = ei
            halo = torch.unique(src[inside(dst) & ~inside(src)])
            halo_reads += halo.numel()
            stale_ids.append(halo[position[halo] > position[self.ptr[c]]])
        out = torch.zeros(x.size(0), 3, dtype=x.dtype)
        with torch.no_grad():
            h1 = m.conv1(x, ei).relu()  # reads the inputs: always true
            for k in order:
                rows = torch.cat([torch.arange(self.ptr[c], self.ptr[c + 1])
                                  for c in (w * self.cpw + k for w in range(self.ways))])
                self.history[0][rows] = h1[rows]
                h2 = m.conv2(self.history[0], ei).relu()
                self.history[1][rows] = h2[rows]
                out[rows] = m.conv3(self.history[1], ei)[rows]
        ids = torch.cat(stale_ids)
        drift = [float((h[ids] - r[ids]).norm() / h[ids].norm()) for h, r in zip(self.history, read)]
        self.meter = (drift, ids.numel() / halo_reads, age if ids.numel() else 0)
        self.origin = step
        return out


def _setup(stages, ways, chunks, **cfg):
    """float64 from here on; the zoo graph, the model and its installed engine (T2 every PERIOD steps)."""
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph()
    torch.manual_seed(0)
    model = Net()
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, partition=ranges, snapshot_period=PERIOD,
                                                 seed=SEED, balance="layers", streaming=False, **cfg),
                           Comm(torch.device("cpu"), timeout=60), num_stages=stages, ways=ways)
    engine.install()
    return x, g["edge_index"], y, mask, model, engine


def _worker(rank, world, stages, ways, chunks, **cfg):
    x, ei, y, mask, model, engine = _setup(stages, ways, chunks, **cfg)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    reference = None
    for step in range(STEPS):
        weights = _gathered(model, engine)
        if reference is None:
            reference = Reference(weights, x, ei, ranges(ei, x.size(0), chunks)[1], ways, cfg.get("smoothing"))
        reference.model.load_state_dict(weights.state_dict())
        want = reference.forward(step)
        out = model(x, ei)
        torch.testing.assert_close(out, want, atol=1e-9, rtol=0, msg=f"training forward at step {step}")
        opt.zero_grad()
        F.cross_entropy(out[mask], y[mask]).backward()
        opt.step()
        _check_meter(engine, reference.meter, step)
    assert engine.runtime.history.of(0).initialised
    engine.uninstall()


def _check_meter(engine, want, step):
    """The meter's step, summed over the ranks, against the reference's."""
    from pyg_pipe.engine.runtime.staleness import summarize
    entries = engine.meter.take()
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, entries)
        entries = [e for rank in gathered for e in rank]
    got = summarize(entries)
    drift, share, age = want
    sites = sorted(k for k in got if k.startswith("drift/"))
    assert [k.split("/")[1].split("#")[0].split(":")[0] for k in sites] == ["conv2", "conv3"], sites
    for k, d in zip(sites, drift):
        assert abs(got[k] - d) < 1e-9, (step, k, got[k], d)
    assert step == 0 or drift[0] > 0  # the weights moved: the meter has something to measure
    assert abs(got["max_drift"] - max(drift)) < 1e-9
    assert abs(got["stale_share"] - share) < 1e-12, (step, got["stale_share"], share)
    assert got["mean_age"] == age, (step, got["mean_age"], age)


def _gathered(model, engine) -> Net:
    """The model with every stage's current weights (a plain copy)."""
    from pyg_pipe.engine import sync_module_state
    plain = copy.deepcopy(model)
    if engine.plan is not None:
        sync_module_state(plain, engine.owners, engine.owner_ranks)
    return plain


def test_one_process_chunks_read_what_the_policy_says():
    _worker(0, 1, 1, 1, 4)


def test_smoothing_reads_the_moving_average():
    """``smoothing=0.5``: stale reads see the average over steps of what T2 gives (PipeGCN's smoothing)."""
    _worker(0, 1, 1, 1, 4, smoothing=0.5)


@pytest.mark.parametrize("stages,ways,chunks", [(2, 2, 8)])
def test_pipeline_and_ways_read_what_the_policy_says(stages, ways, chunks):
    run_distributed(_worker, stages * ways, stages, ways, chunks, timeout=240)


def _bounded(rank, world, stages, ways, chunks, bound):
    """The bounds refresh history with an exact pass: right after a refresh the training forward equals the
    plain model with the current weights (lr > 0), the ages never pass ``max_age``, a drift above
    ``max_staleness`` is followed by a refresh, and every rank refreshes at the same steps."""
    from pyg_pipe.engine.runtime.staleness import summarize
    x, ei, y, mask, model, engine = _setup(stages, ways, chunks, **bound)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    refreshes, exact_steps, last_drift = 0, [], 0.0
    for step in range(STEPS):
        plain = Net()
        plain.load_state_dict(_gathered(model, engine).state_dict())
        with torch.no_grad():
            want = plain(x, ei)
        out = model(x, ei)
        refreshed = engine.meter.refreshes > refreshes
        refreshes = engine.meter.refreshes
        if "max_staleness" in bound and step > 0:  # refreshed exactly when the last step passed the bound
            assert refreshed == (last_drift > bound["max_staleness"]), (step, last_drift)
        if refreshed or step == 0:
            torch.testing.assert_close(out, want, atol=1e-9, rtol=0, msg=f"forward right after a refresh, step {step}")
            exact_steps.append(step)
        opt.zero_grad()
        F.cross_entropy(out[mask], y[mask]).backward()
        opt.step()
        entries = engine.meter.take()
        gathered = [None] * world
        if dist.is_initialized():
            dist.all_gather_object(gathered, (entries, refreshes))
            assert len({r for _, r in gathered}) == 1, gathered  # the same refreshes on every rank
            entries = [e for rank_entries, _ in gathered for e in rank_entries]
        got = summarize(entries)
        last_drift = got["max_drift"]
        if "max_age" in bound:
            assert got["mean_age"] <= bound["max_age"], (step, got)
        if refreshed:
            assert got["max_drift"] < 1e-9, (step, got)
    engine.uninstall()
    if bound.get("max_age") == 0:
        assert exact_steps == list(range(STEPS)) and refreshes == STEPS - 1
    else:
        assert refreshes >= 2, refreshes


@pytest.mark.parametrize("bound", [dict(max_age=0), dict(max_age=1), dict(max_staleness=0.2)],
                         ids=["max_age=0", "max_age=1", "max_staleness=0.2"])
def test_one_process_bounds_refresh_history(bound):
    try:
        _bounded(0, 1, 1, 1, 4, bound)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("max_age", [1, 2])
def test_every_step_between_refreshes_reads_what_the_policy_says(max_age):
    """With refreshes every few steps, every training forward (not only those right after a refresh) equals
    the whole-graph reference in which a refresh refills history with the current weights and renews the
    T2 snapshot (lr > 0)."""
    try:
        x, ei, y, mask, model, engine = _setup(1, 1, 4, max_age=max_age)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        reference, refreshes, seen = None, 0, 0
        for step in range(STEPS):
            weights = _gathered(model, engine)
            if reference is None:
                reference = Reference(weights, x, ei, ranges(ei, x.size(0), 4)[1], 1)
            reference.model.load_state_dict(weights.state_dict())
            out = model(x, ei)
            if engine.meter.refreshes > refreshes:   # the engine refreshed before this step: so does the reference
                refreshes, seen = engine.meter.refreshes, seen + 1
                with torch.no_grad():
                    h1 = reference.model.conv1(x, ei).relu()
                    reference.history = [h1, reference.model.conv2(h1, ei).relu()]
                reference.snapshot, reference.origin = None, step
            torch.testing.assert_close(out, reference.forward(step), atol=1e-9, rtol=0, msg=f"step {step}")
            opt.zero_grad()
            F.cross_entropy(out[mask], y[mask]).backward()
            opt.step()
        engine.uninstall()
        assert seen >= 1, seen
    finally:
        torch.set_default_dtype(torch.float32)


def test_pipeline_and_ways_refresh_at_the_same_steps():
    run_distributed(_bounded, 4, 2, 2, 8, dict(max_staleness=0.2), timeout=240)


def test_no_refresh_below_the_bound():
    torch.set_default_dtype(torch.float64)
    try:
        x, g, y, mask = zoo_graph()
        torch.manual_seed(0)
        model = Net()
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=4, partition=ranges, streaming=False,
                                                     max_staleness=1e9, max_age=100),
                               Comm(torch.device("cpu")), num_stages=1)
        engine.install()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        for _ in range(4):
            out = model(x, g["edge_index"])
            opt.zero_grad()
            F.cross_entropy(out[mask], y[mask]).backward()
            opt.step()
        engine.uninstall()
        assert engine.meter.refreshes == 0 and engine.meter.last_drift > 0
    finally:
        torch.set_default_dtype(torch.float32)


# --------------------------------------------------------------------------------------------------------
# dropout: the meter's drift comes from probes without it (staleness.py, "Random numbers")
# --------------------------------------------------------------------------------------------------------

PROBE_STEPS = 3 * PERIOD + 1  # probes before steps 3, 6 and 9: drift entries at 6 and 9


def _dropout_run(lr: float, meter: bool = True, stages: int = 1, chunks: int = 4, **cfg):
    """PyG's GraphSAGE with dropout between its layers, trained ``PROBE_STEPS`` steps (SGD, float64): the
    outputs of every step and the meter's entries, one list per step."""
    from torch_geometric.nn import GraphSAGE
    torch.set_default_dtype(torch.float64)
    try:
        x, g, y, mask = zoo_graph()
        torch.manual_seed(0)
        model = GraphSAGE(8, 12, num_layers=3, out_channels=3, dropout=0.5)
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, partition=ranges, snapshot_period=PERIOD,
                                                     seed=SEED, balance="layers", streaming=False,
                                                     staleness_meter=meter, **cfg),
                               Comm(torch.device("cpu"), timeout=60), num_stages=stages)
        engine.install()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        outs, entries = [], []
        torch.manual_seed(1)
        for _ in range(PROBE_STEPS):
            out = model(x, g["edge_index"])
            opt.zero_grad()
            F.cross_entropy(out[mask], y[mask]).backward()
            opt.step()
            outs.append(out.detach())
            entries.append(engine.meter.take())
        engine.uninstall()
        return outs, entries, engine.meter
    finally:
        torch.set_default_dtype(torch.float32)


def _probe_drift(entries) -> dict:
    """Per step (those with a probe's drift): the drift of every site, over the entries of one or more ranks."""
    from pyg_pipe.engine.runtime.staleness import summarize
    return {step: summarize(e) for step, e in enumerate(entries) if any(x["sites"] for x in e)}


def test_with_dropout_the_meter_reads_staleness_not_noise():
    """lr = 0 with dropout on: nothing is stale, and the meter reads exactly 0 (the rows the steps read differ
    by their dropout masks); lr > 0: it reads the rows' drift; and its probes leave training unchanged (every
    output equal, bit for bit, with the meter off)."""
    outs, entries, meter = _dropout_run(lr=0.0)
    assert meter.random is True and meter.probes == 3, (meter.random, meter.probes)
    got = _probe_drift(entries)
    assert sorted(got) == [2 * PERIOD, 3 * PERIOD], sorted(got)  # (the first probe sets the reference)
    for step, metrics in got.items():
        sites = [k for k in metrics if k.startswith("drift/")]
        assert len(sites) == 2 and all(metrics[k] == 0.0 for k in sites), (step, metrics)
    assert not torch.equal(outs[0], outs[1])  # (dropout is on: the steps' outputs differ at lr = 0)
    outs, entries, meter = _dropout_run(lr=0.5)
    moved = _probe_drift(entries)
    assert sorted(moved) == sorted(got) and all(m["max_drift"] > 1e-4 for m in moved.values()), moved
    unmetered, _, off = _dropout_run(lr=0.5, meter=False)
    assert off.probes == 0
    for step, (a, b) in enumerate(zip(outs, unmetered)):
        assert torch.equal(a, b), f"step {step}: the probes changed training"


def test_with_dropout_the_bound_refreshes_by_the_probes_drift():
    """``max_staleness`` with dropout: at lr = 0 nothing is stale and nothing is refreshed (the rows the steps
    read differ by far more than the bound: their dropout masks); at lr > 0 the probes' drift per update
    times the age of the next step's reads passes a small bound, and refreshes follow."""
    *_, still = _dropout_run(lr=0.0, max_staleness=0.01)
    assert still.refreshes == 0 and still.rate == 0.0, (still.refreshes, still.rate)
    *_, moving = _dropout_run(lr=0.5, max_staleness=0.01)
    assert moving.rate > 0 and moving.refreshes >= 1, (moving.refreshes, moving.rate)


def _dropout_pipeline(rank, world):
    _, entries, meter = _dropout_run(lr=0.0, stages=2, chunks=4, max_staleness=0.01)
    gathered = [None] * world
    dist.all_gather_object(gathered, (meter.random, entries))
    assert all(random is True for random, _ in gathered), gathered  # (every rank, whichever stage drops out)
    assert meter.refreshes == 0, meter.refreshes
    merged = [[e for _, rank_entries in gathered for e in rank_entries[step]] for step in range(PROBE_STEPS)]
    got = _probe_drift(merged)
    assert sorted(got) == [2 * PERIOD, 3 * PERIOD] and all(m["max_drift"] == 0.0 for m in got.values()), got


def test_with_dropout_a_pipeline_meter_reads_zero_at_lr0():
    """Two stages, only the first drawing random numbers: both ranks probe, and read 0 at lr = 0."""
    run_distributed(_dropout_pipeline, 2, timeout=240)
