"""Choosing ``num_chunks``: staleness (accuracy), speed and memory, measured side by side.

One ``strategy="gnnpipe"`` fit per chunk count, through a real Lightning Trainer (popen launcher),
each in fresh processes, one after the other: a 16-layer GCNII (hidden 64) on a generated graph with
community structure (``sbm_graph``: 10,000 vertices, average degree 10, 80 classes folded into 8
labels), Adam, 2 pipeline stages (processes), one thread each. Reported per chunk count:

* test accuracy after the given epochs (inference is exact: the difference is what staleness cost
  training), and the first epoch at which validation accuracy reached 90% of the best run's;
* epoch time (median of the second half of the epochs) and the pipeline's bubble, (S-1)/(C+S-1);
* peak resident memory of the worst process.

    python benchmarks/speed/chunks_tradeoff.py --out docs/results/chunks_tradeoff.json   # about 10 minutes
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def worker(args) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    import pyg_pipe
    from pyg_pipe.graph import sbm_graph
    from pyg_pipe.models import gcnii

    torch.set_num_threads(1)
    data = sbm_graph(args.nodes, num_classes=80, avg_degree=args.degree, homophily=0.8, num_features=32, seed=0)
    data.y = data.y % 8
    torch.manual_seed(0)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = gcnii(32, args.hidden, 8, num_layers=args.layers, dropout=0.1)
            self.times, self.val = [], []

        def training_step(self, batch, batch_idx):
            self.t0 = time.perf_counter()
            out = self.model(batch.x, batch.edge_index)
            return F.cross_entropy(out[batch.train_mask], batch.y[batch.train_mask])

        def on_train_batch_end(self, *a):
            self.times.append(time.perf_counter() - self.t0)

        def validation_step(self, batch, batch_idx):
            out = self.model(batch.x, batch.edge_index).argmax(-1)
            acc = (out[batch.val_mask] == batch.y[batch.val_mask]).float().mean()
            self.val.append(float(acc))
            self.log("val_acc", acc, batch_size=1, sync_dist=True)

        def test_step(self, batch, batch_idx):
            out = self.model(batch.x, batch.edge_index).argmax(-1)
            self.log("test_acc", (out[batch.test_mask] == batch.y[batch.test_mask]).float().mean(), batch_size=1,
                     sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    module = Module()
    strategy = pyg_pipe.GNNPipeStrategy(num_chunks=args.chunks, grid="pipeline")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=args.epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    dm = pyg_pipe.FullGraphDataModule(data)
    trainer.fit(module, datamodule=dm)
    test = trainer.test(module, datamodule=dm, verbose=False)[0]["test_acc"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if trainer.global_rank == 0:
        print("RESULT " + json.dumps({"chunks": args.chunks, "times": module.times, "val": module.val[1:],
                                      "test_acc": test, "peak_mb_rank0": peak}), flush=True)
    else:
        print("PEAK " + json.dumps({"peak_mb": peak}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--degree", type=float, default=10.0)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.chunks = args.chunks[0]
        worker(args)
        return
    rows = []
    for c in args.chunks:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--chunks", str(c)]
        for k in ("nodes", "degree", "layers", "hidden", "epochs"):
            cmd += [f"--{k}", str(getattr(args, k))]
        with tempfile.TemporaryDirectory() as tmp:
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp,
                                 env=dict(os.environ, OMP_NUM_THREADS="1"))
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-3000:])
        res = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        peaks = [res["peak_mb_rank0"]] + [json.loads(ln[5:])["peak_mb"] for ln in out.stdout.splitlines()
                                           if ln.startswith("PEAK ")]
        res["peak_mb"] = max(peaks)
        res["epoch_s"] = statistics.median(res["times"][len(res["times"]) // 2:])
        res["bubble"] = 1 / (c + 1)  # (S-1)/(C+S-1) with S = 2
        rows.append(res)
        print(f"chunks {c:>2}: test acc {res['test_acc']:.3f}, epoch {res['epoch_s']:.3f} s, "
              f"peak {res['peak_mb']:.0f} MB", flush=True)
    best = max(max(r["val"]) for r in rows)
    print(f"\n| num_chunks | test accuracy | epochs to 90% of best val ({0.9 * best:.3f}) | epoch (s) "
          f"| time vs 1 chunk "
          f"| bubble | peak MB per process |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    t1 = rows[0]["epoch_s"]
    for r in rows:
        reach = next((i + 1 for i, v in enumerate(r["val"]) if v >= 0.9 * best), None)
        r["epochs_to_90"] = reach
        print(f"| {r['chunks']} | {r['test_acc']:.3f} | {reach if reach else '> ' + str(len(r['val']))} | "
              f"{r['epoch_s']:.3f} | {r['epoch_s'] / t1:.2f} | {r['bubble']:.0%} | {r['peak_mb']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"setting": vars(args), "rows": rows, "load_average": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
