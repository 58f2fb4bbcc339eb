"""The GPU issue's figures in one run, written to one ``summary.json`` (``bash benchmarks/gpu.sh`` calls it).

On one CUDA device, a 16-layer GCNII (hidden 64, ``adj_t``, the fused kernels routed in) on the generated
community graph, plain PyG against the engine on the same GPU:

``stream_ratio_20k`` / ``stream_ratio_200k``
    the engine's step streaming 4 chunks (NGra, one device; captured as CUDA graphs after two eager steps,
    engine/step/capture.py) ÷ plain PyG's step (median of timed steps after a device synchronize, both in
    this process, one after the other; the capture keeps every chunk's activations where the engine keeps
    them, ``stream.KEEP_WHEN_CAPTURED``); ``*_uncaptured``: the same with ``cuda_graphs=False``;
    ``*_replayed_in_capture``: captured, replaying each chunk's forward in the backward (the fallback of a
    capture that fails keeping activations; the default before the fifth GPU run);
``host_ms_per_chunk_layer``
    (streamed step − plain step) ÷ (chunks × layers) at 20k vertices, where the GPU idles most of the step:
    what the engine adds per (chunk, layer), forward and backward;
``gpu_busy_share_200k``, ``copies_per_step_200k``, ``gpu_work_ratio_200k``
    from ``torch.profiler`` over the streamed steps at 200k: the GPU's busy time (kernels and copies) ÷ the
    wall time, the memory copies per step, and the GPU's busy time ÷ plain PyG's (profiled the same way);
``largest_vertices_plain`` / ``largest_vertices_stream``
    the largest graph (doubling from ``--sweep-start``) on which one training step of the same model runs,
    each trial in a fresh process with the CUDA allocator capped at ``--cap-gib`` (so the sweep stays small
    and fast; the ratio is the point): plain PyG, and the engine streaming with every value between layers
    in pinned host memory (``offload="host"``, budget 0) and ``8 × size ÷ largest plain size`` chunks (at
    least 4); the trials of a round (plain PyG: 4 sizes, streaming: 3 and the largest plain one) run at once, in
    processes of their own, so their times overlap (``stream_step_s``: each trial's own seconds, contended);
    ``trials`` lists each with its peak memory, the data's megabytes and, streamed, the engine's graph structures
    after the step (chunked graphs, local adjacencies: what stays on the device with the values in host memory);
    ``loss_gap_at_plain_max``: |loss of the streamed step − plain PyG's| on the largest plain graph;
``pipeline_2proc_ratio``
    2 processes on this one GPU, 2 pipeline stages, 4 chunks, gloo with the transport staging CUDA tensors
    through host memory (:class:`pyg_pipe.engine.Comm`), ÷ plain PyG, at 20k vertices.

    python benchmarks/gpu/gpu_summary.py --out docs/results/gpu/summary.json
    python benchmarks/gpu/gpu_summary.py --device cpu --small      # the script itself, on a CPU, in seconds

A measurement, never a test. With ``--device cpu`` the profiler figures are left out.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

LAYERS, HIDDEN = 16, 64


def _ns(nodes: int, graph: str = "community"):
    return argparse.Namespace(graph=graph, nodes=nodes, degree=20.0, features=64, classes=8, model="gcnii",
                              layers=LAYERS, hidden=HIDDEN)


def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _step_fn(model, data):
    import torch
    import torch.nn.functional as F
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step() -> float:
        out = model(data.x, data.adj_t)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def _timed(step, dev, steps: int, warmup: int = 2) -> float:
    """Median seconds of ``steps`` steps after ``warmup`` (each timed after a device synchronize)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Engine:
    """The engine on ``model`` for the block (one device), the fused kernels routed in."""

    def __init__(self, model, dev, **cfg):
        from pyg_pipe import ops
        from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
        self.engine = GNNPipeEngine(model, PipelineConfig(**cfg), Comm(dev), num_stages=1)
        self.kernels = ops.fused_kernels()

    def __enter__(self):
        self.kernels.__enter__()
        self.engine.install()
        return self.engine

    def __exit__(self, *exc):
        self.engine.uninstall()
        self.kernels.__exit__(*exc)


