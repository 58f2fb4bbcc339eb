"""Test-suite wide settings: tests marked ``gpu`` need a CUDA device and skip cleanly without one
(``bash benchmarks/gpu.sh`` runs them, with the GPU benchmarks, on a machine that has one)."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
