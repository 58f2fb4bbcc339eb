"""The table of docs/models.md: every model shape and every PyG conv class, in every mode.

Runs the checks of the test suite (``tests/harness.py``) on 2 gloo processes (4 for hybrid), float64,
and prints a markdown table: ``exact`` (equal to one process within 1e-5: three SGD+momentum steps
and inference where the algorithm is exact; the training forward at lr = 0 with chunks, where history
is approximate in general), or ``refused`` with the start of the error.

    python benchmarks/convergence/model_table.py > /tmp/table.md            # about 5 minutes on 2 cores
"""
import json
import os
import sys
import tempfile
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

MODES = [("graph_parallel", 2), ("pipeline", 2), ("chunks", 2), ("hybrid", 4)]
HEADERS = {"graph_parallel": "graph_parallel, 2 ways", "pipeline": "gnnpipe, 2 stages, 1 chunk",
           "chunks": "gnnpipe, 2 stages, 4 chunks (lr = 0)", "hybrid": "2 stages × 2 ways, 8 chunks (lr = 0)"}


def _sweep(rank, world, mode, path):
    import torch

    from tests import harness
    from tests.shapes import SHAPES, graph
    from tests.zoo import ZOO, ZooNet

    torch.set_default_dtype(torch.float64)
    g = graph()
    x, e, y, mask = g
    cases = [(name, make, inputs(g)) for name, (make, inputs) in SHAPES.items()]
    cases += [(name, partial(ZooNet, name), dict(x=x, **e)) for name in ZOO]
    results = {name: harness.check_mode(mode, make, kw, y, mask, world) for name, make, kw in cases}
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f)


def _cell(outcome: str) -> str:
    if outcome == "exact":
        return "exact"
    kind, _, message = outcome.partition(": ")
    return f"**{kind}**: {message[:110].replace('|', '/')}…"


def main():
    from tests.dist import run_distributed
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, world in MODES:
            path = os.path.join(tmp, f"{mode}.json")
            run_distributed(_sweep, world, mode, path, timeout=1200)
            with open(path) as f:
                results[mode] = json.load(f)
    names = list(results["graph_parallel"])
    print("| model | " + " | ".join(HEADERS[m] for m, _ in MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for name in names:
        print(f"| {name} | " + " | ".join(_cell(results[m][name]) for m, _ in MODES) + " |")


if __name__ == "__main__":
    main()
