"""Why a capture fails: the last operations before the error, for the one configuration measured failing
(PyG's ``GCN`` on ``edge_index``, activations kept inside the capture: docs/benchmarks.md, "Fourth GPU
run"). A diagnosis for a GPU session, never a test; prints, writes nothing.

    python benchmarks/gpu/diagnose_capture.py [--model GCN|gcnii] [--replayed]

The capture's error is raised by the first CUDA call after the one that broke it, so the operations
(aten, with the engine's stage: capture F or B) and every warning before it are printed, newest last.
"""
import argparse
import collections
import copy
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch_geometric.nn import GCN

    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
    from pyg_pipe.engine.step import capture, stream
    from tests.harness import ranges
    from tests.models import gcnii
    from tests.zoo import zoo_graph

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="GCN", choices=["GCN", "gcnii"])
    p.add_argument("--replayed", action="store_true", help="the capture that replays (passes: the control)")
    p.add_argument("--cpu", action="store_true", help="checks the script on a CPU (nothing is captured there)")
    a = p.parse_args()
    if not (a.cpu or torch.cuda.is_available()):
        print("diagnose_capture.py: no CUDA device here")
        return
    ring = collections.deque(maxlen=40)
    phase = ["eager"]

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            shapes = [tuple(t.shape) for t in args if isinstance(t, torch.Tensor)][:3]
            ring.append(f"{phase[0]:>9} capturing={int(capturing)} {func} {shapes}")
            return func(*args, **(kwargs or {}))

    original = capture.CapturedStep._capture

    def spied(self, inputs, store):
        phase[0] = "capture"
        try:
            with Ops():
                return original(self, inputs, store)
        except Exception:
            print("".join(traceback.format_exc()))
            print("the last operations before the error (newest last):")
            for line in ring:
                print("   ", line)
            raise
        finally:
            phase[0] = "replay"

    capture.CapturedStep._capture = spied
    stream.KEEP_WHEN_CAPTURED = not a.replayed
    torch.set_default_dtype(torch.float64)
    dev = torch.device("cpu" if a.cpu else "cuda")
    x, g, y, mask = zoo_graph()
    x, y, mask, ei = x.to(dev), y.to(dev), mask.to(dev), g["edge_index"].to(dev)
    torch.manual_seed(0)
    model = (GCN(8, 16, num_layers=3, out_channels=3, cached=True) if a.model == "GCN" else gcnii(8, 12, 3, 4)).to(dev)
    engine = GNNPipeEngine(copy.deepcopy(model), PipelineConfig(num_chunks=4, partition=ranges, recompute=False),
                           Comm(dev), num_stages=1)
    model = engine.module
    engine.install()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(5):
            out = model(x, ei)
            loss = F.cross_entropy(out[mask], y[mask])
            opt.zero_grad()
            loss.backward()
            opt.step()
    engine.uninstall()
    captured = engine.runtime.captured
    print(f"captured: {captured is not None and captured.graphs is not None}, "
          f"off: {captured.off if captured is not None else 'not on CUDA'}")
    for w in seen:
        print("warning:", str(w.message).splitlines()[0][:300], f"({w.filename}:{w.lineno})")


if __name__ == "__main__":
    main()
