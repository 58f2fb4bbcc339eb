"""The strategy under Lightning's own launchers: the default popen launcher, and torchrun."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "fit_small.py")


def _run(cmd, **env):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


def test_popen_launcher_by_name():
    log = _run([sys.executable, SCRIPT])
    assert "rank 0 of 2" in log and "OK=True" in log


def test_under_torchrun():
    log = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29731", SCRIPT])
    assert "env=TorchElasticEnvironment" in log
    assert log.count("OK=True") == 2
