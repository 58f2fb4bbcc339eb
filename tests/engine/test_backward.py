"""The GNNPipe backward with cross-chunk edges, against an independent reference.

The reference is plain PyTorch on the whole graph, written from the algorithm's definition, not from
the engine's data structures: when chunk ``c`` runs, its second layer reads every in-neighbour ``v``
of its rows as

* ``v``'s live value when ``v`` is one of ``c``'s rows;
* ``v``'s value computed this step (*fresh*) when ``v``'s chunk runs at the same clock or earlier,
  and then the gradient reaches ``v``'s producer scaled by 2 under T3 (``unbiased_gradients``), by 1
  when ``v``'s chunk always runs at the same clock as ``c`` (another way's chunk at the same position);
* a constant (historical, *stale*) otherwise: no gradient.

With lr = 0 the history equals this step's values, so values are equal and only the gradients tell the
cases apart. Checked for one stage x 2 ways (fresh reads at the same clock and earlier), 2 stages
(gradients crossing the stage link), with and without T3, over two steps with different orders.
"""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GCN, GraphConv, GraphSAGE

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from tests.dist import run_distributed
from tests.harness import ranges
from tests.zoo import zoo_graph


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = GraphConv(8, 12)
        self.conv2 = GraphConv(12, 3)

    def forward(self, x, edge_index):
        return self.conv2(F.relu(self.conv1(x, edge_index)), edge_index)


def reference_grads(model, x, edge_index, y, mask, perm, ptr, ways, pi, unbiased, late_pi=None):
    """Parameter gradients of one GNNPipe step at lr = 0 (see the module docstring). ``late_pi``: the last
    step's order under ``late_gradients`` (reads stale then send their gradient now; T3 is off)."""
    model = copy.deepcopy(model)
    N, C = x.size(0), ptr.numel() - 1
    cpw = C // ways
    new = torch.empty_like(perm)
    new[perm] = torch.arange(N)
    chunk = torch.bucketize(new, ptr[1:], right=True)          # chunk of every vertex (user ids)
    clock_of_index = torch.empty(cpw, dtype=torch.long)
    clock_of_index[torch.tensor(pi)] = torch.arange(cpw)
    clock = clock_of_index[torch.arange(C) % cpw]
    before = None
    if late_pi is not None:  # the clocks of the last step
        before = torch.empty(cpw, dtype=torch.long)
        before[torch.tensor(late_pi)] = torch.arange(cpw)
        before = before[torch.arange(C) % cpw]
    h = F.relu(model.conv1(x, edge_index))
    out = torch.zeros(N, 3, dtype=x.dtype)
    for c in range(C):
        own = chunk == c
        fresh = clock[chunk] <= clock[c]
        always_same_clock = (chunk % cpw) == (c % cpw)
        scale = torch.where(always_same_clock | (not unbiased), 1.0, 2.0).to(x.dtype)
        scale = torch.where(fresh, scale, 0.0)
        if before is not None:  # late_gradients: + 1 for every read that was stale in the last step
            scale = scale + (before[chunk] > before[c]).to(x.dtype)
        scale = scale.view(-1, 1)
        scaled = h * scale - h.detach() * (scale - 1)           # value h, gradient times scale
        z = torch.where(own.view(-1, 1), h, scaled)
        out = torch.where(own.view(-1, 1), model.conv2(z, edge_index), out)
    F.cross_entropy(out[mask], y[mask]).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _worker(rank, world, stages, ways, chunks, unbiased, **cfg):
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph(sizes=(64 // chunks, 64 - 64 // chunks))
    edge_index = g["edge_index"]
    torch.manual_seed(0)
    model = TwoLayers()
    reference = copy.deepcopy(model)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, partition=ranges, unbiased_gradients=unbiased,
                                                 balance="layers", **cfg),
                           Comm(torch.device("cpu"), timeout=60), num_stages=stages, ways=ways)
    engine.install()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    late = cfg.get("late_gradients", False)
    for step in range(2 if cfg.get("max_age") is None and not late else 4):
        out = model(x, edge_index)
        opt.zero_grad()
        F.cross_entropy(out[mask], y[mask]).backward()
        plan, order = engine.plan, engine.runtime.schedule.local_order
        want = reference_grads(reference, x, edge_index, y, mask, plan.perm, plan.ptr, ways, order(step),
                               unbiased and not late, order(step - 1) if late and step else None)
        for name, p in model.named_parameters():
            if engine.owners[name] == engine.stage_index:
                torch.testing.assert_close(p.grad, want[name], atol=1e-9, rtol=1e-7,
                                           msg=f"step {step}: gradient of {name}")
        opt.step()
    if cfg.get("max_age") is not None:  # the bound did refill history (so the steps after a refresh were checked)
        assert engine.meter.refreshes >= 1, engine.meter.refreshes
    engine.uninstall()