def stream_ratio(nodes: int, dev, chunks: int, steps: int, profile: bool) -> dict:
    from benchmarks.speed.gnnpipe_epoch import build
    data, model = build(_ns(nodes))
    data, model = data.to(dev), model.to(dev)
    plain_model = copy.deepcopy(model)
    from pyg_pipe import ops
    plain_busy = None
    with ops.fused_kernels():
        ops.fuse_messages(plain_model)
        plain = _timed(_step_fn(plain_model, data), dev, steps)
        if profile and dev.type == "cuda":  # plain PyG's GPU work, for the streamed step's ratio to it
            from benchmarks.gpu.gpu_profile import profile as run_profile
            plain_busy = run_profile(_step_fn(plain_model, data), steps)["gpu_busy_ms"]
    uncaptured_model = copy.deepcopy(model)
    with _Engine(uncaptured_model, dev, num_chunks=chunks, cuda_graphs=False):
        uncaptured = _timed(_step_fn(uncaptured_model, data), dev, steps, warmup=3)
    del uncaptured_model
    host_tier = None
    if profile:  # every value between layer groups in pinned host memory, read ahead on a side stream
        host_model = copy.deepcopy(model)
        with _Engine(host_model, dev, num_chunks=chunks, offload="host", offload_budget=0) as engine:
            host_tier = _timed(_step_fn(host_model, data), dev, steps, warmup=2)
            read_ahead = sum(st.prefetched for st in engine.runtime.stores.values())
        del host_model
    replayed = _replaying_capture(model, data, dev, chunks, steps)
    with _Engine(model, dev, num_chunks=chunks) as engine:
        step = _step_fn(model, data)
        stream = _timed(step, dev, steps, warmup=3)  # (two eager steps, then the capture: step/capture.py)
        assert engine.plan.streaming
        captured = engine.runtime.captured
        out = {"nodes": nodes, "chunks": chunks, "plain_s": plain, "stream_s": stream, "ratio": stream / plain,
               "uncaptured_s": uncaptured, "uncaptured_ratio": uncaptured / plain,
               "captured": captured is not None and captured.graphs is not None,
               "uncaptured_because": captured.off if captured is not None else None,
               "replayed_in_capture_s": replayed, "replayed_in_capture_ratio": replayed / plain}
        if host_tier is not None:
            out.update(host_tier_s=host_tier, host_tier_ratio=host_tier / plain, host_tier_reads_ahead=read_ahead)
        if profile and dev.type == "cuda":
            from benchmarks.gpu.gpu_profile import profile as run_profile
            prof = run_profile(step, steps)
            out["profile"] = prof
            out["gpu_busy_share"] = prof["gpu_busy_ms"] / prof["wall_ms"]
            out["copies_per_step"] = sum(n for k, n in prof["copies_per_step"].items() if k.startswith("Memcpy"))
            out["plain_gpu_busy_ms"] = plain_busy
            out["gpu_work_ratio"] = prof["gpu_busy_ms"] / plain_busy
    return out


def _replaying_capture(model, data, dev, chunks: int, steps: int) -> float:
    """The captured step replaying each chunk's forward in its backward (``stream.KEEP_WHEN_CAPTURED`` off:
    what a capture that fails keeping activations falls back to), on a copy of ``model``: seconds a step."""
    from pyg_pipe.engine.step import stream
    model, before = copy.deepcopy(model), stream.KEEP_WHEN_CAPTURED
    stream.KEEP_WHEN_CAPTURED = False
    try:
        with _Engine(model, dev, num_chunks=chunks):
            return _timed(_step_fn(model, data), dev, steps, warmup=3)
    finally:
        stream.KEEP_WHEN_CAPTURED = before


