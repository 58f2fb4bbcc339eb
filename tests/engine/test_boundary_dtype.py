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
