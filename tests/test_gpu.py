"""On a CUDA device (tests marked ``gpu``: they skip cleanly without one; ``bash benchmarks/gpu.sh`` runs
them with the GPU benchmarks where one is).

* one GPU: the engine streaming a GCNII over 4 chunks (NGra) trains exactly like plain PyG on the same
  device (float64, 3 Adam steps), with the fused kernels routed in for a sparse ``adj_t``;
* one GPU through Lightning: ``strategy="gnnpipe"``, ``devices=1``, equals plain training, also under
  ``precision="bf16-mixed"`` (with and without recomputation);
* two GPUs (when there are two): gnnpipe over NCCL with one chunk per way (exact) equals one process,
  and with 4 chunks trains (history on the device, grouped p2p, no host syncs in the chunk loop);
* two processes on one GPU over gloo, the transport staging CUDA tensors through host memory: the same
  two checks, so fill, drain, links and history run on CUDA in a real pipeline with one GPU.

The kernels' own CUDA tests are in ``tests/ops/test_aggregate.py`` (also marked ``gpu``).
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from tests.dist import run_distributed
from tests.harness import ranges
from tests.lit import NodeClassifier, graph_loader
from tests.models import as_data, forward_backward, gcnii, small_graph
from tests.zoo import zoo_graph

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _train(model, x, graph, y, mask, steps=3):
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    outs = []
    for _ in range(steps):
        out, _ = forward_backward(model, opt, x, graph, y, mask)
        opt.step()
        outs.append(out.detach())
    return outs


@pytest.mark.parametrize("sparse,offload", [(False, None), (True, None), (False, "host")],
                         ids=["edge_index", "adj_t", "edge_index-host-tier"])
def test_streaming_on_one_gpu_equals_plain_pyg(sparse, offload):
    """Streaming on one GPU equals plain PyG; with every value between layer groups in pinned host memory
    (``offload="host"``, no device budget; such a step is not captured) the next chunk's rows are read ahead on a
    side stream while the chunk before runs (:meth:`~pyg_pipe.engine.runtime.store.Store.prefetch`)."""
    from torch_geometric.utils import to_torch_csr_tensor

    import pyg_pipe.ops as ops
    torch.set_default_dtype(torch.float64)
    try:
        x, g, y, mask = zoo_graph()
        x, y, mask, ei = x.to(CUDA), y.to(CUDA), mask.to(CUDA), g["edge_index"].to(CUDA)
        graph = to_torch_csr_tensor(ei.flip(0), size=(x.size(0), x.size(0))) if sparse else ei
        torch.manual_seed(0)
        model = gcnii(8, 12, 3, 4).to(CUDA)
        ref = copy.deepcopy(model)
        want = _train(ref, x, graph, y, mask)
        config = PipelineConfig(num_chunks=4, partition=ranges, offload=offload, offload_budget=0 if offload else None)
        engine = GNNPipeEngine(model, config, Comm(CUDA), num_stages=1)
        engine.install()
        try:
            with ops.fused_kernels():
                got = _train(model, x, graph, y, mask)
            read_ahead = sum(st.prefetched for st in engine.runtime.stores.values())
        finally:
            engine.uninstall()
        assert engine.plan.streaming and (read_ahead > 0 or offload is None)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=0)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("precision,recompute", [("32-true", False), ("bf16-mixed", False), ("bf16-mixed", True)])
def test_lightning_fit_on_one_gpu_equals_plain_training(precision, recompute, tmp_path):
    """Through Lightning on one GPU (streaming 4 chunks, exact): the parameters plain training reaches, also
    under ``precision="bf16-mixed"`` (the same autocast in the reference; with recomputation the drain runs
    under the fill's autocast). Five steps: the last three are replayed from CUDA graphs (step/capture.py),
    so capture under autocast is checked too. On CPU: tests/strategies/test_precision.py."""
    import lightning.pytorch as pl

    from pyg_pipe import GNNPipeStrategy
    data = as_data(*small_graph())
    torch.manual_seed(0)
    model = gcnii(8, 16, 3, 4)
    ref = copy.deepcopy(model).to(CUDA)
    d = data.clone().to(CUDA)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = F.cross_entropy(ref(d.x, d.edge_index)[d.train_mask], d.y[d.train_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
    lit = NodeClassifier(model)

    class Keep(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            self.captured = trainer.strategy.engine.runtime.captured
    keep = Keep()
    t = pl.Trainer(strategy=GNNPipeStrategy(num_chunks=4, recompute=recompute), accelerator="gpu", devices=1,
                   max_epochs=5, precision=precision, default_root_dir=str(tmp_path), logger=False,
                   enable_checkpointing=False, callbacks=[keep])
    t.fit(lit, train_dataloaders=graph_loader(data))
    for p, q in zip(lit.model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.to(CUDA), q, atol=1e-4 if precision == "32-true" else 2e-3, rtol=0)
    assert keep.captured is not None and keep.captured.replays == 3, keep.captured and keep.captured.off


def _two_gpus(rank, world, chunks, one_gpu=False):
    torch.set_default_dtype(torch.float64)
    dev = torch.device("cuda", 0 if one_gpu else rank)
    x, g, y, mask = zoo_graph()
    x, y, mask, ei = x.to(dev), y.to(dev), mask.to(dev), g["edge_index"].to(dev)
    torch.manual_seed(0)  # the same weights on every rank
    model = gcnii(8, 12, 3, 4).to(dev)
    ref = copy.deepcopy(model)
    want = _train(ref, x, ei, y, mask)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, partition=ranges, balance="layers"),
                           Comm(dev, timeout=60), num_stages=world)
    assert engine.comm.staging == ("host" if one_gpu else None)
    engine.install()
    try:
        got = _train(model, x, ei, y, mask)
        if chunks == "auto":  # on a GPU the first step is fitted to the least free memory of the ranks
            peaks = engine.comm.all_gather_objects(engine.plan.first_step_peak, "test")
            assert peaks[0] is not None and peaks[0] > 0 and peaks[0] == peaks[1], peaks
    finally:
        engine.uninstall()
    if chunks == 1:  # exact
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    else:  # historical embeddings: trains, the first forward is exact (filled by an exact pass)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
        assert all(torch.isfinite(o).all() for o in got)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("chunks", [1, 4])
def test_gnnpipe_over_nccl_on_two_gpus(chunks):
    run_distributed(_two_gpus, 2, chunks, timeout=300, backend="nccl")


@pytest.mark.parametrize("chunks", [1, 4, "auto"])
def test_gnnpipe_on_one_gpu_with_two_processes_over_gloo(chunks):
    run_distributed(_two_gpus, 2, chunks, True, timeout=300, backend="gloo", cuda=True)