def _one_step(nodes: int, dev, plain_max: int | None, trial: dict) -> float:
    """One training step at ``nodes`` vertices: plain PyG (``plain_max`` None) or streamed; its loss. ``trial`` gets
    the megabytes of the user's data and, streamed, of the engine's graph structures after the step (what stays on
    the device while the values between layers are in host memory)."""
    from benchmarks.speed.gnnpipe_epoch import build
    from pyg_pipe.engine.plan.memory_cost import reachable
    data, model = build(_ns(nodes, graph="random"))
    data, model = data.to(dev), model.to(dev)
    seen = set(reachable([v for _, v in data.items()]))
    trial["data_mb"] = sum(reachable([v for _, v in data.items()]).values()) / 2**20
    if plain_max is None:
        from pyg_pipe import ops
        with ops.fused_kernels():
            ops.fuse_messages(model)
            return float(_step_fn(model, data)())
    chunks = max(4, 8 * -(-nodes // plain_max))  # (4 x ran out at 2 x the plain size: the chunks' graphs dominate)
    trial["chunks"] = chunks
    with _Engine(model, dev, num_chunks=chunks, offload="host", offload_budget=0, partition="contiguous") as engine:
        loss = float(_step_fn(model, data)())
        rt = engine.runtime
        for name, roots in (("chunked_graphs_mb", [rt.chunked]), ("local_adjacencies_mb", [rt.adjacency])):
            found = reachable(roots, seen)
            seen |= set(found)
            trial[name] = sum(found.values()) / 2**20
        return loss


def _trial_main(nodes: int, plain_max: int, device: str, cap_gib: float) -> None:
    """One trial of the sweep, in a process of its own (``--trial``): prints one JSON line.

    Each trial gets a fresh process, so nothing an earlier part left on the device counts against the cap: the
    fourth GPU run swept in the process that had just captured CUDA graphs, whose private pools (12.5 GiB in use)
    made 400k vertices fail for plain PyG and streaming alike after 98 MiB. The cap is a fraction of the card
    (``torch.cuda.set_per_process_memory_fraction``), set before anything is allocated."""
    import torch
    dev = torch.device(device)
    trial = {"nodes": nodes, "mode": "plain" if plain_max == 0 else "stream"}
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, cap_gib * 2**30 / torch.cuda.get_device_properties(index).total_memory), index)
    t0 = time.perf_counter()
    try:
        trial["loss"] = _one_step(nodes, dev, plain_max or None, trial)
        trial["ok"] = True
    except torch.OutOfMemoryError as exc:
        trial["ok"], trial["error"] = False, str(exc)[:300]
    except RuntimeError as exc:  # the fused kernels' allocations report CUDA OOM as a RuntimeError
        if "out of memory" not in str(exc):
            raise
        trial["ok"], trial["error"] = False, str(exc)[:300]
    trial["seconds"] = time.perf_counter() - t0
    if dev.type == "cuda":
        trial["peak_mb"] = torch.cuda.max_memory_allocated(dev) / 2**20
        trial["reserved_peak_mb"] = torch.cuda.max_memory_reserved(dev) / 2**20
    print("TRIAL " + json.dumps(trial), flush=True)


TRIALS: list = []


