"""Runs a function on several gloo processes for tests, with a hard timeout and error propagation."""
from __future__ import annotations

import os
import pickle
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, backend: str, env: dict, fn, args) -> None:
    os.environ.clear()  # the caller's environment, as a spawned child would have it (not the server's)
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # a collective waits this long for a slow peer (a loaded 2-core machine runs sweeps of slow cases); a peer
    # that fails closes its connections, which ends the wait at once, and run_distributed bounds the whole test
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=180))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


# Children are forked from one server process that imported these once (``forkserver``), not started
# afresh (``spawn``): a fresh interpreter importing torch and PyG costs 3 s a process on a loaded 2-core
# machine, 13 s for a 4-process test, which was most of the suite's time. The server imports modules only
# (no tensor work, so no thread pools exist when it forks), and every child still initialises its own
# process group, as a spawned one would. NCCL runs keep ``spawn``: a process that touched CUDA must not fork.
_PRELOAD = ["torch", "torch.distributed", "torch_geometric", "pyg_pipe", "tests.dist", "tests.harness"]
mp.set_forkserver_preload(_PRELOAD)


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo",
                    cuda: bool = False) -> None:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` new processes.

    The first process to fail makes the others terminate and its exception (with traceback) is
    raised here (a rank that only lost its connection to a peer that failed is passed over for that peer:
    :func:`_join`); if the processes have not all finished after ``timeout`` seconds they are killed
    and ``TimeoutError`` is raised, so a test can never hang. ``backend="nccl"`` puts rank ``r`` on
    CUDA device ``r`` (tests marked ``gpu``).
    """
    ctx = mp.start_processes(_entry, args=(world_size, free_port(), backend, dict(os.environ), fn, args),
                             nprocs=world_size, join=False,
                             start_method="spawn" if backend == "nccl" or cuda else "forkserver")
    deadline = time.monotonic() + timeout
    while not _join(ctx):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"distributed test did not finish within {timeout} s")


#: what a rank raises when a peer it talks to has gone: not the cause of a failure
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "DistBackendError", "Broken pipe",
             "Socket closed", "Connection refused")


def _join(ctx, grace: float = 5.0) -> bool:
    """``ctx.join`` for half a second; on a failure, the error of the rank that failed first *in substance*.

    The first process to exit with an error is not always the one that failed: when rank 1 raises in the middle of
    a pipeline's fill, rank 0 can lose its stage link and exit with gloo's "connection closed" before rank 1's own
    exit is seen. So the others get ``grace`` seconds to exit (a peer that failed has already written its error),
    and an error that only says a peer went away gives way to another rank's error that does not."""
    try:
        return ctx.join(timeout=0.5, grace_period=grace)
    except mp.ProcessRaisedException as exc:
        if not any(words in str(exc) for words in LOST_PEER):
            raise
        for i, path in enumerate(ctx.error_files):
            if i == exc.error_index or not os.access(path, os.R_OK) or os.path.getsize(path) == 0:
                continue
            with open(path, "rb") as fh:
                trace = pickle.load(fh)
            if not any(words in trace for words in LOST_PEER):
                raise mp.ProcessRaisedException(
                    f"\n\n-- Process {i} terminated with the following error (process {exc.error_index} exited "
                    f"first, having lost its peer):\n{trace}", i, ctx.processes[i].pid) from None
        raise
