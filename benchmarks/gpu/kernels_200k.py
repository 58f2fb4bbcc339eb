"""Which GPU kernels a step spends its time in at 200k vertices: plain PyG against the captured streamed step
(16-layer GCNII, 4 chunks, fused kernels), from torch.profiler. A measurement, never a test.

    python benchmarks/gpu/kernels_200k.py --out docs/results/gpu/kernels_200k.json
"""
import argparse, copy, json, os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    import torch
    from benchmarks.gpu.gpu_profile import profile
    from benchmarks.gpu.gpu_summary import _Engine, _ns, _step_fn
    from benchmarks.speed.gnnpipe_epoch import build
    from pyg_pipe import ops
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=200_000)
    p.add_argument("--keep", action="store_true",
                   help="also the captured step keeping activations (stream.KEEP_WHEN_CAPTURED)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    data, model = build(_ns(a.nodes))
    data, model = data.to(dev), model.to(dev)
    plain = copy.deepcopy(model)
    kept = copy.deepcopy(model)
    out = {}
    with ops.fused_kernels():
        ops.fuse_messages(plain)
        out["plain"] = profile(_step_fn(plain, data), 2)
    with _Engine(model, dev, num_chunks=4) as engine:
        step = _step_fn(model, data)
        step()  # (profile() runs two more eager steps: the capture is its third)
        out["stream_captured"] = profile(step, 2)
        out["captured"] = engine.runtime.captured.graphs is not None
    keys = ["plain", "stream_captured"]
    if a.keep:
        from pyg_pipe.engine.step import stream
        stream.KEEP_WHEN_CAPTURED = True
        with _Engine(kept, dev, num_chunks=4, recompute=False) as engine:
            step = _step_fn(kept, data)
            step()
            out["stream_captured_kept"] = profile(step, 2)
            out["captured_kept"] = engine.runtime.captured.graphs is not None
        keys.append("stream_captured_kept")
    for k in keys:
        print(k, round(out[k]["gpu_busy_ms"], 1), "ms busy")
        for row in out[k]["top_gpu_kernels"][:12]:
            print("   ", row)
    if a.out:
        json.dump(out, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