def _fits(sizes: list, dev, plain_max: int | None, cap_gib: float) -> dict:
    """``{nodes: loss}`` of one step at each of ``sizes`` vertices, each in a fresh process under the cap, all at once
    (one GPU holds several 2 GiB caps; the trials' times overlap, their memory does not), the loss ``None`` where it
    ran out of memory (a trial that fails otherwise stops the sweep with its error)."""
    import subprocess
    runs = [(n, subprocess.Popen([sys.executable, os.path.abspath(__file__), "--trial", str(n), str(plain_max or 0),
                                  "--device", str(dev), "--cap-gib", str(cap_gib)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) for n in sizes]
    out = {}
    for n, run in runs:
        stdout, stderr = run.communicate(timeout=600)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("TRIAL ")]
        if run.returncode != 0 or not lines:
            raise RuntimeError(f"sweep trial {n} ({'plain' if plain_max is None else 'stream'}) failed "
                               f"(rc {run.returncode}):\n{stderr[-3000:]}")
        trial = json.loads(lines[-1][len("TRIAL "):])
        TRIALS.append(trial)
        print(f"  sweep: {trial['mode']} {n}: {'ok' if trial['ok'] else 'out of memory'} in {trial['seconds']:.1f} s, "
              f"peak {trial.get('peak_mb', float('nan')):.0f} MB", flush=True)
        out[n] = trial["loss"] if trial["ok"] else None
    return out


def _doubling(first: int, dev, plain_max: int | None, cap_gib: float, limit_s: float, per_round: int, also=()):
    """The doubling sweep from ``first`` vertices, ``per_round`` sizes a round run at once (and ``also``, in the
    first): ``(largest size that fit with every smaller one, its loss, why it stopped, {size: loss} of each)``."""
    best, loss, n, t0, seen = None, None, first, time.perf_counter(), {}
    while time.perf_counter() - t0 < limit_s:
        sizes = [n * 2 ** k for k in range(per_round)]
        seen.update(_fits(list(also) + sizes, dev, plain_max, cap_gib))
        also = ()
        for size in sizes:
            if seen[size] is None:
                return best, loss, "memory", seen
            best, loss = size, seen[size]
        n = sizes[-1] * 2
    return best, loss, f"the {limit_s:.0f} s limit", seen


def largest(dev, start: int, limit_s: float, cap_gib: float, per_round=(4, 3)) -> dict:
    """The doubling sweep (module docstring), each trial in a fresh process, a round of them at once (``per_round``:
    plain PyG's sizes, streaming's)."""
    out = {}
    _one_step(1000, dev, None, {})   # the kernels' first build (a minute) is not the sweep's time (the trials
    _one_step(1000, dev, 500, {})    # load them from the extension cache)
    TRIALS.clear()
    plain_max, loss_plain, out["plain_stopped_by"], _ = _doubling(start, dev, None, cap_gib, limit_s, per_round[0])
    out["largest_vertices_plain"] = plain_max
    if plain_max is None:
        out["trials"] = TRIALS
        return out
    t0 = time.perf_counter()
    last, _, stopped, seen = _doubling(plain_max * 2, dev, plain_max, cap_gib, limit_s, per_round[1],
                                       also=(plain_max,))
    loss_stream = seen.get(plain_max)
    out["loss_gap_at_plain_max"] = abs(loss_plain - loss_stream) if loss_stream is not None else None
    out["stream_step_s"] = {str(t["nodes"]): t["seconds"] for t in TRIALS if t["mode"] == "stream" and t["ok"]}
    out["stream_round_s"] = time.perf_counter() - t0
    out["largest_vertices_stream"] = last if last is not None else plain_max if loss_stream is not None else None
    out["trials"] = TRIALS
    out["sweep_stopped_by"] = stopped
    return out


def _pipeline_worker(rank: int, world: int, port: int, nodes: int, steps: int, dev_name: str, q) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from benchmarks.speed.gnnpipe_epoch import build
        from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
        dev = torch.device(dev_name)
        data, model = build(_ns(nodes))
        data, model = data.to(dev), model.to(dev)
        engine = GNNPipeEngine(model, PipelineConfig(num_chunks=4, balance="layers"), Comm(dev), num_stages=world)
        engine.install()
        s = _timed(_step_fn(model, data), dev, steps)
        engine.uninstall()
        if rank == 0:
            q.put({"step_s": s, "staging": engine.comm.staging})
    finally:
        dist.destroy_process_group()


def pipeline_2proc(nodes: int, dev, steps: int, plain_s: float) -> dict:
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_pipeline_worker, args=(2, port, nodes, steps, str(dev), q), nprocs=2, join=True,
                       start_method="spawn")
    got = q.get(timeout=10)
    return {"nodes": nodes, "step_s": got["step_s"], "plain_s": plain_s, "staging": got["staging"],
            "ratio": got["step_s"] / plain_s}


