"""``boundary_dtype=torch.bfloat16``: activations and gradients crossing stage cuts (with GCNII's carried
``x0``) and halos among graph-parallel ways travel in bf16 during training. Their bytes are exactly half
of fp32's, the output and the weight all-reduce keep fp32, training stays close to the fp32 run, and
the exact pass (inference) is untouched: bit for bit the fp32 run's output."""
import pytest
import torch
import torch.nn.functional as F

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, sync_module_state
from tests.dist import run_distributed
from tests.models import gcnii
from tests.zoo import zoo_graph

HALVED = ("stage_activations", "stage_gradients", "carried", "halo_forward", "halo_backward")
KEPT = ("output", "weight_allreduce")


def _train(x, ei, y, mask, stages, ways, chunks, dtype, lr):
    torch.manual_seed(0)
    model = gcnii(8, 16, 3, 4, dropout=0.0)
    sync_module_state(model, {}, [0])
    comm = Comm(torch.device("cpu"), timeout=60)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, balance="layers", boundary_dtype=dtype),
                           comm, num_stages=stages, ways=ways)
    engine.install()
    try:
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        losses = []
        for step in range(3):
            comm.reset_counters()
            out = model(x, ei)
            loss = F.cross_entropy(out[mask], y[mask])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            sent = comm.totals(reduce=True)
        model.eval()
        with torch.no_grad():
            final = model(x, ei)
        return sent, losses, final
    finally:
        engine.uninstall()


def _cases(rank, world):
    x, g, y, mask = zoo_graph(sizes=(24, 40, 40))
    ei = g["edge_index"]
    for stages, ways, chunks in ((2, 1, 4), (1, 2, 2)):
        b32, l32, _ = _train(x, ei, y, mask, stages, ways, chunks, None, 0.05)
        b16, l16, _ = _train(x, ei, y, mask, stages, ways, chunks, torch.bfloat16, 0.05)
        moved = [c for c in HALVED if b32[c]]
        assert moved, (stages, ways)
        for c in moved:
            assert b16[c] * 2 == b32[c], (stages, ways, c, b16[c], b32[c])
        for c in KEPT:
            assert b16[c] == b32[c], (stages, ways, c)
        assert max(abs(a - b) for a, b in zip(l16, l32)) < 2e-2, (l16, l32)
        # inference is the exact pass, in fp32 whatever the knob: with lr = 0 both runs hold the same weights
        _, _, f32 = _train(x, ei, y, mask, stages, ways, chunks, None, 0.0)
        _, _, f16 = _train(x, ei, y, mask, stages, ways, chunks, torch.bfloat16, 0.0)
        assert torch.equal(f32, f16), (stages, ways)


def test_bf16_halves_boundary_bytes_and_leaves_inference_exact():
    run_distributed(_cases, 2, timeout=300)


@pytest.mark.parametrize("bad", [torch.float64, "bf16", torch.int8])
def test_a_bad_boundary_dtype_names_the_knob(bad):
    with pytest.raises(ValueError, match="boundary_dtype="):
        PipelineConfig(boundary_dtype=bad).validate()


def test_history_in_bf16_halves_its_bytes_and_stays_close():
    """``history_dtype=torch.bfloat16`` (one process, one stage, 4 chunks: every cross-chunk read is historical
    or fresh): the buffers take half the bytes; at lr = 0 the training output is the fp32 history's within
    bf16 rounding (the stale rows read are rounded), and inference, an exact pass, equals it bit for bit."""
    x, g, y, mask = zoo_graph(sizes=(24, 40, 40))
    ei = g["edge_index"]
    outs, sizes = {}, {}
    for dtype in (None, torch.bfloat16):
        torch.manual_seed(0)
        model = gcnii(8, 16, 3, 4, dropout=0.0)
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=4, streaming=False, history_dtype=dtype),
                               Comm(torch.device("cpu")), num_stages=1)
        engine.install()
        try:
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            for _ in range(3):
                out = model(x, ei)
                loss = F.cross_entropy(out[mask], y[mask])
                opt.zero_grad()
                loss.backward()
                opt.step()
            buffers = engine.runtime.history.of(0).buffers
            sizes[dtype] = sum(b.numel() * b.element_size() for b in buffers.values())
            assert buffers and all(b.dtype == (dtype or torch.float32) for b in buffers.values())
            model.eval()
            with torch.no_grad():
                outs[dtype] = (out.detach(), model(x, ei))
        finally:
            engine.uninstall()
    assert sizes[torch.bfloat16] * 2 == sizes[None]
    torch.testing.assert_close(outs[torch.bfloat16][0], outs[None][0], atol=3e-2, rtol=2e-2)
    assert not torch.equal(outs[torch.bfloat16][0], outs[None][0])  # (the rounding is really there)
    assert torch.equal(outs[torch.bfloat16][1], outs[None][1])


def test_a_bad_history_dtype_names_the_knob():
    with pytest.raises(ValueError, match="history_dtype"):
        PipelineConfig(history_dtype=torch.int8).validate()
