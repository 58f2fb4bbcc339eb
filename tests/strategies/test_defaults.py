"""Every strategy with a completely default Trainer (``devices=2, accelerator="cpu"``), as a user's
script runs it (Lightning's default popen launcher): ``validate`` before ``fit`` (no plan yet), the
sanity check, checkpointing, logger and progress bar at their defaults, ``test`` and ``predict`` after
``fit``, ``trainer.save_checkpoint`` after ``fit``, and no warning of pyg_pipe's making on the way."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "default_trainer.py")


def _ours(warning) -> bool:
    """A warning pyg_pipe caused: raised from its code, or Lightning's about pyg_pipe's own logging or
    about the one-step-per-epoch loop pyg_pipe's full-graph training always has."""
    return ("/pyg_pipe/" in warning["file"] or "comm/" in warning["message"]
            or "number of training batches" in warning["message"])


@pytest.mark.parametrize("strategy", ["gnnpipe", "graph_parallel", "gnnpipe_hybrid", "gnnpipe_grid_auto"])
def test_a_default_trainer_just_works(strategy, tmp_path):
    out = subprocess.run([sys.executable, SCRIPT, strategy], capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path), env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["predict_rows"] == 60
    # validation before fit and test after it (exact passes) equal the plain model on one process
    assert result["val_before"] == pytest.approx(result["plain_val_before"], abs=1e-6)
    assert result["test_after"] == pytest.approx(result["plain_test_after"], abs=1e-6)
    assert result["history_in_checkpoint"], "trainer.save_checkpoint after fit must keep the pipeline state"
    buffers = result["history_buffers"]
    assert len(buffers) == 2, "every rank's part of the pipeline state is in the checkpoint"
    if strategy == "gnnpipe" and result["num_chunks"] > 1:  # 2 stages with several chunks: each rank keeps
        # the history of its call sites (the rows other chunks read: at most every vertex)
        assert any(buffers) and all(0 < n <= result["num_nodes"] for b in buffers for _, n in b), buffers
        assert not set(map(tuple, (k for k, _ in buffers[0]))) & set(map(tuple, (k for k, _ in buffers[1])))
    elif strategy == "gnnpipe":  # num_chunks="auto" chose one chunk (60 vertices: a chunk's fixed cost rules)
        assert buffers == [[], []], buffers
    if strategy == "gnnpipe":  # the cost model's prediction is checked against the steps after the first
        check = result["plan_check"]
        assert check is not None and check["num_chunks"] == result["num_chunks"] and check["steps"] == 3, check
        assert check["predicted_step_s"] > 0 and check["measured_step_s"] > 0, check
        assert any("the measured step is" in n and "against the predicted" in n for n in result["notes"])
        # what it chose is shown, as Lightning shows its own messages: once (rank 0; validate, fit, test and
        # predict use the one count), on stderr
        assert out.stderr.count("pyg_pipe: num_chunks='auto':") == 1, out.stderr[-3000:]
    if strategy == "gnnpipe_grid_auto":  # chosen once (validate, fit, test and predict use it), saved, told once
        assert out.stderr.count("pyg_pipe: grid='auto':") == 1, out.stderr[-3000:]
        S, W = result["grid"]
        assert S * W == 2 and any(n.startswith(f"pyg_pipe: grid='auto': {S} stage") for n in result["notes"])
    assert result["checkpoints"], "the default ModelCheckpoint wrote nothing"
    ours = [w for w in result["warnings"] if _ours(w)]
    assert not ours, json.dumps(ours, indent=1)
