"""Can a training step be captured as a CUDA graph, and what would a captured step cost? (a probe)

Before building captured chunk programs (design.md §12) this asks the device two questions, on the
16-layer GCNII of ``gpu_summary.py`` (20k-vertex community graph, ``adj_t``, fused kernels):

1. plain PyG's forward + backward captured whole (``torch.cuda.graph``) against the same uncaptured: the
   time a replay takes, and whether its gradients equal the uncaptured ones (the kernels launch on the
   current stream, or they would be missing from the replay and the gradients would differ);
2. the engine streaming 4 chunks on one device, forward + backward captured whole the same way: whether the
   capture succeeds (a host synchronisation or a value-dependent allocation inside the engine's step makes
   it raise; the error and the engine frame that caused it are printed), and if it does, the replay's time
   and its gradients against the uncaptured step.

(A third question, one chunk-sized GCN2Conv call captured alone, was dropped after its first run: PyG's
layer copied a CPU tensor during the capture, which a capture refuses; docs/benchmarks.md, third GPU run.)

    python benchmarks/gpu/capture_probe.py --out docs/results/gpu/capture_probe.json

Needs a CUDA device; a measurement, never a test.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(float((a[k] - b[k]).abs().max()) for k in a) if a else 0.0


def _median_ms(fn, n: int = 10) -> float:
    import torch
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def capture_step(model, x, graph, y, idx) -> dict:
    """Forward + loss + backward of ``model`` captured whole; its replay against the uncaptured step."""
    import torch
    import torch.nn.functional as F

    def step():
        for p in model.parameters():
            p.grad = None
        out = model(x, graph)
        loss = F.cross_entropy(out.index_select(0, idx), y)
        loss.backward()
        return loss

    result = {}
    step()
    eager_grads = _grads(model)
    result["eager_ms"] = _median_ms(step)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    for p in model.parameters():
        p.grad = None
    t0 = time.perf_counter()
    try:
        with torch.cuda.graph(g):
            out = model(x, graph)
            static_loss = F.cross_entropy(out.index_select(0, idx), y)
            static_loss.backward()
    except Exception as exc:  # noqa: BLE001 - the probe reports whatever stopped the capture
        tb = traceback.extract_tb(exc.__traceback__)
        ours = [f"{f.filename.split('pyg_pipe/')[-1]}:{f.lineno} {f.name}: {f.line}" for f in tb
                if "pyg_pipe" in f.filename and "benchmarks" not in f.filename]
        result.update(captured=False, error=f"{type(exc).__name__}: {str(exc)[:300]}", frames=ours[-6:])
        torch.cuda.synchronize()
        return result
    result["capture_s"] = time.perf_counter() - t0
    g.replay()
    torch.cuda.synchronize()
    replay_grads = _grads(model)
    result.update(captured=True, replay_ms=_median_ms(g.replay),
                  grad_max_diff=_max_diff(eager_grads, replay_grads))
    result["speedup"] = result["eager_ms"] / result["replay_ms"]
    del g
    return result


def main() -> None:
    import torch
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu/capture_probe.py: no CUDA device here; nothing to run.")
        return
    dev = torch.device("cuda")
    from benchmarks.gpu.gpu_summary import _Engine, _ns
    from benchmarks.speed.gnnpipe_epoch import build
    from pyg_pipe import ops
    data, model = build(_ns(args.nodes))
    data, model = data.to(dev), model.to(dev)
    idx = data.train_mask.nonzero().view(-1)
    y = data.y.index_select(0, idx)
    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "nodes": args.nodes,
           "chunks": args.chunks}

    def report(key, value):
        out[key] = value
        print(key, json.dumps(value), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)

    plain = copy.deepcopy(model)
    with ops.fused_kernels():
        ops.fuse_messages(plain)
        report("plain_whole_step", capture_step(plain, data.x, data.adj_t, y, idx))
    try:
        with _Engine(model, dev, num_chunks=args.chunks):
            report("stream_whole_step", capture_step(model, data.x, data.adj_t, y, idx))
    except Exception as exc:  # noqa: BLE001
        report("stream_whole_step", {"captured": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})


if __name__ == "__main__":
    main()
