"""The compiled kernels of :mod:`.aggregate`: their JIT build, load, locks and fallbacks.

The kernels are built with ``torch.utils.cpp_extension.load`` (g++ with OpenMP, and ninja) into the
torch extensions directory (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions/<pyXY_cpu>``)
under a name that carries a hash of the source, the flags, the torch version and the CPU, so an edited
source rebuilds and an unchanged one loads in well under a second. A build (30 s to 2 min on CPU) is
announced on stderr through ``logging`` (logger ``pyg_pipe.ops.build``, level WARNING) by the process
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
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor


ENV_DISABLE = "PYG_PIPE_DISABLE_EXTENSIONS"


ENV_BUILD_TIMEOUT = "PYG_PIPE_BUILD_TIMEOUT"


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
    for src in sources:  # the path too: torch's build files name it, and two checkouts would rebuild in turn
        h.update(str(Path(src).resolve()).encode())
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
    return _env_setting(ENV_BUILD_TIMEOUT, _DEFAULT_BUILD_TIMEOUT_S, float, lambda s: s > 0,
                        lambda raw: _BuildLockError(f"{ENV_BUILD_TIMEOUT}={raw!r} is not a positive number of seconds; "
                                                    f"set it to e.g. {_DEFAULT_BUILD_TIMEOUT_S:.0f} or unset it."))


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
