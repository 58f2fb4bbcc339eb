"""Layers with ``flow="target_to_source"`` (aggregating at ``edge_index[0]``): every conv class of the zoo
(:mod:`tests.zoo`) with its message-passing layers turned that way, in every mode, is exact or refused, never
different, against the same model on one device.

Such a layer is run as the transposed graph's layer (:func:`pyg_pipe.engine.step.arguments.reversed_graphs`):
its chunk rows are the vertices it aggregates at, its halo the vertices it reads. The graph is directed (the zoo
graph's edges in one direction only), so the two flows give different results, and a chunking of the wrong
direction would read the wrong halo. One process launch per mode runs the whole zoo; float64, modes as in
``test_zoo.py``. Cases where PyG itself fails on one device with this flow are listed in ``PYG_FAILS`` and must
fail the same way (a crash or a refusal), never run with another result.
"""
import json
from functools import partial

import pytest
import torch
from torch_geometric.nn import MessagePassing

from tests import harness
from tests.dist import run_distributed
from tests.zoo import ZOO, ZooNet, zoo_graph


def _reversed(name: str):
    model = ZooNet(name)
    for m in model.modules():
        if isinstance(m, MessagePassing):
            m.flow = "target_to_source"
    return model


def _directed(g: dict) -> dict:
    """The zoo graph with only its edges from lower to higher ids (and its self loops), with their attributes."""
    keep = g["edge_index"][0] <= g["edge_index"][1]
    return {k: (v[:, keep] if k == "edge_index" else v[keep]) if k != "pos" else v for k, v in g.items()}


def _plain_fails(inputs) -> dict:
    """The cases PyG cannot run on one device with the flow turned: ``{name: error}``."""
    out = {}
    for name in ZOO:
        try:
            torch.manual_seed(0)
            _reversed(name)(**inputs)
        except Exception as exc:  # noqa: BLE001 - recorded, compared below
            out[name] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def _sweep(rank, world, mode, path):
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph(ring=True)
    inputs = dict(x=x, **_directed(g))
    fails = _plain_fails(inputs)
    results = {name: harness.check_mode(mode, partial(_reversed, name), inputs, y, mask, world)
               for name in ZOO if name not in fails}
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"results": results, "plain_fails": fails}, f)


@pytest.mark.parametrize("mode,world", [("graph_parallel", 2), ("pipeline", 2), ("chunks", 2), ("hybrid", 4),
                                        ("streaming_disk", 1)])
def test_target_to_source_layers_are_exact_or_refused(mode, world, tmp_path):
    path = tmp_path / "flow.json"
    run_distributed(_sweep, world, mode, str(path), timeout=600)
    got = json.loads(path.read_text())
    results = got["results"]
    different = {k: v for k, v in results.items() if not (v == "exact" or v.startswith("refused"))}
    assert not different, json.dumps(different, indent=1)
    exact = [k for k, v in results.items() if v == "exact"]
    print(f"{mode}: {len(exact)} exact, {len(results) - len(exact)} refused, {len(got['plain_fails'])} fail in PyG:",
          json.dumps({k: v for k, v in results.items() if v != "exact"}, indent=1), got["plain_fails"])
    assert len(exact) >= 30, exact