@pytest.mark.parametrize("stages,ways,chunks,unbiased", [(1, 2, 8, True), (2, 1, 4, True), (2, 1, 4, False)])
def test_cross_chunk_gradients_follow_freshness(stages, ways, chunks, unbiased):
    run_distributed(_worker, stages * ways, stages, ways, chunks, unbiased, timeout=240)


@pytest.mark.parametrize("max_age", [0, 1])
def test_gradients_after_a_refresh_follow_the_same_policy(max_age):
    """A bound's exact refill (``max_age``: every step, every other step) changes what history holds, not
    which reads carry gradients: one process, 4 chunks (not streamed), the same reference."""
    run_distributed(functools.partial(_worker, streaming=False, max_age=max_age), 1, 1, 1, 4, True, timeout=240)


@pytest.mark.parametrize("stages,shuffle", [(1, True), (2, True), (2, False)])
def test_late_gradients_reach_their_owners_next_step(stages, shuffle):
    """``late_gradients``: every stale read's gradient arrives in the next step, T3 off: at lr = 0 each
    read's gradient is counted once if fresh now plus once if stale in the last step (so exactly once
    from the second step without shuffling); 4 steps, one stage (not streamed) or two."""
    run_distributed(functools.partial(_worker, late_gradients=True, shuffle_chunks=shuffle, streaming=False),
                    stages, stages, 1, 4, True, timeout=240)


def test_reference_tells_the_cases_apart():
    """The reference is not trivially the exact gradient: with stale reads and T3 it differs from both
    the exact gradient and the un-scaled one (so the tests above can fail)."""
    torch.set_default_dtype(torch.float64)
    try:
        x, g, y, mask = zoo_graph(sizes=(16, 48))
        torch.manual_seed(0)
        model = TwoLayers()
        perm, ptr = ranges(g["edge_index"], 64, 4)
        scaled = reference_grads(model, x, g["edge_index"], y, mask, perm, ptr, 1, [2, 0, 3, 1], True)
        plain = reference_grads(model, x, g["edge_index"], y, mask, perm, ptr, 1, [2, 0, 3, 1], False)
        m = copy.deepcopy(model)
        F.cross_entropy(m(x, g["edge_index"])[mask], y[mask]).backward()
        name = "conv1.lin_rel.weight"
        assert not torch.allclose(scaled[name], plain[name])
        assert not torch.allclose(plain[name], dict(m.named_parameters())[name].grad)
        assert torch.allclose(scaled["conv2.lin_rel.weight"], plain["conv2.lin_rel.weight"])  # no cut below conv2
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("cls,offload", [(GCN, None), (GraphSAGE, None), (GCN, "disk")])
def test_late_gradients_give_the_exact_gradient_at_lr0_without_shuffling(cls, offload):
    """PyG's own model classes on a graph of several components, one process, 4 chunks read from history
    (not streamed; their buffers in files with ``offload="disk"``), in order: from the second step every read's gradient arrives exactly once (this step's
    fresh reads, the last step's stale ones), so the gradient is plain PyG's whole-graph gradient; without
    ``late_gradients`` (T3) it is not."""
    torch.set_default_dtype(torch.float64)
    try:
        x, g, y, mask = zoo_graph(sizes=(16, 24, 24))
        ei = g["edge_index"]
        for late in (True, False):
            torch.manual_seed(0)
            model = cls(8, 16, 3, out_channels=3)
            plain = copy.deepcopy(model)
            F.cross_entropy(plain(x, ei)[mask], y[mask]).backward()
            engine = GNNPipeEngine(model, PipelineConfig(num_chunks=4, partition=ranges, shuffle_chunks=False,
                                                         streaming=False, balance="layers", late_gradients=late,
                                                         offload=offload),
                                   Comm(torch.device("cpu")), num_stages=1, ways=1)
            engine.install()
            try:
                errs = []
                for _ in range(3):
                    model.zero_grad()
                    F.cross_entropy(model(x, ei)[mask], y[mask]).backward()
                    errs.append(max((p.grad - q.grad).abs().max().item()
                                    for p, q in zip(model.parameters(), plain.parameters())))
            finally:
                engine.uninstall()
            if late:
                assert errs[0] > 1e-6, errs               # the first step has no late gradients yet
                assert max(errs[1:]) < 1e-9, errs
            else:
                assert min(errs) > 1e-6, errs
    finally:
        torch.set_default_dtype(torch.float32)


def _late_with_ways(rank, world):
    x, g, y, mask = zoo_graph(sizes=(16, 48))
    engine = GNNPipeEngine(TwoLayers(), PipelineConfig(num_chunks=4, late_gradients=True),
                           Comm(torch.device("cpu"), timeout=60), num_stages=1, ways=2)
    engine.install()
    with pytest.raises(ValueError, match="late_gradients=True is built for one way per stage"):
        engine.module(x, g["edge_index"])
    engine.uninstall()


def test_late_gradients_with_several_ways_are_refused_on_every_rank():
    """Engine users (no strategy to refuse it up front): every rank refuses at the plan, none waits."""
    run_distributed(_late_with_ways, 2, timeout=120)
