"""A user's script with a default Trainer: ``python /abs/path/default_trainer.py <strategy>`` (run it in
a scratch directory: Lightning writes its logs and checkpoints there).

Runs ``trainer.validate`` before ``fit``, then ``fit`` (sanity check, checkpointing, progress bar and
logger all at Lightning's defaults), ``test`` and ``predict`` after it, ``trainer.save_checkpoint`` at
the end, and records every warning raised in this process. Prints one line per result, ``RESULT ...``.
"""
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

caught = []


def _record(message, category, filename, lineno, file=None, line=None):
    caught.append({"category": category.__name__, "message": str(message), "file": filename})


if __name__ == "__main__":
    warnings.simplefilter("always")
    warnings.showwarning = _record
    import lightning.pytorch as pl  # noqa: E402
    import torch  # noqa: E402

    import pyg_pipe  # noqa: E402
    from tests.lit import NodeClassifier  # noqa: E402
    from tests.models import as_data, make_model, small_graph  # noqa: E402

    strategy = sys.argv[1]
    torch.manual_seed(0)
    data = as_data(*small_graph())
    dm = pyg_pipe.FullGraphDataModule(data)
    lit = NodeClassifier(make_model("gcn", num_layers=4))

    def accuracy(model, mask):  # the plain model on one process, as a reference
        with torch.no_grad():
            pred = model.eval()(data.x, data.edge_index).argmax(-1)
        model.train()
        return float((pred[mask] == data.y[mask]).float().mean())

    plain_before = accuracy(lit.model, data.val_mask)
    if strategy == "gnnpipe_grid_auto":  # stages x ways chosen by the cost model
        strategy = pyg_pipe.GNNPipeStrategy(grid="auto")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=4)
    before = trainer.validate(lit, datamodule=dm, verbose=False)
    trainer.fit(lit, datamodule=dm)
    after = trainer.test(lit, datamodule=dm, verbose=False)
    pred = trainer.predict(lit, datamodule=dm)
    trainer.save_checkpoint("after_fit.ckpt")
    if trainer.is_global_zero:
        ckpt = torch.load("after_fit.ckpt", weights_only=False)
        print("RESULT " + json.dumps({
            "rank": trainer.global_rank, "val_before": before[0]["val_acc"], "test_after": after[0]["test_acc"],
            "plain_val_before": plain_before, "plain_test_after": accuracy(lit.model, data.test_mask),
            "predict_rows": int(pred[0].shape[0]), "history_in_checkpoint": "pyg_pipe" in ckpt,
            "history_buffers": [sorted((k, v.shape[0]) for h in r["history"]["calls"].values()
                                       for k, v in h["buffers"].items())
                                for r in ckpt["pyg_pipe"]["ranks"]] if "pyg_pipe" in ckpt else None,
            "num_nodes": data.num_nodes,
            "num_chunks": ckpt["pyg_pipe"]["plan"]["num_chunks"] if "pyg_pipe" in ckpt else None,
            "grid": [ckpt["pyg_pipe"]["plan"][k] for k in ("stages", "ways")] if "pyg_pipe" in ckpt else None,
            "plan_check": getattr(trainer.strategy, "plan_check", None),
            "notes": getattr(trainer.strategy, "notes", None),
            "checkpoints": sorted(os.listdir(trainer.checkpoint_callback.dirpath)),
            "warnings": caught}), flush=True)