def main() -> None:
    import torch
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--cap-gib", type=float, default=2.0)
    p.add_argument("--sweep-start", type=int, default=25_000)
    p.add_argument("--sweep-seconds", type=float, default=120.0)
    p.add_argument("--small", action="store_true", help="tiny sizes (checks the script, measures nothing)")
    p.add_argument("--skip", nargs="*", default=[], choices=["ratios", "sweep", "pipeline"])
    p.add_argument("--out", default=None)
    p.add_argument("--trial", nargs=2, type=int, metavar=("NODES", "PLAIN_MAX"),
                   help="one trial of the sweep in this process (PLAIN_MAX 0: plain PyG); prints one JSON line")
    args = p.parse_args()
    if args.trial:
        return _trial_main(args.trial[0], args.trial[1], args.device, args.cap_gib)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu/gpu_summary.py: no CUDA device here; nothing to run.")
        return
    small, big = (2_000, 8_000) if args.small else (20_000, 200_000)
    summary = {"date": datetime.date.today().isoformat(),
               "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "torch": torch.__version__, "model": f"GCNII, {LAYERS} layers, hidden {HIDDEN}, adj_t",
               "cap_gib": args.cap_gib}
    t_start = time.perf_counter()

    def done(what):
        print(f"[{time.perf_counter() - t_start:6.1f} s] {what}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=1)

    if "ratios" not in args.skip:
        r20 = stream_ratio(small, dev, 4, args.steps, profile=False)
        summary["stream_ratio_20k"] = r20["ratio"]
        summary["host_ms_per_chunk_layer"] = (r20["stream_s"] - r20["plain_s"]) * 1e3 / (4 * LAYERS)
        summary["stream_ratio_20k_uncaptured"] = r20["uncaptured_ratio"]
        summary["stream_ratio_20k_replayed_in_capture"] = r20["replayed_in_capture_ratio"]
        summary["host_ms_per_chunk_layer_uncaptured"] = (r20["uncaptured_s"] - r20["plain_s"]) * 1e3 / (4 * LAYERS)
        summary["detail_20k"] = r20
        done(f"20k: plain {r20['plain_s'] * 1e3:.1f} ms, streamed {r20['stream_s'] * 1e3:.1f} ms (captured: "
             f"{r20['captured']}), uncaptured {r20['uncaptured_s'] * 1e3:.1f} ms")
        r200 = stream_ratio(big, dev, 4, args.steps, profile=True)
        summary["stream_ratio_200k"] = r200["ratio"]
        summary["stream_ratio_200k_uncaptured"] = r200["uncaptured_ratio"]
        summary["stream_ratio_200k_replayed_in_capture"] = r200["replayed_in_capture_ratio"]
        summary["gpu_busy_share_200k"] = r200.get("gpu_busy_share")
        summary["copies_per_step_200k"] = r200.get("copies_per_step")
        summary["gpu_work_ratio_200k"] = r200.get("gpu_work_ratio")
        summary["stream_ratio_200k_host_tier"] = r200.get("host_tier_ratio")  # offload="host", read ahead
        summary["detail_200k"] = r200
        done(f"200k: plain {r200['plain_s'] * 1e3:.1f} ms, streamed {r200['stream_s'] * 1e3:.1f} ms (captured: "
             f"{r200['captured']}), uncaptured {r200['uncaptured_s'] * 1e3:.1f} ms")
    if "pipeline" not in args.skip:
        plain_s = summary.get("detail_20k", {}).get("plain_s")
        if plain_s is None:
            plain_s = stream_ratio(small, dev, 4, args.steps, profile=False)["plain_s"]
        r = pipeline_2proc(small, dev, args.steps, plain_s)
        summary["pipeline_2proc_ratio"] = r["ratio"]
        summary["detail_pipeline_2proc"] = r
        done(f"2 processes on one device: {r['step_s'] * 1e3:.1f} ms a step (staging: {r['staging']})")
    if "sweep" not in args.skip:
        start = 500 if args.small else args.sweep_start
        summary.update(largest(dev, start, 20.0 if args.small else args.sweep_seconds, args.cap_gib,
                               (1, 1) if args.small else (4, 3)))
        done(f"largest graphs: plain {summary['largest_vertices_plain']}, "
             f"streamed {summary.get('largest_vertices_stream')}")
    print(json.dumps({k: v for k, v in summary.items() if not k.startswith("detail")}, indent=1))


if __name__ == "__main__":
    main()
