"""Memory tiers of the history (:mod:`pyg_pipe.engine.runtime.tiers`): buffers on the device, in host memory or in
memory-mapped files, within a byte budget. Training with history in any tier equals training with it on
the device, bit for bit (a PyG ``GCN2Conv`` stack with dropout on a graph of several components, 2
stages x 4 chunks, with and without snapshots, recompute on and off; 2 graph-parallel ways x 2 chunks, with either
halo exchange), and a run holds its buffers where the knobs say. On the device the gradients of fresh reads are
kept as parts (:mod:`pyg_pipe.engine.runtime.pending`), in a tier as buffers: so this also checks that the two sum
them alike.
"""
import pytest
import torch
import torch.nn.functional as F

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, sync_module_state
from pyg_pipe.engine.runtime.tiers import Tiers
from tests.dist import run_distributed
from tests.models import GCNIIStack as GCNII
from tests.zoo import zoo_graph


def test_disk_buffers_keep_their_values_when_pages_are_handed_back(tmp_path):
    tiers = Tiers(torch.device("cpu"), "disk", None, str(tmp_path))
    buf = tiers.zeros((1000, 16), torch.float32)
    assert tiers._maps and buf.untyped_storage().data_ptr() != 0
    rows = torch.randn(1000, 16)
    buf.copy_(rows)
    tiers.evict()                               # the pages leave the process, the values stay in the file
    assert torch.equal(buf, rows)
    assert not [f for f in tmp_path.rglob("*") if f.is_file()]   # files are unlinked at once (the mapping keeps them)
    tiers.close()
    assert list(tmp_path.iterdir()) == []       # and the directory goes with the tiers


def test_the_budget_keeps_buffers_on_the_device_while_they_fit():
    tiers = Tiers(torch.device("cpu"), "disk", 2 * 100 * 4 * 4)
    placed = [tiers.zeros((100, 4), torch.float32) for _ in range(3)]
    assert tiers.on_device == 2 * 100 * 4 * 4 and len(tiers._maps) == 1   # two fit, the third is mapped
    assert all(p.abs().sum() == 0 for p in placed)
    everything = Tiers(torch.device("cpu"))
    everything.zeros((100, 4), torch.float32)
    assert not everything._maps                                          # no offload: all on the device


def test_bad_offload_knobs_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="offload='gpu'"):
        PipelineConfig(offload="gpu").validate()
    with pytest.raises(ValueError, match="offload_budget=-1"):
        PipelineConfig(offload="disk", offload_budget=-1).validate()
    with pytest.raises(ValueError, match="offload_dir="):
        PipelineConfig(offload="disk", offload_dir=str(tmp_path / "missing")).validate()


def _train(x, ei, y, mask, stages=2, ways=1, **cfg):
    torch.manual_seed(0)
    model = GCNII()
    sync_module_state(model, {}, [0])
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=4, balance="layers", **cfg),
                           Comm(torch.device("cpu"), timeout=60), num_stages=stages, ways=ways)
    engine.install()
    try:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for step in range(4):
            torch.manual_seed(100 + step)
            out = model(x, ei)
            opt.zero_grad()
            F.cross_entropy(out[mask], y[mask]).backward()
            opt.step()
        sync_module_state(model, engine.owners, engine.owner_ranks)
        tiers = engine.runtime.history.tiers
        parts = engine.runtime.history.of(0).pending.peak  # (on the device: fresh reads' gradients kept as parts)
        assert (parts > 0) == (cfg.get("offload") is None), (parts, cfg)
        return [p.detach().clone() for p in model.parameters()], len(tiers._maps), tiers.on_device
    finally:
        engine.uninstall()


def _worker(rank, world, offload_dir):
    x, g, y, mask = zoo_graph(sizes=(24, 40, 40))
    ei = g["edge_index"]
    for common in (dict(snapshot_period=2, recompute=True), dict(snapshot_period=None, recompute=False),
                   dict(snapshot_period=2, recompute=False, stages=1, ways=2),     # 2 graph-parallel ways, 2 chunks
                   dict(snapshot_period=2, recompute=False, stages=1, ways=2, halo_exchange="ring")):  # each
        want, maps, on_device = _train(x, ei, y, mask, **common)
        assert maps == 0 and on_device > 0
        for offload, budget in (("host", None), ("disk", None), ("disk", on_device // 2)):
            got, maps, kept = _train(x, ei, y, mask, offload=offload, offload_budget=budget, offload_dir=offload_dir,
                                     **common)
            for a, b in zip(want, got):
                assert torch.equal(a, b), (common, offload, budget)
            if offload == "disk":
                assert maps > 0 and kept == (0 if budget is None else kept) and kept <= (budget or 0)


def test_training_with_history_in_any_tier_is_bit_identical(tmp_path):
    run_distributed(_worker, 2, str(tmp_path), timeout=300)


def test_host_gradients_summed_when_read_equal_the_device_sums_bit_for_bit():
    """:class:`~pyg_pipe.engine.runtime.store.Store` with its gradients in host memory keeps each chunk's
    ``[rows | halo]`` gradient and sums a chunk's rows when they are read; mixed with a gradient by ids (a barrier
    site's), the parts are summed into a buffer first, in order. Both equal a store on the device bit for bit."""
    from pyg_pipe.engine.runtime.store import Store
    from pyg_pipe.graph import ChunkedGraph

    gen = torch.Generator().manual_seed(0)
    n = 60
    src, dst = torch.randint(0, n, (400,), generator=gen), torch.randint(0, n, (400,), generator=gen)
    cg = ChunkedGraph(src, dst, n, torch.randperm(n, generator=gen), torch.tensor([0, 15, 30, 45, 60]))
    grads = [torch.randn(lg.num_local, 5, generator=gen) for lg in cg.chunks]
    ids = torch.randint(0, n, (30,), generator=gen)
    extra = torch.randn(30, 5, generator=gen)
    for by_ids in (False, True):
        got = []
        for tiers in (Tiers(torch.device("cpu")), Tiers(torch.device("cpu"), "host", 0)):
            store = Store(tiers, n)
            for lg in cg.chunks:
                store.put("h", lg, torch.zeros(lg.rows, 5))
            for lg, g in zip(cg.chunks, grads):
                store.add_grad_local("h", lg, g)
            assert ("h" in store.deferred) == (tiers.offload is not None)
            if by_ids:
                store.add_grad("h", ids, extra)
            got.append([store.grad_rows("h", lg) for lg in cg.chunks])
            assert store.summed == (4 if tiers.offload is not None and not by_ids else 0)
        assert all(torch.equal(a, b) for a, b in zip(*got))

