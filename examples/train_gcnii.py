"""Train a deep GCNII with ``strategy="gnnpipe"`` on several CPU processes, on a graph generated offline.

    python examples/train_gcnii.py                      # 4 processes, 16-layer GCNII, 5,000-vertex graph
    python examples/train_gcnii.py --devices 2 --layers 32 --nodes 20000 --chunks 8

The LightningModule below is an ordinary single-device node classifier: the only pyg_pipe-specific
lines are ``import pyg_pipe`` and ``strategy="gnnpipe"`` (here the configured form, to set the chunks).
Pass ``--dataset cora`` (or reddit, flickr, ogbn-arxiv, ...) to use a real dataset when online.
"""
import argparse
import copy
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

import pyg_pipe
from pyg_pipe.engine import gnnpipe_bytes
from pyg_pipe.graph import load_dataset
from pyg_pipe.memory import PeakMemory
from pyg_pipe.models import gcnii


class NodeClassifier(pl.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float = 0.01, weight_decay: float = 5e-4):
        super().__init__()
        self.model = model
        self.lr, self.weight_decay = lr, weight_decay

    def forward(self, x, edge_index):
        return self.model(x, edge_index)

    def _accuracy(self, out, data, mask):
        return (out[mask].argmax(-1) == data.y[mask]).float().mean()

    def training_step(self, data, batch_idx):
        out = self(data.x, data.edge_index)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        self.log("train_loss", loss, batch_size=1, prog_bar=True)
        return loss

    def validation_step(self, data, batch_idx):
        out = self(data.x, data.edge_index)
        # every rank holds the whole output, so the metric is the same everywhere; sync_dist only says so
        self.log("val_acc", self._accuracy(out, data, data.val_mask), batch_size=1, prog_bar=True, sync_dist=True)

    def test_step(self, data, batch_idx):
        out = self(data.x, data.edge_index)
        self.log("test_acc", self._accuracy(out, data, data.test_mask), batch_size=1, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


def single_process_peak(model, data, steps: int = 2) -> int:
    """Peak memory of training the plain model on the whole graph in this one process (net of the data)."""
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    meter = PeakMemory().start()
    for _ in range(steps):
        out = model(data.x, data.edge_index)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return meter.net_bytes()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="sbm", help="sbm / powerlaw / karate (offline) or a real dataset name")
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--chunks", type=lambda v: v if v == "auto" else int(v), default="auto",
                   help="num_chunks; 'auto' (the default): the fewest within 10%% of the fastest predicted step")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--boundary-dtype", dest="boundary_dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: activations and gradients cross the stage cuts in bfloat16 (half the bytes)")
    args = p.parse_args()

    torch.set_num_threads(1)  # one thread per process: the processes stand in for devices
    kwargs = dict(num_nodes=args.nodes, avg_degree=10, num_features=32, seed=0) if args.dataset == "sbm" else {}
    data = load_dataset(args.dataset, **kwargs)
    num_classes = int(data.y.max()) + 1
    model = gcnii(data.num_features, args.hidden, num_classes, num_layers=args.layers, dropout=args.dropout)

    # the reference: plain PyG in one process (only in the launching process; the workers it starts skip it)
    single = single_process_peak(model, data) if "LOCAL_RANK" not in os.environ else None

    strategy = pyg_pipe.GNNPipeStrategy(num_chunks=args.chunks, grid="pipeline",  # (a stage a device: GNNPipe itself)
                                        boundary_dtype=torch.bfloat16 if args.boundary_dtype == "bf16" else None)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_epochs=args.epochs,
                         logger=False, enable_checkpointing=False, enable_model_summary=False,
                         check_val_every_n_epoch=5)
    datamodule = pyg_pipe.FullGraphDataModule(data)
    trainer.fit(NodeClassifier(model), datamodule=datamodule)
    test = trainer.test(NodeClassifier(model), datamodule=datamodule, verbose=False)
    if trainer.is_global_zero:
        comm = strategy.comm_history[-1]
        want = gnnpipe_bytes(data.num_nodes, args.devices, width=args.hidden, out_width=num_classes,
                             carried_width=args.hidden, boundary_bytes=2 if args.boundary_dtype == "bf16" else None)
        print(f"\n{args.layers}-layer GCNII on {data.num_nodes:,} vertices / {data.num_edges:,} edges, "
              f"{args.devices} pipeline stages, {strategy.planned_chunks} chunk{'s' * (strategy.planned_chunks != 1)}")
        print(*[n for n in strategy.notes if "num_chunks" in n], sep="\n")
        print(f"test accuracy {test[0]['test_acc']:.3f}")
        print(f"communication per epoch: {comm['total']/2**20:.2f} MiB measured, {want['total']/2**20:.2f} MiB by "
              f"the formula (activations {comm['stage_activations']/2**20:.2f}, gradients "
              f"{comm['stage_gradients']/2**20:.2f}, carried x0 {comm['carried']/2**20:.2f}, "
              f"output {comm['output']/2**20:.2f} MiB)")
        peaks = strategy.peak_memory
        line = (f"peak memory per process, net of the data: worst {max(peaks)/2**20:.1f} MiB (ranks: "
                f"{', '.join(f'{p/2**20:.1f}' for p in peaks)})")
        if single:
            line += f"; plain PyG in one process {single/2**20:.1f} MiB: {max(peaks)/single:.2f} x"
        print(line)


if __name__ == "__main__":
    main()
