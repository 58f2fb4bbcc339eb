"""Streaming with the host tier on one GPU: the step against plain PyG's, and where the host's time goes.

``offload="host"`` with no device budget keeps every value between layer groups in pinned host memory and
streams chunks through the GPU (NGra): the mode for graphs beyond the GPU's memory. The sixth GPU run
(docs/benchmarks.md) measured its step at 19.9x plain PyG's at 200k vertices (815 against 41 ms, H200), where
streaming with the values on the device takes 1.6x. This script times it side by side with plain PyG (16-layer
GCNII, ``adj_t``, the fused kernels, the generated community graph) and profiles it twice:

* ``torch.profiler`` (CPU and CUDA): GPU busy time against wall time, host synchronisations, copies, and the
  operators with the most host time;
* ``cProfile`` of one step: the Python functions with the most own time (the store's gathers, adds and waits).

    python benchmarks/gpu/host_tier.py --nodes 200000 --chunks 4 --out docs/results/gpu/host_tier.json
    python benchmarks/gpu/host_tier.py --device cpu --nodes 2000     # the script itself, on a CPU

A measurement, never a test.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--nodes", type=int, default=200_000)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from benchmarks.gpu.gpu_summary import _Engine, _ns, _step_fn, _timed
    from benchmarks.speed.gnnpipe_epoch import build
    from pyg_pipe import ops
    dev = torch.device(args.device)
    data, model = build(_ns(args.nodes))
    data, model = data.to(dev), model.to(dev)
    plain_model = copy.deepcopy(model)
    with ops.fused_kernels():
        ops.fuse_messages(plain_model)
        plain = _timed(_step_fn(plain_model, data), dev, args.steps)
    del plain_model
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "nodes": args.nodes,
           "chunks": args.chunks, "plain_s": plain}
    with _Engine(model, dev, num_chunks=args.chunks, offload="host", offload_budget=0) as engine:
        step = _step_fn(model, data)
        host = _timed(step, dev, args.steps)
        out.update(host_tier_s=host, host_tier_ratio=host / plain, keep_activations=engine.runtime.stream_keep,
                   reads_ahead=sum(st.prefetched for st in engine.runtime.stores.values()),
                   threads=torch.get_num_threads())
        print(f"plain {plain * 1e3:.1f} ms, host tier {host * 1e3:.1f} ms: {host / plain:.2f}x", flush=True)
        if dev.type == "cuda":
            from benchmarks.gpu.gpu_profile import profile
            prof = profile(step, 2)
            out["profile"] = prof
            out["gpu_busy_share"] = prof["gpu_busy_ms"] / prof["wall_ms"]
            print(json.dumps(prof, indent=1), flush=True)
        pr = cProfile.Profile()
        pr.enable()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        pr.disable()
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(20)
        out["cprofile"] = text.getvalue()
        print(out["cprofile"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
