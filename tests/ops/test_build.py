"""Building and choosing the backend: the kernel builds where a compiler exists, the environment
variable turns it off, a failed build falls back with exactly one warning, and edits rebuild."""
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from pyg_pipe import ops
from pyg_pipe.ops import aggregate
from tests.ops.graphs import reference, small_csr

ROOT = Path(__file__).resolve().parents[2]


def _can_build() -> bool:
    return (shutil.which(os.environ.get("CXX", "c++")) is not None and shutil.which("ninja") is not None
            and aggregate.extensions_enabled() and (aggregate._source_dir() / "csr_aggregate.cpp").is_file())


@pytest.mark.skipif(not _can_build(), reason="no C++ compiler / ninja, or extensions disabled")
def test_cpu_kernel_builds_here():
    """Where g++ and ninja exist the compiled kernel must be in use, not a silent fallback."""
    assert ops.backend("cpu") == "cpp"


def test_env_var_disables_extensions():
    code = ("import pyg_pipe.ops as o, warnings; warnings.simplefilter('error', UserWarning); "
            "print(o.backend('cpu'), o.extensions_enabled())")
    env = dict(os.environ, PYG_PIPE_DISABLE_EXTENSIONS="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=False,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    backend, enabled = result.stdout.split()
    assert backend in ("torch", "torch_sparse") and enabled == "False"


def test_failed_build_falls_back_with_one_warning(monkeypatch):
    def broken(kind):
        raise RuntimeError("Error building extension 'pyg_pipe_csr_aggregate_cpu': g++ exploded")

    monkeypatch.setattr(aggregate, "_load", broken)
    monkeypatch.setattr(aggregate, "_modules", {})
    monkeypatch.setattr(aggregate, "_warned", False)
    monkeypatch.setenv(aggregate.ENV_DISABLE, "0")
    rowptr, col = small_csr()
    x = torch.randn(rowptr.numel() - 1, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ops.backend("cpu") in ("torch", "torch_sparse")
        out = ops.csr_aggregate(rowptr, col, x, reduce="mean")
        ops.csr_aggregate(rowptr, col, x, reduce="max")
    mine = [w for w in caught if "pyg_pipe" in str(w.message)]
    assert len(mine) == 1 and "g++ exploded" in str(mine[0].message)
    assert "PYG_PIPE_DISABLE_EXTENSIONS" in str(mine[0].message)
    torch.testing.assert_close(out, reference(rowptr, col, x, reduce="mean"))


def test_build_name_follows_the_source(tmp_path):
    """Editing the source changes the build name, so the torch extension cache rebuilds it."""
    src = tmp_path / "k.cpp"
    src.write_text("int a;")
    first = aggregate._build_name("cpu", [src], ["-O3"])
    assert first == aggregate._build_name("cpu", [src], ["-O3"])
    src.write_text("int b;")
    assert aggregate._build_name("cpu", [src], ["-O3"]) != first
    assert aggregate._build_name("cpu", [src], ["-O2"]) != aggregate._build_name("cpu", [src], ["-O3"])
