"""Fused CSR gather-aggregate: the compiled kernels, their build, and the fallbacks behind one call.

``csr_aggregate(rowptr, col, x, value, reduce)`` computes, for every destination row ``i`` of a CSR
adjacency (rows = destinations, ``col`` = global source ids into ``x``)::

    out[i] = REDUCE_{e = rowptr[i] .. rowptr[i+1]-1}  value[e] * x[col[e]]        (value[e] = 1 without values)

with REDUCE one of ``sum``, ``mean`` (the sum divided by the row's edge count) and ``max``; rows without
edges give 0, as PyG's ``scatter`` and ``torch.sparse.mm`` do. It is differentiable w.r.t. ``x`` and
``value``. The compiled kernels never build the ``[E, d]`` message tensor that PyG's default path
(``x[src]`` then scatter) does: each output row is accumulated in registers.

Backends, tried in this order for the device of ``x`` (``backend()`` says which one is used):

====================  ==============================================================================
``"cpp"``             ``extensions/csr_aggregate.cpp`` (OpenMP), JIT-built on first use
``"cuda"``            ``extensions/csr_aggregate_cuda.cu``, built only where CUDA and nvcc exist
``"torch_sparse"``    ``torch_sparse.matmul`` when the optional torch-sparse package is installed
``"torch"``           ``torch.sparse.mm`` on a CSR tensor (``max`` on CUDA: index_select + scatter)
====================  ==============================================================================

The kernels are built with ``torch.utils.cpp_extension.load`` (g++ with OpenMP, and ninja) into the
torch extensions directory (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions/<pyXY_cpu>``)
under a name that carries a hash of the source, the flags, the torch version and the CPU, so an edited
source rebuilds and an unchanged one loads in well under a second. A build (30 s to 2 min on CPU) is
announced on stderr through ``logging`` (logger ``pyg_pipe.ops.aggregate``, level WARNING) by the process
that runs it; a cached load says nothing.

Concurrent processes (gloo workers) and killed builds: ``load`` is called only while holding an
exclusive ``fcntl.flock`` on ``pyg_pipe.lock`` in the build directory. The OS drops that lock when
its holder exits, however it dies, so it is never stale: one process builds, the others wait for the
lock and then load the finished build. torch's own lock file (``lock``, a ``FileBaton`` that a killed
build leaves behind and that makes every later ``load`` wait forever) can then only be left over from a
dead holder, and the holder of the ``flock`` removes it before calling ``load``. Waiting is bounded by
``PYG_PIPE_BUILD_TIMEOUT`` seconds (default 600), after which the process falls back.

Set ``PYG_PIPE_DISABLE_EXTENSIONS=1`` to skip the compiled kernels. A build that fails, a lock that
cannot be taken in time, or sources that are missing (a wheel install without ``extensions/``), give
one ``UserWarning`` per process and the fallback; never an error.

Backward: ``sum``/``mean`` w.r.t. ``x`` run the same row-loop kernel over the transposed adjacency
(counting sort, cached per graph by ``_transposed``), so no atomics and a deterministic result on both
CPU and CUDA; w.r.t. ``value`` a per-edge dot product ``<grad_out[i], x[col[e]]>`` (divided by the
degree for ``mean``); ``max`` routes the gradient through the arg-max edge recorded in the forward
(on CUDA with atomic adds, so that one is not deterministic).

``csr_gated_aggregate(rowptr, col, a, b, c, reduce)`` is the gated Gather of NGra's G-GCN (PyG's
``ResGatedGraphConv``), ``out[i] = REDUCE_e sigmoid(a[i] + b[col[e]]) * c[col[e]]`` (sum or mean): the
compiled kernels keep the per-edge, per-feature gate in registers and recompute it in the backward, so
neither pass stores anything of size ``[E, d]``; without them it runs the same formula on edge lists.

Usage::

    from pyg_pipe.ops import csr_aggregate
    out = csr_aggregate(rowptr, col, x, value=None, reduce="mean")          # all rows
    out = csr_aggregate(rowptr, col, x, reduce="sum", row_start=a, row_end=b)  # rows a..b-1 only
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import socket
import subprocess
import threading
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

__all__ = ["ENV_DISABLE", "backend", "clear_cache", "csr_aggregate", "csr_gated_aggregate", "extensions_enabled"]

ENV_DISABLE = "PYG_PIPE_DISABLE_EXTENSIONS"
ENV_BUILD_TIMEOUT = "PYG_PIPE_BUILD_TIMEOUT"
_REDUCE_CODE = {"sum": 0, "mean": 1, "max": 2}
_REDUCE_ALIASES = {"add": "sum", "sum": "sum", "mean": "mean", "max": "max", "amax": "max"}
_KERNEL_DTYPES = (torch.float32, torch.float64)

# --------------------------------------------------------------------------------------------
# building and loading the compiled kernels
# --------------------------------------------------------------------------------------------

_lock = threading.Lock()
_modules: dict = {}  # "cpu" / "cuda" -> loaded extension module, or None when unavailable
_warned = False
_log = logging.getLogger(__name__)

_DEFAULT_BUILD_TIMEOUT_S = 600.0
# CPU: 40-60 s measured on 2 idle cores, 70-190 s on busy ones; CUDA: not measured
_BUILD_TIME = {"cpu": "30 s to 2 min, more on a busy machine", "cuda": "a few minutes"}
_LOCK_FILE = "pyg_pipe.lock"   # our flock, in the build directory; never removed
_TORCH_LOCK_FILE = "lock"      # torch.utils.cpp_extension's FileBaton, in the build directory
_POLL_S = 0.5


class _BuildLockError(RuntimeError):
    """The build directory could not be locked (in time, or at all); the message names the fix."""


def _source_dir() -> Path:
    """``extensions/`` of a source checkout (next to the ``pyg_pipe`` package)."""
    return Path(__file__).resolve().parents[2] / "extensions"


def extensions_enabled() -> bool:
    """False when ``PYG_PIPE_DISABLE_EXTENSIONS`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(ENV_DISABLE, "").strip().lower() not in ("1", "true", "yes", "on")


def _cpu_signature() -> str:
    # -march=native code is only valid on the CPU that built it: keep builds for different CPUs
    # (a home directory shared by several machines) apart.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cflags() -> list:
    flags = ["-O3", "-DNDEBUG", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
    return flags


def _build_name(kind: str, sources: list, flags: list) -> str:
    h = hashlib.sha256()
    for src in sources:
        h.update(src.read_bytes())
    h.update(repr((flags, torch.__version__, torch.version.cuda, platform.python_version(),
                   _cpu_signature())).encode())
    return f"pyg_pipe_csr_aggregate_{kind}_{h.hexdigest()[:12]}"


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(message, UserWarning, stacklevel=4)


def _env_setting(name: str, default, parse: Callable, valid: Callable, error: Callable):
    """The environment variable ``name`` parsed (``default`` when unset or blank); ``error(raw)`` when it is
    not a valid value: the exception to raise, naming the variable and the fix."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise error(raw) from None
    if not valid(value):
        raise error(raw)
    return value


def _build_timeout() -> float:
    """Seconds to wait for another process's build: ``PYG_PIPE_BUILD_TIMEOUT``, default 600."""
    return _env_setting(ENV_BUILD_TIMEOUT, _DEFAULT_BUILD_TIMEOUT_S, float, lambda s: s > 0, lambda raw: _BuildLockError(
        f"{ENV_BUILD_TIMEOUT}={raw!r} is not a positive number of seconds; set it to "
        f"e.g. {_DEFAULT_BUILD_TIMEOUT_S:.0f} or unset it."))


def _library_exists(build_dir: Path, name: str) -> bool:
    # torch's load imports <build_dir>/<name>.so (its LIB_EXT on Linux and macOS)
    return (build_dir / f"{name}.so").is_file()


def _build_needed(build_dir: Path, name: str) -> bool:
    """Whether ``load`` is about to compile rather than just import: no library yet, or ninja has work.

    Call only while holding the build lock: ninja must not read its logs while another ninja writes them.
    """
    if not _library_exists(build_dir, name):
        return True
    try:
        dry_run = subprocess.run(["ninja", "-n"], cwd=build_dir, capture_output=True, text=True, timeout=60)
    except OSError:
        return False  # no ninja: torch's load fails with its own message before building anything
    return "no work to do" not in dry_run.stdout


@contextlib.contextmanager
def _build_lock(build_dir: Path, name: str, kind: str):
    """Hold the build directory exclusively while torch builds or loads the extension ``name``.

    An exclusive ``fcntl.flock`` on ``<build_dir>/pyg_pipe.lock``: the OS releases it when the
    holder exits, even on SIGKILL or OOM, so it is never stale. While waiting for it (at most
    ``PYG_PIPE_BUILD_TIMEOUT`` seconds, then ``_BuildLockError``) a process says once that it waits for
    another one's build. Once held: torch's ``lock`` file, if present, was left by a holder that died
    inside ``load`` and is removed (``load`` would otherwise wait on it forever), and a build that is
    about to happen is announced. The holder writes ``process <pid> on <host>`` into the file for the
    others' messages.
    """
    import fcntl

    timeout = _build_timeout()
    deadline = time.monotonic() + timeout
    path = build_dir / _LOCK_FILE
    what = f"the compiled {kind.upper()} aggregation kernels"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise _BuildLockError(f"cannot create the build lock {path} ({err}); point TORCH_EXTENSIONS_DIR at a "
                              "writable directory.") from err
    try:
        announced_wait = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            except OSError as err:
                raise _BuildLockError(f"cannot lock {path} ({err}); point TORCH_EXTENSIONS_DIR at a directory "
                                      "on a file system with file locks (a local disk).") from err
            owner = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            if time.monotonic() >= deadline:
                raise _BuildLockError(
                    f"gave up after waiting {timeout:.0f} s for {owner} to finish building them in {build_dir}. "
                    f"If that process is stuck, end it; to wait longer, set {ENV_BUILD_TIMEOUT} (seconds).")
            if not announced_wait and not _library_exists(build_dir, name):
                _log.warning("pyg_pipe: waiting for %s to finish building %s in %s (%s; giving up after %.0f s, "
                             "%s).", owner, what, build_dir, _BUILD_TIME[kind], timeout, ENV_BUILD_TIMEOUT)
                announced_wait = True
            time.sleep(_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        torch_lock = build_dir / _TORCH_LOCK_FILE
        try:
            torch_lock.unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            raise _BuildLockError(f"cannot remove the stale lock {torch_lock} ({err}); delete it by "
                                  "hand.") from err
        else:
            _log.warning("pyg_pipe: removed %s, left behind by a build of %s that was killed before it "
                         "finished.", torch_lock, what)
        if _build_needed(build_dir, name):
            _log.warning("pyg_pipe: building %s in %s. This takes %s, once per machine and source version; "
                         "later runs load the build in about a second. Set %s=1 to skip it and use the slower "
                         "'%s' path.", what, build_dir, _BUILD_TIME[kind], ENV_DISABLE, _fallback_name())
        yield
    finally:
        os.close(fd)  # releases the flock


def _load(kind: str):
    """Build (first use) and import one extension under the build directory's lock; the caller handles errors."""
    from torch.utils import cpp_extension

    src_dir = _source_dir()
    if kind == "cpu":
        sources = [src_dir / "csr_aggregate.cpp"]
        cflags = _cflags()
        extra = {"extra_cflags": cflags, "extra_ldflags": ["-fopenmp"]}
        flags = cflags
    else:
        sources = [src_dir / "csr_aggregate_cuda.cu"]
        cuda_flags = ["-O3", "-DNDEBUG"]
        extra = {"extra_cflags": ["-O3", "-DNDEBUG"], "extra_cuda_cflags": cuda_flags}
        flags = cuda_flags
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        raise FileNotFoundError(f"kernel sources not found: {', '.join(missing)} (pyg_pipe is not run "
                                "from a source checkout)")
    name = _build_name(kind, sources, flags)
    # torch's own choice of directory ($TORCH_EXTENSIONS_DIR or its default; created here), handed back to
    # load so that the lock and the build are certainly in the same place
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    with _build_lock(build_dir, name, kind):
        return cpp_extension.load(name=name, sources=[str(s) for s in sources], build_directory=str(build_dir),
                                  verbose=False, **extra)


def _fallback_message(kind: str, err: Exception) -> str:
    """The one warning for kernels that could not be built or loaded: the cause and what to do."""
    skip = f"set {ENV_DISABLE}=1 to skip the build and this warning."
    if isinstance(err, _BuildLockError):
        return (f"pyg_pipe: could not load the compiled {kind.upper()} aggregation kernels: {err} Using the "
                f"slower '{_fallback_name()}' path instead; {skip}")
    text = str(err).strip()
    return (f"pyg_pipe: could not build the compiled {kind.upper()} aggregation kernels "
            f"({type(err).__name__}: {text.splitlines()[-1] if text else ''}); using the slower "
            f"'{_fallback_name()}' path instead. Needs a C++ compiler with OpenMP"
            f"{' and nvcc' if kind == 'cuda' else ''} and ninja (`pip install ninja`); {skip}")


def _kernels(kind: str):
    """The loaded extension for ``kind`` ("cpu" or "cuda"), or None (disabled, unavailable, failed)."""
    if kind in _modules:
        return _modules[kind]
    with _lock:
        if kind in _modules:
            return _modules[kind]
        module = None
        if extensions_enabled() and (kind == "cpu" or _cuda_buildable()):
            slice_edges = _cuda_slice_edges() if kind == "cuda" else 0  # a bad value raises, never falls back
            try:
                module = _load(kind)
                if kind == "cuda":
                    module.set_slice_edges(slice_edges)
            except Exception as err:  # noqa: BLE001  (a failed build must never stop training)
                _warn_once(_fallback_message(kind, err))
        _modules[kind] = module
        return module


ENV_CUDA_SLICE_EDGES = "PYG_PIPE_CUDA_SLICE_EDGES"
_CUDA_SLICE_EDGES = 256


def _cuda_slice_edges() -> int:
    """Edges per slice of the CUDA sum/mean kernel (``PYG_PIPE_CUDA_SLICE_EDGES``; 0: one group per row).

    Slices of equal edge counts keep every warp busy on power-law graphs, where a row per group leaves
    the GPU waiting on the hub rows; docs/kernels.md has the measurement behind the default.
    """
    return _env_setting(ENV_CUDA_SLICE_EDGES, _CUDA_SLICE_EDGES, int, lambda v: v >= 0, lambda raw: ValueError(
        f"{ENV_CUDA_SLICE_EDGES}={raw!r}: expected an integer >= 0 (edges per slice of the CUDA sum/mean "
        f"kernel; 0 gives each row its own group); unset it for the default {_CUDA_SLICE_EDGES}"))


def _cuda_buildable() -> bool:
    if not torch.cuda.is_available():
        return False
    from torch.utils.cpp_extension import CUDA_HOME
    return CUDA_HOME is not None


def _torch_sparse():
    try:
        import torch_sparse
        return torch_sparse
    except Exception:  # noqa: BLE001  (optional package; a broken install counts as absent)
        return None


def _fallback_name() -> str:
    return "torch_sparse" if _torch_sparse() is not None else "torch"


def _device_kind(device) -> str:
    if isinstance(device, Tensor):
        device = device.device
    return "cuda" if torch.device(device).type == "cuda" else "cpu"


def backend(device: str | torch.device | Tensor = "cpu") -> str:
    """Which backend ``csr_aggregate`` uses for tensors on ``device``.

    Returns ``"cpp"`` or ``"cuda"`` (the compiled kernels; building them on the first call), else
    ``"torch_sparse"`` if that package is installed, else ``"torch"``. Inputs the kernels do not
    take (float16/bfloat16 features) use the fallback whatever this says.
    """
    kind = _device_kind(device)
    if _kernels(kind) is not None:
        return "cpp" if kind == "cpu" else "cuda"
    return _fallback_name()


def clear_cache() -> None:
    """Forget the cached transposed adjacencies (they are rebuilt on the next backward)."""
    with _lock:
        _transpose_cache.clear()


# --------------------------------------------------------------------------------------------
# transposed adjacency, cached per graph
# --------------------------------------------------------------------------------------------

# Bounded by count and by bytes (the transposes and the index tensors they keep alive): a caller that
# builds a new adjacency every step must not pile up dead graphs. The newest entry always stays.
_TRANSPOSE_CACHE_SIZE = 64
_TRANSPOSE_CACHE_BYTES = int(os.environ.get("PYG_PIPE_TRANSPOSE_CACHE_MB", "512")) * 2**20
_transpose_cache: OrderedDict[tuple, tuple] = OrderedDict()


def _entry_bytes(entry: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in entry)


def _transposed(rowptr: Tensor, col: Tensor, n_src: int, module) -> tuple:
    """``(tptr, trow, tedge)``: the edges rowptr[0]..rowptr[-1] grouped by source.

    ``tptr`` [n_src+1] offsets into ``trow`` (local destination row) and ``tedge`` (edge id into
    ``col``/``value``). Cached by the identity of the index tensors' memory (address, length, version
    counter); the entry keeps ``rowptr`` and ``col`` alive, so an address cannot be reused by another
    graph while it is cached, and an in-place change bumps the version and misses. A fixed graph thus
    pays the transposition (one counting sort) once, and each of a graph's chunks once. At most 64
    entries and ``PYG_PIPE_TRANSPOSE_CACHE_MB`` (default 512) MiB are kept, least recently used first
    out; ``clear_cache()`` empties it.
    """
    key = (rowptr.device, rowptr.data_ptr(), rowptr.numel(), rowptr._version,
           col.data_ptr(), col.numel(), col._version, n_src)
    with _lock:
        hit = _transpose_cache.get(key)
        if hit is not None:
            _transpose_cache.move_to_end(key)
            return hit[2:]
    if module is not None and rowptr.device.type == "cpu":
        tptr, trow, tedge = module.transpose(rowptr, col, n_src)
    else:
        rows = rowptr.numel() - 1
        base = int(rowptr[0])
        deg = rowptr[1:] - rowptr[:-1]
        c = col[base:base + int(rowptr[-1]) - base].long()
        if c.numel() and (int(c.min()) < 0 or int(c.max()) >= n_src):
            raise IndexError(f"csr_aggregate: a source id in col is outside [0, {n_src})")
        perm = torch.argsort(c, stable=True)
        row_of_edge = torch.repeat_interleave(torch.arange(rows, device=col.device), deg.long())
        trow = row_of_edge[perm].to(rowptr.dtype)
        tedge = (perm + base).to(rowptr.dtype)
        counts = torch.bincount(c, minlength=n_src)
        tptr = torch.zeros(n_src + 1, dtype=rowptr.dtype, device=col.device)
        tptr[1:] = torch.cumsum(counts, 0)
    with _lock:
        _transpose_cache[key] = (rowptr, col, tptr, trow, tedge)
        total = sum(_entry_bytes(e) for e in _transpose_cache.values())
        while len(_transpose_cache) > 1 and (len(_transpose_cache) > _TRANSPOSE_CACHE_SIZE
                                             or total > _TRANSPOSE_CACHE_BYTES):
            total -= _entry_bytes(_transpose_cache.popitem(last=False)[1])
    return tptr, trow, tedge


# --------------------------------------------------------------------------------------------
# autograd around the compiled kernels
# --------------------------------------------------------------------------------------------


def _inv_degree(rowptr: Tensor, dtype) -> Tensor:
    deg = (rowptr[1:] - rowptr[:-1]).to(dtype)
    return 1.0 / deg.clamp(min=1)


class _CompiledAggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rowptr, col, value, x, reduce, module):
        code = _REDUCE_CODE[reduce]
        result = module.forward(rowptr, col, value, x, code)
        out = result[0]
        arg = result[1] if reduce == "max" else None
        ctx.reduce, ctx.module, ctx.n_src = reduce, module, x.size(0)
        ctx.has_value = value is not None
        ctx.save_for_backward(rowptr, col, value, x, arg)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        rowptr, col, value, x, arg = ctx.saved_tensors
        module, reduce = ctx.module, ctx.reduce
        need_value = ctx.has_value and ctx.needs_input_grad[2]
        need_x = ctx.needs_input_grad[3]
        g = grad_out.contiguous()
        grad_x = grad_value_part = None
        if reduce == "max":
            grad_x, grad_value_part = module.max_backward(rowptr, col, value, x, g, arg, ctx.n_src,
                                                          need_x, need_value)
        else:
            inv_deg = _inv_degree(rowptr, g.dtype) if reduce == "mean" else None
            if need_x:
                tptr, trow, tedge = _transposed(rowptr, col, ctx.n_src, module)
                coef = value[tedge.long()] if value is not None else None
                if inv_deg is not None:
                    coef = inv_deg[trow.long()] if coef is None else coef * inv_deg[trow.long()]
                grad_x = module.forward(tptr, trow, coef.contiguous() if coef is not None else None, g, 0)[0]
            if need_value:
                grad_value_part = module.edge_dot(rowptr, col, x, g)
                if inv_deg is not None:
                    deg = (rowptr[1:] - rowptr[:-1]).long()
                    grad_value_part = grad_value_part * torch.repeat_interleave(inv_deg, deg)
        grad_value = None
        if need_value:  # reads the row range's edge span on the host: a sync on CUDA, only for edge values
            base, end = int(rowptr[0]), int(rowptr[-1])
            if base == 0 and end == value.numel():
                grad_value = grad_value_part
            else:
                grad_value = torch.zeros_like(value)
                grad_value[base:end] = grad_value_part
        return None, None, grad_value, grad_x, None, None


# --------------------------------------------------------------------------------------------
# fallbacks
# --------------------------------------------------------------------------------------------


def _slice_edges(rowptr: Tensor, col: Tensor, value: Tensor | None):
    """Rebase a row-range slice to a self-contained CSR: (rowptr from 0, col, value) of its edges."""
    base, end = int(rowptr[0]), int(rowptr[-1])
    rp = rowptr - base if base else rowptr
    c = col[base:end] if (base or end != col.numel()) else col
    v = value[base:end] if value is not None and (base or end != value.numel()) else value
    return rp, c, v


def _torch_aggregate(rowptr: Tensor, col: Tensor, value: Tensor | None, x: Tensor, reduce: str) -> Tensor:
    rp, c, v = _slice_edges(rowptr, col, value)
    rows, n_src = rp.numel() - 1, x.size(0)
    # torch.sparse.mm's gradient w.r.t. the values mishandles duplicate entries (it returns one per
    # distinct (row, col)), so a differentiable ``value`` takes the edge-list path.
    sparse_ok = v is None or not v.requires_grad
    cpu_ok = x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES
    if sparse_ok and (cpu_ok or (x.device.type == "cuda" and reduce != "max")):
        rp64, c64 = rp.long(), c.long()
        w = v if v is not None else torch.ones(c.numel(), dtype=x.dtype, device=x.device)
        adj = torch.sparse_csr_tensor(rp64, c64, w, (rows, n_src), check_invariants=False)
        if x.device.type == "cpu":
            return torch.sparse.mm(adj, x, {"sum": "sum", "mean": "mean", "max": "amax"}[reduce])
        out = torch.sparse.mm(adj, x)
        if reduce == "mean":
            out = out * _inv_degree(rp, out.dtype).unsqueeze(1)
        return out
    # generic edge-list path (max on CUDA, half precision): builds the [E, d] messages
    deg = (rp[1:] - rp[:-1]).long()
    dst = torch.repeat_interleave(torch.arange(rows, device=x.device), deg)
    msg = x.index_select(0, c.long())
    if v is not None:
        msg = msg * v.unsqueeze(1)
    out = x.new_zeros(rows, x.size(1))
    red = {"sum": "sum", "mean": "mean", "max": "amax"}[reduce]
    return out.scatter_reduce(0, dst.unsqueeze(1).expand_as(msg), msg, red, include_self=False)


def _torch_sparse_aggregate(rowptr, col, value, x, reduce):
    import torch_sparse

    rp, c, v = _slice_edges(rowptr, col, value)
    adj = torch_sparse.SparseTensor(rowptr=rp.long(), col=c.long(), value=v,
                                    sparse_sizes=(rp.numel() - 1, x.size(0)), is_sorted=True,
                                    trust_data=True)
    return torch_sparse.matmul(adj, x, reduce=reduce)


# --------------------------------------------------------------------------------------------
# the public call
# --------------------------------------------------------------------------------------------


def csr_aggregate(rowptr: Tensor, col: Tensor, x: Tensor, value: Tensor | None = None,
                  reduce: str = "sum", row_start: int = 0, row_end: int | None = None) -> Tensor:
    """Aggregate source rows of ``x`` into destination rows over a CSR adjacency, fused.

    Args:
        rowptr: [N_dst + 1] int32/int64 row offsets into ``col`` (rows are destinations). Offsets are
            absolute: a slice of a bigger CSR's rowptr (not starting at 0) works as is.
        col: [E] source ids (same dtype as ``rowptr``), global row numbers of ``x``.
        x: [N_src, d] source features (float32/float64 use the compiled kernels; other float
            dtypes the fallback). For the chunk case ``x`` is the full-graph buffer.
        value: optional [E] per-edge weights (multiplied into the messages; cast to ``x.dtype``).
        reduce: ``"sum"`` (alias ``"add"``), ``"mean"`` or ``"max"`` (alias ``"amax"``). Empty rows give 0.
        row_start, row_end: compute only destination rows ``row_start .. row_end - 1`` (default: all).

    Returns:
        [row_end - row_start, d] tensor; differentiable w.r.t. ``x`` and ``value``.
    """
    reduce_name = _REDUCE_ALIASES.get(reduce)
    if reduce_name is None:
        raise ValueError(f"csr_aggregate: `reduce` must be one of 'sum', 'mean', 'max' (or 'add', 'amax'), "
                         f"got {reduce!r}")
    if x.dim() != 2:
        raise ValueError(f"csr_aggregate: `x` must be 2-D [N_src, d], got shape {tuple(x.shape)}")
    if rowptr.dim() != 1 or col.dim() != 1 or rowptr.numel() < 1:
        raise ValueError("csr_aggregate: `rowptr` ([N_dst + 1]) and `col` ([E]) must be 1-D")
    n_dst = rowptr.numel() - 1
    row_end = n_dst if row_end is None else row_end
    if not 0 <= row_start <= row_end <= n_dst:
        raise ValueError(f"csr_aggregate: need 0 <= row_start ({row_start}) <= row_end ({row_end}) <= "
                         f"number of rows ({n_dst})")
    if row_start or row_end != n_dst:
        rowptr = rowptr[row_start:row_end + 1]
    if rowptr.dtype != col.dtype or rowptr.dtype not in (torch.int32, torch.int64):
        rowptr, col = rowptr.long(), col.long()
    if value is not None:
        if value.dim() != 1 or value.numel() != col.numel():
            raise ValueError(f"csr_aggregate: `value` must be 1-D like `col` ({col.numel()} entries), got "
                             f"shape {tuple(value.shape)}")
        if value.dtype != x.dtype:
            value = value.to(x.dtype)

    kind = _device_kind(x)
    module = _kernels(kind) if x.dtype in _KERNEL_DTYPES else None
    if module is not None:
        return _CompiledAggregate.apply(rowptr.contiguous(), col.contiguous(),
                                        value.contiguous() if value is not None else None,
                                        x.contiguous(), reduce_name, module)
    if _torch_sparse() is not None:
        return _torch_sparse_aggregate(rowptr, col, value, x, reduce_name)
    return _torch_aggregate(rowptr, col, value, x, reduce_name)


# --------------------------------------------------------------------------------------------
# the gated Gather (G-GCN)
# --------------------------------------------------------------------------------------------


class _CompiledGated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rowptr, col, a, b, c, mean, module):
        ctx.module, ctx.mean = module, mean
        ctx.save_for_backward(rowptr, col, a, b, c)
        return module.gated_forward(rowptr, col, a, b, c, mean)

    @staticmethod
    def backward(ctx, grad_out):
        rowptr, col, a, b, c = ctx.saved_tensors
        module = ctx.module
        g = grad_out
        if ctx.mean:
            g = g * _inv_degree(rowptr, g.dtype).unsqueeze(1)
        need_a, need_bc = ctx.needs_input_grad[2], ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        tptr, trow, _ = _transposed(rowptr, col, b.size(0), module) if need_bc else (rowptr, col, None)
        ga, gb, gc = module.gated_backward(rowptr, col, tptr, trow, a, b, c, g.contiguous(), need_a, need_bc)
        return (None, None, ga if need_a else None, gb if ctx.needs_input_grad[3] else None,
                gc if ctx.needs_input_grad[4] else None, None, None)


def _torch_gated(rowptr: Tensor, col: Tensor, a: Tensor, b: Tensor, c: Tensor, mean: bool) -> Tensor:
    """The same formula on edge lists (builds ``[E, d]`` tensors, as PyG's path does)."""
    rp, cc, _ = _slice_edges(rowptr, col, None)
    rows = rp.numel() - 1
    dst = torch.repeat_interleave(torch.arange(rows, device=c.device), (rp[1:] - rp[:-1]).long())
    src = cc.long()
    msg = torch.sigmoid(a.index_select(0, dst) + b.index_select(0, src)) * c.index_select(0, src)
    out = c.new_zeros(rows, c.size(1)).index_add_(0, dst, msg)
    return out * _inv_degree(rp, out.dtype).unsqueeze(1) if mean else out


def csr_gated_aggregate(rowptr: Tensor, col: Tensor, a: Tensor, b: Tensor, c: Tensor, reduce: str = "sum") -> Tensor:
    """The gated Gather: ``out[i] = REDUCE_{e in row i} sigmoid(a[i] + b[col[e]]) * c[col[e]]``.

    Args:
        rowptr: [R + 1] offsets into ``col`` (rows are destinations; absolute, as for :func:`csr_aggregate`).
        col: [E] source ids into ``b`` and ``c``.
        a: [R, d] destination terms of the gate; b: [N_src, d] source terms; c: [N_src, d] source values.
        reduce: ``"sum"`` (``"add"``) or ``"mean"``; rows without edges give 0.

    Returns:
        [R, d], differentiable w.r.t. ``a``, ``b`` and ``c``. float32/float64 on a device with compiled
        kernels never build an ``[E, d]`` tensor, forward or backward; anything else takes the edge-list path.
    """
    name = _REDUCE_ALIASES.get(reduce)
    if name not in ("sum", "mean"):
        raise ValueError(f"csr_gated_aggregate: `reduce` must be 'sum' or 'mean', got {reduce!r}")
    if rowptr.dtype != col.dtype or rowptr.dtype not in (torch.int32, torch.int64):
        rowptr, col = rowptr.long(), col.long()
    kind = _device_kind(c)
    module = _kernels(kind) if c.dtype in _KERNEL_DTYPES and a.dtype == b.dtype == c.dtype else None
    if module is not None and hasattr(module, "gated_forward"):
        return _CompiledGated.apply(rowptr.contiguous(), col.contiguous(), a.contiguous(), b.contiguous(),
                                    c.contiguous(), name == "mean", module)
    return _torch_gated(rowptr, col, a, b, c, name == "mean")
