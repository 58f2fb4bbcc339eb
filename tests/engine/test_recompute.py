"""Recomputation (``recompute=True``): the fill keeps only each chunk's stage inputs, the drain runs the
chunk again and back-propagates through it. Training with it equals training without it, bit for bit:
the same random numbers (dropout, attention dropout), running statistics moved once per chunk, the same halo rows (fresh rows of earlier chunks,
stale ones of later chunks, rows from the other ways), the same history. Checked with PyG's own models
(``GCN`` / ``GAT`` from ``torch_geometric.nn.models``, ``GCN2Conv`` stacks, a checkpointed
``DeepGCNLayer``) on a graph of several components, in a pipeline, with graph-parallel ways and hybrid,
with and without snapshots; and the fill keeps a fraction of the activations. With ways, the history
buffers are way-local (fewer rows than the graph).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import DeepGCNLayer, GENConv
from torch_geometric.nn.models import GAT, GCN

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, sync_module_state
from tests.dist import run_distributed
from tests.models import GCNIIStack as GCNII
from tests.zoo import zoo_graph


class DeepGCN(nn.Module):
    """ResGCN+ blocks with ``ckpt_grad=True`` (torch.utils.checkpoint inside every block)."""

    def __init__(self, layers=4):
        super().__init__()
        self.enc = nn.Linear(8, 12)
        self.blocks = nn.ModuleList(
            DeepGCNLayer(GENConv(12, 12), nn.LayerNorm(12), nn.ReLU(), block="res+", dropout=0.1, ckpt_grad=True)
            for _ in range(layers))
        self.out = nn.Linear(12, 3)

    def forward(self, x, edge_index):
        x = self.enc(x)
        for block in self.blocks:
            x = block(x, edge_index)
        return self.out(x)


MODELS = {
    "GCN": lambda: GCN(8, 12, 4, 3, dropout=0.3),
    "GAT": lambda: GAT(8, 12, 4, 3, heads=2, dropout=0.3),
    "GCNII": GCNII,
    "DeepGCN": DeepGCN,
}


def _train(make, x, ei, y, mask, stages, ways, chunks, steps, recompute, **cfg):
    torch.manual_seed(0)
    model = make()
    sync_module_state(model, {}, [0])
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, recompute=recompute, balance="layers", **cfg),
                           Comm(torch.device("cpu"), timeout=60), num_stages=stages, ways=ways)
    engine.install()
    try:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        saved = []
        for step in range(steps):
            torch.manual_seed(100 + step)  # the same dropout streams in both runs
            packed = [0]

            def pack(t):
                packed[0] += t.numel() * t.element_size()
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(x, ei)
            saved.append(packed[0])
            loss = F.cross_entropy(out[mask], y[mask])
            opt.zero_grad()
            loss.backward()
            opt.step()
        sync_module_state(model, engine.owners, engine.owner_ranks)
        with torch.no_grad():
            model.eval()
            final = model(x, ei)
        history = engine.runtime.history.of(0)
        assert all(b.size(0) == history.size for b in history.buffers.values())
        return ([t.detach().clone() for t in (*model.parameters(), *model.buffers())], final, max(saved),
                engine.runtime.recompute, history.size)
    finally:
        engine.uninstall()


def _cases(rank, world, cases):
    x, g, y, mask = zoo_graph(sizes=(24, 40, 40))
    ei = g["edge_index"]
    for name, stages, ways, chunks, cfg in cases:
        make = MODELS[name]
        p0, out0, saved0, on0, rows = _train(make, x, ei, y, mask, stages, ways, chunks, 3, False, **cfg)
        p1, out1, saved1, on1, _ = _train(make, x, ei, y, mask, stages, ways, chunks, 3, True, **cfg)
        assert not on0 and on1
        # history holds the rows other chunks read (with ways: of the way, and those it reads), not the graph's
        assert (rows < x.size(0)) if ways > 1 else (rows <= x.size(0)), (rows, x.size(0))
        for a, b in zip(p0, p1):
            assert torch.equal(a, b), f"{name} {stages}x{ways}x{chunks} {cfg}: parameters differ"
        assert torch.equal(out0, out1), name
        cpw = chunks // ways
        # the fill keeps the last chunk's activations (its drain comes first) and the others' inputs only
        assert saved1 <= saved0 * (1.0 / cpw + 0.15), (name, saved0, saved1)


def test_recompute_is_bit_identical_in_a_pipeline_and_with_ways():
    cases = [("GCN", 2, 1, 4, dict(snapshot_period=2)),
             ("GAT", 2, 1, 4, dict(snapshot_period=None)),
             ("GCNII", 2, 1, 4, dict(snapshot_period=None, shuffle_chunks=False)),
             ("DeepGCN", 2, 1, 4, dict(per_chunk_statistics=True)),  # BatchNorm in GENConv's MLP
             ("GCNII", 1, 2, 8, dict(snapshot_period=3)),
             ("GCN", 2, 1, 4, dict(snapshot_period=2, smoothing=0.5)),   # replays read the smoothed rows
             ("GAT", 1, 2, 4, dict(snapshot_period=None))]
    run_distributed(_cases, 2, cases, timeout=300)


def test_recompute_is_bit_identical_in_hybrid():
    cases = [("GCNII", 2, 2, 8, dict(snapshot_period=None)),
             ("GAT", 2, 2, 8, dict())]
    run_distributed(_cases, 4, cases, timeout=300)


def test_recompute_is_off_with_one_chunk_per_way():
    x, g, y, mask = zoo_graph()
    model = GCN(8, 12, 2, 3)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=1, recompute=True), Comm(torch.device("cpu")))
    engine.install()
    try:
        model(x, g["edge_index"]).sum().backward()
        assert engine.runtime.recompute is False  # nothing to save: one chunk's activations are all there is
    finally:
        engine.uninstall()


def test_auto_keeps_from_the_second_step_when_the_predicted_peak_fits_the_budget():
    """``recompute="auto"``: the first step replays and measures; before the second, the memory model's peak
    with keeping is set against ``memory_budget`` (counted bytes: the same choice on every run) or, without
    one, the device's free memory. (The results are the same either way: tested above.)"""
    from pyg_pipe.engine.plan.memory_cost import predict
    from pyg_pipe.engine.step.chunk import decide_recompute
    x, g, y, mask = zoo_graph()
    model = GCN(8, 12, 2, 3)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=4, streaming=False), Comm(torch.device("cpu")))
    engine.install()
    try:
        model(x, g["edge_index"]).sum().backward()
        rt = engine.runtime
        assert rt.recompute is True and rt.recompute_pending   # the first step replays; nothing decided yet
        model(x, g["edge_index"]).sum().backward()
        assert rt.recompute is False and not rt.recompute_pending  # a small model: keeping fits this machine
        p = predict(rt, model.parameters())
        fixed = p.resident + p.state
        keep, replay = p.held(False) + p.transient, p.held(True) + p.transient
        assert 0 < replay < keep
        for budget, replays, neither in [(fixed + keep, False, False), (fixed + keep - 1, True, False),
                                         (fixed + replay - 1, True, True)]:
            rt.config.memory_budget, rt.recompute_pending = budget, True
            line = decide_recompute(rt, p)
            assert rt.recompute is replays and not rt.recompute_pending, (budget, line)
            assert ("memory_budget=" in line) and (("does not fit either" in line) is neither), line
            if neither:  # what would: a chunk count, or none
                assert "num_chunks=" in line or "No chunk count fits" in line, line
    finally:
        engine.uninstall()


def test_a_budget_too_small_to_keep_replays_from_the_second_step_on():
    x, g, y, mask = zoo_graph()
    model = GCN(8, 12, 2, 3)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=4, streaming=False, memory_budget=1),
                           Comm(torch.device("cpu")))
    engine.install()
    try:
        for _ in range(3):
            model(x, g["edge_index"]).sum().backward()
            assert engine.runtime.recompute is True
        assert not engine.runtime.recompute_pending
    finally:
        engine.uninstall()


def test_a_bad_recompute_value_names_the_knob():
    with pytest.raises(ValueError, match="recompute='always'"):
        PipelineConfig(recompute="always").validate()


@pytest.mark.parametrize("budget", [0, -5, 1.5, True, "1GB"])
def test_a_bad_memory_budget_names_the_knob(budget):
    with pytest.raises(ValueError, match="memory_budget="):
        PipelineConfig(memory_budget=budget).validate()
