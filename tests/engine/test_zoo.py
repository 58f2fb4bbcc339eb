"""Every PyG conv class, each in a three-layer model, is exact or refused in every mode: never different.

One process launch per mode runs the whole zoo (:mod:`tests.zoo`), including norms inside layers
(GENConv's MLP after aggregation, BatchNorm in the message MLPs of EdgeConv and PointNetConv); float64,
so "exact" means within 1e-5 absolutely even where sums grow large. Modes:

* ``graph_parallel``: 2 ways; three SGD+momentum steps equal one process (outputs, gradients,
  parameters, inference).
* ``pipeline``: 2 stages, one chunk; the same.
* ``chunks``: 2 stages, 4 chunks of consecutive vertices, no shuffling: the first chunk to run is a
  whole connected component (no halo), a directed cycle with as many local edges as rows, while the
  others read each other's rows; lr = 0, so every training forward equals one process (history starts
  exact and weights never change).
* ``hybrid``: 2 stages x 2 ways, 8 chunks, shuffled, greedy partition; lr = 0.
* ``streaming_disk``: one device, 4 chunks streamed layer group by layer group (every read fresh),
  every buffer in a memory-mapped file; three SGD+momentum steps equal one process, as in
  ``graph_parallel``.
"""
import json

import pytest
import torch

from tests import harness
from tests.dist import run_distributed
from tests.zoo import ZOO, ZooNet, zoo_graph

# (case, mode kind) -> the words the refusal must contain; everything else must be exact. With chunks in the
# pipeline a BatchNorm takes historical statistics by default (per_chunk_statistics="auto"): on vertex rows inside
# a layer (GIN's MLP, GENConv's) it is exact at lr = 0, in a message MLP (over edges) it is refused when the layer
# first runs; streaming (one device) refuses them all before training
_EDGES = ["message function", "normalises over edges", "per_chunk_statistics=True"]
_BEFORE = ["BatchNorm1d", "per_chunk_statistics=True"]
REFUSED = {
    ("EdgeConv-mlp-batchnorm", "chunks"): _EDGES,
    ("PointNetConv-mlp-batchnorm", "chunks"): _EDGES,
    ("GINConv-batchnorm", "streaming"): _BEFORE + ["num_chunks="],
    ("GENConv", "streaming"): _BEFORE,
    ("GENConv-edge-batchnorm", "streaming"): _BEFORE,
    ("EdgeConv-mlp-batchnorm", "streaming"): _BEFORE,
    ("PointNetConv-mlp-batchnorm", "streaming"): _BEFORE,
}


def _sweep(rank, world, mode, path, fused=False):
    from functools import partial

    from pyg_pipe.ops import fuse_messages
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph(ring=True)
    inputs = dict(x=x, **g)
    handles = []

    def make(name):
        model = ZooNet(name)
        if fused:
            handles.append(fuse_messages(model))
        return model

    results = {name: harness.check_mode(mode, partial(make, name), inputs, y, mask, world) for name in ZOO}
    results["fused calls"] = sum(h.fused_calls for h in handles)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f)


@pytest.mark.parametrize("mode,world,fused", [("graph_parallel", 2, False), ("pipeline", 2, False),
                                              ("chunks", 2, False), ("hybrid", 4, False), ("streaming_disk", 1, False),
                                              ("graph_parallel", 2, True), ("chunks", 2, True)],
                         ids=["graph_parallel", "pipeline", "chunks", "hybrid", "streaming_disk",
                              "graph_parallel-fused", "chunks-fused"])
def test_every_conv_class_is_exact_or_refused(mode, world, fused, tmp_path):
    """``-fused``: every model's layers given to :func:`pyg_pipe.ops.fuse_messages` first (the reference is a
    copy, fused too; ``tests/ops/test_messages.py`` checks fused layers against PyG's path)."""
    path = tmp_path / "zoo.json"
    run_distributed(_sweep, world, mode, str(path), fused, timeout=600)
    results = json.loads(path.read_text())
    fused_calls = results.pop("fused calls")
    assert (fused_calls > 0) == fused, fused_calls
    kind = {"chunks": "chunks", "hybrid": "chunks", "streaming_disk": "streaming"}.get(mode, "one")
    wrong = {}
    for name, outcome in results.items():
        words = REFUSED.get((name, kind))
        if words is None and outcome != "exact":
            wrong[name] = outcome
        elif words is not None and not (outcome.startswith("refused") and all(w in outcome for w in words)):
            wrong[name] = f"expected a refusal naming {words}, got: {outcome}"
    assert not wrong, json.dumps(wrong, indent=1)
    assert len(results) == len(ZOO)
