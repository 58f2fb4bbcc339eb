"""The ring halo exchange (``halo_exchange="ring"``, :mod:`pyg_pipe.engine.runtime.ring`) computes what the
all-to-all does.

Real gloo processes, real PyG layers, float64, on a graph of three components with self loops and isolated
vertices (:func:`tests.zoo.zoo_graph`); every case of a world size runs in one process launch:

* graph parallel, 3 and 4 ways, every model of the transparency tests: outputs, the gradients of every
  parameter and the parameters after 3 SGD+momentum steps with the ring equal the all-to-all's and plain
  single-process PyG's within 1e-10; then inference. GCN's measured ring halo bytes equal
  :func:`~pyg_pipe.engine.ring_halo_bytes` of :func:`~pyg_pipe.engine.ring_halo_rows` for the partition used,
  forward and backward, and every other category equals the all-to-all's.
* hybrid with several chunks per way (1 stage x 3 ways with 3 chunks each: rings of 3 with history, stale
  reads, T3 and gradients for the owner's other chunks; 2 stages x 2 ways with 4 chunks each): the ring's
  outputs, gradients and parameters equal the all-to-all's; it never sends fewer halo bytes.
* the knob is refused with a clear message when misspelt; the formula helper against brute force.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from pyg_pipe.engine import (CATEGORIES, Comm, GNNPipeEngine, PipelineConfig, graph_parallel_bytes, halo_rows,
                             ring_halo_bytes, ring_halo_rows, sync_module_state)
from tests.dist import run_distributed
from tests.engine.test_transparency import _reference
from tests.models import MODELS, make_model
from tests.zoo import zoo_graph

TOL = 1e-10
GCN_WIDTHS = [16, 16, 3]   # GCN, 4 layers, hidden 16: layers 2-4 exchange lin(x) (layer 1 reads the inputs)


def _graph():
    x, g, y, mask = zoo_graph(sizes=(70, 30, 20))
    return x.double(), g["edge_index"], y, mask


def _train(model, stages, ways, chunks, halo_exchange, x, edge_index, y, mask, steps=3):
    """``steps`` SGD+momentum steps through the engine: per step the output, the gradients this rank's stage
    computed and the bytes (summed over ranks); then the synced parameters and the inference output."""
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, halo_exchange=halo_exchange, balance="layers"),
                           Comm(torch.device("cpu"), timeout=60), num_stages=stages, ways=ways)
    engine.install()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    outs, grads, sent = [], [], []
    for _ in range(steps):
        engine.comm.reset_counters()
        out = model(x, edge_index)
        loss = F.cross_entropy(out[mask], y[mask])
        opt.zero_grad()
        loss.backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if engine.owners[n] == engine.stage_index})
        sent.append(engine.comm.totals())
        opt.step()
    sync_module_state(model, engine.owners, engine.owner_ranks)
    model.eval()
    with torch.no_grad():
        inference = model(x, edge_index)
    plan = engine.plan
    engine.uninstall()
    return dict(outs=outs, grads=grads, sent=sent, params=dict(model.named_parameters()), inference=inference,
                perm=plan.perm, ptr=plan.ptr)


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=what)


def _same_training(name, ring, a2a, steps=3):
    for s in range(steps):
        _close(ring["outs"][s], a2a["outs"][s], f"{name}: output, step {s}")
        assert ring["grads"][s].keys() == a2a["grads"][s].keys()
        for p, g in ring["grads"][s].items():
            _close(g, a2a["grads"][s][p], f"{name}: gradient of {p}, step {s}")
    for p, v in ring["params"].items():
        _close(v, a2a["params"][p], f"{name}: parameter {p} after {steps} steps")
    _close(ring["inference"], a2a["inference"], f"{name}: inference")


def _worker(rank, world, cases):
    x, edge_index, y, mask = _graph()
    for stages, ways, chunks, names in cases:
        for name in names:
            torch.manual_seed(0)
            model = make_model(name).double()
            runs = {mode: _train(copy.deepcopy(model), stages, ways, chunks, mode, x, edge_index, y, mask)
                    for mode in ("all_to_all", "ring")}
            ring, a2a = runs["ring"], runs["all_to_all"]
            label = f"{name}, {stages} x {ways}, {chunks} chunks"
            _same_training(label, ring, a2a)
            for s in range(3):
                assert ring["sent"][s]["halo_forward"] >= a2a["sent"][s]["halo_forward"] > 0, (label, s)
                assert ring["sent"][s]["halo_backward"] >= a2a["sent"][s]["halo_backward"] > 0, (label, s)
            if chunks != ways:
                continue
            # one chunk per way is exact: the ring equals plain PyG as well
            ref, outs, _, grads = _reference(model, x, edge_index, y, mask, steps=3, lr=0.05)
            for s in range(3):
                _close(ring["outs"][s], outs[s], f"{label}: output vs PyG, step {s}")
                for p, g in ring["grads"][s].items():
                    _close(g, grads[s][p], f"{label}: gradient of {p} vs PyG, step {s}")
            for p, q in ref.named_parameters():
                _close(ring["params"][p], q, f"{label}: parameter {p} vs PyG")
            if name != "gcn":
                continue
            # bytes: the ring formula for the partition used, every step, both directions
            reach, halo = ring_halo_rows(edge_index, ring["perm"], ring["ptr"]), halo_rows(edge_index, ring["perm"],
                                                                                           ring["ptr"])
            assert reach > halo, (label, reach, halo)   # some rows travel more than one hop
            want = ring_halo_bytes(reach, GCN_WIDTHS, bytes_per_value=8)
            a2a_want = graph_parallel_bytes(x.size(0), halo, GCN_WIDTHS, 0, ways, 3, bytes_per_value=8)["halo_forward"]
            for s in range(3):
                got, base = ring["sent"][s], a2a["sent"][s]
                assert got["halo_forward"] == got["halo_backward"] == want, (label, s, got, want)
                assert base["halo_forward"] == base["halo_backward"] == a2a_want, (label, s, base, a2a_want)
                for c in CATEGORIES:
                    if c not in ("halo_forward", "halo_backward"):
                        assert got[c] == base[c], (label, s, c)


def test_ring_equals_all_to_all_with_3_ways():
    """Graph parallel over 3 ways (and PyG), and 1 stage x 3 ways with 3 chunks per way (history)."""
    run_distributed(_worker, 3, [(1, 3, 3, MODELS), (1, 3, 9, ["gcn", "gcnii", "gat"])], timeout=240)


def test_ring_equals_all_to_all_with_4_ways_and_with_stages():
    """Graph parallel over 4 ways (and PyG), and 2 stages x 2 ways with 4 chunks per way."""
    run_distributed(_worker, 4, [(1, 4, 4, MODELS), (2, 2, 8, ["gcn", "gcnii", "gat"])], timeout=240)


def test_halo_exchange_is_validated():
    PipelineConfig(halo_exchange="ring").validate()
    with pytest.raises(ValueError) as err:
        PipelineConfig(halo_exchange="rings").validate()
    msg = str(err.value)
    assert msg.startswith("halo_exchange='rings' must be 'all_to_all'") and "or 'ring'" in msg, msg


def _brute_reach(edges, part, W):
    """``Σ_v max over the parts r != part(v) that v has an edge into of (r - part(v)) mod W``, by listing."""
    far = {}
    for u, v in edges:
        if part[u] != part[v]:
            far[u] = max(far.get(u, 0), (part[v] - part[u]) % W)
    return sum(far.values())


@pytest.mark.parametrize("seed", range(4))
def test_ring_halo_rows_match_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    n, W = 30, 2 + seed
    edges = torch.randint(0, n, (80, 2), generator=g)
    perm = torch.randperm(n, generator=g)
    ptr = torch.linspace(0, n, W + 1).long()
    part = {int(perm[new]): p for p in range(W) for new in range(int(ptr[p]), int(ptr[p + 1]))}
    got = ring_halo_rows(edges.t().contiguous(), perm, ptr)
    assert got == _brute_reach(edges.tolist(), part, W)
    assert got >= halo_rows(edges.t().contiguous(), perm, ptr)
    if W == 2:   # one hop: the ring is the all-to-all
        assert got == halo_rows(edges.t().contiguous(), perm, ptr)


def test_a_row_read_only_by_the_previous_way_travels_around_the_ring():
    # parts {0}, {1}, {2}, {3}: 0 -> 3 is distance 3 in the ring (one row in all-to-all), 1 -> 2 distance 1
    edges = torch.tensor([[0, 1], [3, 2]])
    assert ring_halo_rows(edges, torch.arange(4), torch.arange(5)) == 3 + 1
    assert halo_rows(edges, torch.arange(4), torch.arange(5)) == 2
