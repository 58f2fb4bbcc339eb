"""What pyg_pipe decides on its own is shown as Lightning shows its messages: a handler on the "pyg_pipe"
logger at INFO, on global rank 0 only (warnings on every rank), unless the program configured logging itself."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import logging, sys
{before}
import pyg_pipe
from lightning.fabric.utilities.rank_zero import rank_zero_only
log = logging.getLogger("pyg_pipe.engine.plan.plan")
rank_zero_only.rank = 0
log.info("pyg_pipe: said on rank 0")
rank_zero_only.rank = 1
log.info("pyg_pipe: said on rank 1")
log.warning("pyg_pipe: warned on rank 1")
"""


def _stderr(before: str = "") -> str:
    out = subprocess.run([sys.executable, "-c", PROBE.format(before=before)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_decisions_are_shown_on_rank_zero():
    err = _stderr()
    assert "pyg_pipe: said on rank 0" in err and "said on rank 1" not in err, err
    assert "pyg_pipe: warned on rank 1" in err, err  # (warnings from every rank)


def test_a_program_that_configured_logging_decides_itself():
    err = _stderr("logging.basicConfig(level=logging.ERROR)")
    assert "said on rank" not in err and "warned" not in err, err
