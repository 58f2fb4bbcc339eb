"""Every script in ``examples/`` runs, at small sizes, as a user would start it (a fresh process each; the
multi-machine one through torchrun on this one machine), and reports a test accuracy (AUC for link prediction)."""
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    "node_classification": [sys.executable, "examples/node_classification.py", "--offline", "--devices", "2",
                            "--epochs", "2"],
    "streaming_one_gpu": [sys.executable, "examples/streaming_one_gpu.py", "--nodes", "2000", "--layers", "4",
                          "--chunks", "4", "--epochs", "2"],
    "hybrid": [sys.executable, "examples/hybrid.py", "--nodes", "1000", "--layers", "4", "--epochs", "2"],
    "train_gcnii": [sys.executable, "examples/train_gcnii.py", "--devices", "2", "--layers", "4", "--nodes", "1000",
                    "--epochs", "2"],
    "heterogeneous": [sys.executable, "examples/heterogeneous.py", "--devices", "2", "--epochs", "2"],
    "link_prediction": [sys.executable, "examples/link_prediction.py", "--offline", "--devices", "2", "--epochs", "2"],
    "torchrun": ["bash", "examples/multi_node/torchrun.sh", "--offline", "--epochs", "2"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_example_runs(name):
    env = dict(os.environ)
    if name == "torchrun":
        with socket.socket() as s:  # a free port for torchrun's rendezvous (Lightning's launcher finds its own)
            s.bind(("127.0.0.1", 0))
            env.update(NNODES="1", NPROC="2", MASTER_PORT=str(s.getsockname()[1]))
    done = subprocess.run(CASES[name], cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "test accuracy" in out or "test AUC" in out, out[-3000:]
