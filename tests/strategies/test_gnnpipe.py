"""``strategy="gnnpipe"`` through a real Lightning Trainer, on spawned gloo processes, with Lightning's
defaults (sanity check, checkpointing, logger, progress bar) unless a test is about one of them.

Transparency (one chunk: parameters in the user's model after fit equal single-process PyG),
validation metrics on every rank, the logged communication against the formula, checkpoints that
load into the plain model and resume exactly (the history in one shard per rank beside the
checkpoint), a resume on another number of processes, a module in eval mode, and what a resume with
other settings says.
"""
import copy
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from pyg_pipe import GNNPipeStrategy
from pyg_pipe.engine import gnnpipe_bytes
from pyg_pipe.strategies.checkpoint import rank_state
from tests.lit import NodeClassifier, graph_loader
from tests.models import as_data, make_model, small_graph


def trainer(root, devices=2, max_epochs=3, callbacks=(), clip=None, **strategy_kw):
    strategy = GNNPipeStrategy(start_method="spawn", comm_timeout=60, **strategy_kw)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=max_epochs,
                      default_root_dir=str(root), gradient_clip_val=clip, callbacks=list(callbacks))


@pytest.fixture(scope="module")
def data():
    return as_data(*small_graph())


def reference_fit(model, data, epochs, lr=0.05, clip=None):
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    for _ in range(epochs):
        out = ref(data.x, data.edge_index)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
    return ref


def assert_trained_as_one_device(model, ref, data, t):
    """The user's model object in the main process holds every trained parameter of ``ref`` (trained on one
    device), and the validation accuracy logged equals ``ref``'s."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)
    with torch.no_grad():
        out = ref.eval()(data.x, data.edge_index)
    acc = (out.argmax(-1)[data.val_mask] == data.y[data.val_mask]).float().mean()
    assert float(t.callback_metrics["val_acc"]) == pytest.approx(float(acc), abs=1e-6)


def test_string_strategy_is_registered():
    t = pl.Trainer(strategy="gnnpipe", accelerator="cpu", devices=2, logger=False)
    assert isinstance(t.strategy, GNNPipeStrategy)
    assert t.strategy._start_method == "popen"


@pytest.mark.parametrize("devices,clip", [(2, None), (4, 0.05)])
def test_fit_matches_single_process_and_logs_bytes(data, devices, clip, tmp_path):
    """With clip: gradient-norm clipping uses the norm over all stages, as on one device."""
    torch.manual_seed(0)
    model = make_model("gcn")
    ref = reference_fit(model, data, epochs=3, clip=clip)
    lit = NodeClassifier(model)
    t = trainer(tmp_path, devices=devices, num_chunks=1, clip=clip)
    t.fit(lit, train_dataloaders=graph_loader(data), val_dataloaders=graph_loader(data))
    assert_trained_as_one_device(lit.model, ref, data, t)
    # communication: GCN hidden 16 at every cut, 3 classes
    want = gnnpipe_bytes(data.num_nodes, devices, width=16, out_width=3)
    for key in ("stage_activations", "stage_gradients", "carried", "output"):
        assert float(t.callback_metrics[f"comm/{key}"]) == want[key], key
    assert float(t.callback_metrics["comm/bytes"]) == want["total"]
    assert "comm/halo_forward" not in t.callback_metrics  # no graph-parallel ways: not logged
    assert "staleness/max_drift" not in t.callback_metrics  # one chunk a way: nothing read stale


def test_the_timeline_and_the_staleness_meter_reach_the_logger_and_the_trace_file(data, tmp_path):
    """time/compute, time/wait, time/bubble and time/bubble_share reach Lightning's CSVLogger, and each
    stage's compute with the stages' imbalance; with
    timeline_trace every rank's chunks of every step (fill and drain) are in one Chrome trace. The
    staleness meter's metrics reach it too (their values are checked in tests/engine/test_staleness.py):
    the second step reads the snapshot the first took, one update old, from weights that moved. The run has
    ``late_gradients=True`` (the knob through Lightning; its gradients are checked in
    tests/engine/test_backward.py)."""
    import json

    from lightning.pytorch.loggers import CSVLogger
    torch.manual_seed(0)
    lit = NodeClassifier(make_model("gcn"))
    trace = tmp_path / "trace" / "timeline.json"
    strategy = GNNPipeStrategy(start_method="spawn", comm_timeout=60, num_chunks=4, timeline_trace=str(trace),
                               late_gradients=True)
    t = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2, logger=CSVLogger(str(tmp_path)),
                   enable_progress_bar=False, enable_checkpointing=False)
    t.fit(lit, train_dataloaders=graph_loader(data), val_dataloaders=graph_loader(data))
    for key in ("compute", "wait", "bubble", "bubble_share"):
        assert float(t.callback_metrics[f"time/{key}"]) >= 0, key
    assert float(t.callback_metrics["time/compute"]) > 0
    (csv,) = tmp_path.glob("lightning_logs/*/metrics.csv")   # written by rank 0 (a spawned worker)
    header = csv.read_text().splitlines()[0]
    assert "time/compute" in header and "time/bubble_share" in header
    assert "time/compute/stage0" in header and "time/compute/stage1" in header   # 2 processes: 2 stages
    assert float(t.callback_metrics["time/stage_imbalance"]) >= 1.0
    for key in ("max_drift", "stale_share", "mean_age"):
        assert f"staleness/{key}" in header, key
    assert "staleness/drift/" in header
    assert float(t.callback_metrics["staleness/max_drift"]) > 0
    assert 0 < float(t.callback_metrics["staleness/stale_share"]) < 1
    assert float(t.callback_metrics["staleness/mean_age"]) == 1.0
    assert float(t.callback_metrics["staleness/refreshes"]) == 0  # no bound set
    events = json.load(open(trace))["traceEvents"]
    spans = [e for e in events if e["tid"] == 0]
    for rank in (0, 1):  # 2 steps x (fill + drain) x 4 chunks, and the fill's output share once a step
        mine = [e["name"] for e in spans if e["pid"] == rank]
        assert len([n for n in mine if n != "output"]) == 2 * 2 * 4 and mine.count("output") == 2, (rank, mine)


class NoTimeline(pl.Callback):
    """As on a GPU: no timeline is recorded."""

    def on_fit_start(self, trainer, pl_module):
        trainer.strategy.engine.timeline.on = False


def test_without_a_timeline_the_prediction_is_checked_against_the_steps_wall_time(data, tmp_path):
    """On GPUs no timeline is recorded: num_chunks="auto"'s predicted step is then set against the training
    step's wall time (the device synchronised at its ends, for the steps checked only)."""
    torch.manual_seed(0)
    t = trainer(tmp_path, max_epochs=5, callbacks=[NoTimeline()])
    strategy = t.strategy
    t.fit(NodeClassifier(make_model("gcn")), train_dataloaders=graph_loader(data))
    check = strategy.plan_check
    assert check is not None and check["steps"] == 3 and check["measured_step_s"] > 0, check
    assert any("the training step's wall time" in n for n in strategy.notes), strategy.notes


def test_one_device_with_an_offload_tier_streams_exactly(data, tmp_path):
    """devices=1 with offload="disk": the model streams group by group over the chunks (NGra), every value
    between groups in memory-mapped files; the parameters after fit equal one process's at lr > 0."""
    torch.manual_seed(0)
    model = make_model("gcnii")
    ref = reference_fit(model, data, epochs=3)
    lit = NodeClassifier(model)
    strategy = GNNPipeStrategy(num_chunks=4, offload="disk", start_method="spawn")  # (no process group left here)
    t = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=3, default_root_dir=str(tmp_path),
                   enable_progress_bar=False)
    t.fit(lit, train_dataloaders=graph_loader(data), val_dataloaders=graph_loader(data))
    for (name, p), q in zip(lit.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)
    with torch.no_grad():
        out = ref.eval()(data.x, data.edge_index)
    acc = (out.argmax(-1)[data.val_mask] == data.y[data.val_mask]).float().mean()
    assert float(t.callback_metrics["val_acc"]) == pytest.approx(float(acc), abs=1e-6)
    assert len(strategy.peak_memory) == 1


def test_gcnii_carries_x0_and_counts_it(data, tmp_path):
    torch.manual_seed(0)
    lit = NodeClassifier(make_model("gcnii"), optimizer="adam", lr=0.01)
    t = trainer(tmp_path, num_chunks=4, max_epochs=2)
    t.fit(lit, train_dataloaders=graph_loader(data))
    want = gnnpipe_bytes(data.num_nodes, 2, width=16, out_width=3, carried_width=16)
    assert float(t.callback_metrics["comm/carried"]) == want["carried"] > 0
    assert float(t.callback_metrics["comm/bytes"]) == want["total"]
    # every rank's peak memory over the fit comes home (pyg_pipe.memory; its value is not judged here)
    assert len(t.strategy.peak_memory) == 2 and all(isinstance(p, int) and p >= 0 for p in t.strategy.peak_memory)


def test_checkpoint_loads_into_plain_model_and_resume_is_exact(data, tmp_path):
    kw = dict(num_chunks=4, snapshot_period=2)
    torch.manual_seed(0)
    model = make_model("gcnii")
    # straight run: 4 epochs
    straight = NodeClassifier(copy.deepcopy(model), optimizer="adam", lr=0.01)
    trainer(tmp_path / "a", max_epochs=4, **kw).fit(straight, train_dataloaders=graph_loader(data))
    # interrupted run: 2 epochs, checkpoint, resume to 4
    ckpt_dir = str(tmp_path / "ckpt")
    first = NodeClassifier(copy.deepcopy(model), optimizer="adam", lr=0.01)
    cb = ModelCheckpoint(dirpath=ckpt_dir, save_last=True)
    trainer(tmp_path / "b", max_epochs=2, callbacks=[cb], **kw).fit(first, train_dataloaders=graph_loader(data))
    ckpt = torch.load(os.path.join(ckpt_dir, "last.ckpt"), weights_only=False)
    # the checkpoint's model state loads, strictly, into the plain single-device model
    plain = NodeClassifier(make_model("gcnii"))
    plain.load_state_dict(ckpt["state_dict"], strict=True)
    for p, q in zip(plain.parameters(), first.parameters()):
        torch.testing.assert_close(p, q)
    assert len(ckpt["optimizer_states"][0]["state"]) == len(list(model.parameters()))
    state = ckpt["pyg_pipe"]
    assert state["plan"]["num_chunks"] == 4 and "ranks" not in state     # rank 0 holds no other rank's history
    shards = [torch.load(os.path.join(ckpt_dir, f), weights_only=False) for f in state["shards"]]
    assert len(shards) == 2 and all(s["rank"]["history"]["calls"] for s in shards)
    # Lightning's removal of older checkpoints takes their shards along
    assert {f.split(".pyg_pipe-")[0] for f in os.listdir(ckpt_dir) if ".pyg_pipe-" in f} == \
        {f for f in os.listdir(ckpt_dir) if f.endswith(".ckpt")}
    resumed = NodeClassifier(copy.deepcopy(model), optimizer="adam", lr=0.01)
    trainer(tmp_path / "c", max_epochs=4, callbacks=[ModelCheckpoint(dirpath=ckpt_dir)], **kw).fit(
        resumed, train_dataloaders=graph_loader(data), ckpt_path=os.path.join(ckpt_dir, "last.ckpt"))
    for (name, p), q in zip(resumed.named_parameters(), straight.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    # on another number of processes: planned anew, history from an exact pass (rank_state warns; tested apart)
    elsewhere = NodeClassifier(copy.deepcopy(model), optimizer="adam", lr=0.01)
    t = trainer(tmp_path / "e", devices=1, max_epochs=3, **kw)
    t.fit(elsewhere, train_dataloaders=graph_loader(data), ckpt_path=os.path.join(ckpt_dir, "last.ckpt"))
    assert t.state.finished
    moved = [not torch.equal(p, q) for p, q in zip(elsewhere.state_dict().values(), ckpt["state_dict"].values())]
    assert any(moved)  # the checkpoint's weights trained on for an epoch
    # a resume with other settings says which one differs
    other = NodeClassifier(copy.deepcopy(model), optimizer="adam", lr=0.01)
    with pytest.raises(Exception, match=r"saved with num_chunks = 4, but this run has 8"):
        trainer(tmp_path / "d", max_epochs=4, num_chunks=8).fit(
            other, train_dataloaders=graph_loader(data), ckpt_path=os.path.join(ckpt_dir, "last.ckpt"))


def test_a_checkpoint_of_another_world_size_restarts_the_history_and_says_so(tmp_path):
    saved = {"plan": {"num_chunks": 4}, "world_size": 2, "shards": ["a.ckpt.pyg_pipe-rank0-of-2",
                                                                   "a.ckpt.pyg_pipe-rank1-of-2"]}
    with pytest.warns(UserWarning, match="saved by 2 processes and this run has 4.*planned anew.*exact pass"):
        assert rank_state(saved, 3, 4, tmp_path / "a.ckpt") == {}
    with pytest.raises(FileNotFoundError, match="rank 1's history.*a.ckpt.pyg_pipe-rank1-of-2.*checkpoint_history=False"):
        rank_state(saved, 1, 2, tmp_path / "a.ckpt")


def test_save_checkpoint_after_fit_keeps_the_pipeline_state(data, tmp_path):
    """``trainer.save_checkpoint`` after ``fit`` (in the main process, spawn launcher) writes the plan
    and every rank's history, so a resume from it continues the same pipeline."""
    torch.manual_seed(0)
    t = trainer(tmp_path, num_chunks=4, max_epochs=2, balance="layers")  # 2 + 2 layers: both stages keep history
    t.fit(NodeClassifier(make_model("gcn")), train_dataloaders=graph_loader(data))
    t.save_checkpoint(str(tmp_path / "after.ckpt"))
    ckpt = torch.load(str(tmp_path / "after.ckpt"), weights_only=False)
    state = ckpt["pyg_pipe"]
    assert state["world_size"] == 2 and state["plan"]["num_chunks"] == 4
    assert all(rank["history"]["calls"][0]["buffers"] and rank["history"]["calls"][0]["initialised"]
               for rank in state["ranks"])


class EvalModeClassifier(NodeClassifier):
    """Puts its model in eval mode for training (dropout off), as some users do for fine-tuning."""

    def on_train_epoch_start(self):
        self.model.eval()


def test_module_in_eval_mode_trains_as_on_one_device(data, tmp_path):
    from torch_geometric.nn import GCN
    torch.manual_seed(0)
    model = GCN(8, 16, 4, 3, dropout=0.5)
    ref = copy.deepcopy(model).eval()
    ref = reference_fit(ref, data, epochs=3)
    lit = EvalModeClassifier(model)
    trainer(tmp_path, num_chunks=1).fit(lit, train_dataloaders=graph_loader(data))
    for (name, p), q in zip(lit.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)


def test_monitoring_callbacks_see_the_metric_on_every_rank(data, tmp_path):
    """EarlyStopping and ModelCheckpoint decide collectively; they work because every rank logs the
    same validation metrics (the full output is available everywhere)."""
    from lightning.pytorch.callbacks import EarlyStopping

    torch.manual_seed(0)
    stop = EarlyStopping(monitor="val_loss", patience=1, min_delta=100.0)  # never "improves": stops early
    best = ModelCheckpoint(dirpath=str(tmp_path / "best"), monitor="val_acc", mode="max", save_top_k=1)
    t = trainer(tmp_path, max_epochs=10, callbacks=[stop, best], num_chunks=4)
    t.fit(NodeClassifier(make_model("sage")), train_dataloaders=graph_loader(data), val_dataloaders=graph_loader(data))
    assert t.current_epoch < 10
    assert os.path.exists(t.checkpoint_callback.best_model_path)


def test_batch_norm_with_historical_statistics_trains_as_on_one_device_at_lr0(data, tmp_path):
    """PyG's GCN with BatchNorm, 2 stages x 4 chunks, per_chunk_statistics="history", through Lightning: at
    lr = 0 the running statistics after fit and the validation loss equal one device's (the default
    refuses the model; per-chunk statistics would move the running statistics differently)."""
    from torch_geometric.nn.models import GCN
    torch.manual_seed(0)
    model = GCN(8, 16, 3, 3, norm="batch_norm")
    ref = copy.deepcopy(model)
    for _ in range(3):  # three training steps at lr = 0: only the running statistics move
        ref(data.x, data.edge_index)
    lit = NodeClassifier(model, lr=0.0)
    t = trainer(tmp_path, devices=2, max_epochs=3, num_chunks=4, per_chunk_statistics="history")
    t.fit(lit, train_dataloaders=graph_loader(data), val_dataloaders=graph_loader(data))
    want = dict(ref.named_buffers())
    for name, b in lit.model.named_buffers():
        torch.testing.assert_close(b, want[name], atol=1e-5, rtol=0, msg=name)
    with torch.no_grad():
        out = ref.eval()(data.x, data.edge_index)
    loss = F.cross_entropy(out[data.val_mask], data.y[data.val_mask])
    assert float(t.callback_metrics["val_loss"]) == pytest.approx(float(loss), abs=1e-5)
    assert "staleness/drift/statistics:norms.0.module#0" in t.callback_metrics


def test_pmlp_whose_training_forward_calls_no_layer_runs_on_graph_parallel_ways(data, tmp_path):
    """PyG's PMLP trains as an MLP (its graph layer runs in eval only): there is no stage to cut, so every
    device becomes a graph-parallel way (as for a model with fewer layers than devices) instead of a
    refusal. Its BatchNorm over the ways' rows and its 3 propagations at validation are exact: parameters
    after fit and the validation accuracy equal one process."""
    from torch_geometric.nn.models import PMLP
    torch.manual_seed(0)
    model = PMLP(data.num_features, 16, 3, num_layers=3)
    ref = reference_fit(model, data, epochs=3)
    lit = NodeClassifier(model)
    t = trainer(tmp_path, devices=2)
    t.fit(lit, train_dataloaders=graph_loader(data), val_dataloaders=graph_loader(data))
    assert_trained_as_one_device(lit.model, ref, data, t)
    assert any("calls no message-passing layer" in n for n in t.strategy.notes), t.strategy.notes


def test_a_compiled_model_trains_eagerly_under_the_engine_as_on_one_device(data, tmp_path):
    """``NodeClassifier(torch.compile(model))``: the strategy pipelines the module torch.compile wrapped and the
    engine runs outside the compiler (its per-chunk Python cannot be one graph), so with one chunk a stage the
    parameters after fit and the validation accuracy equal one process's (it used to crash)."""
    torch.manual_seed(0)
    model = make_model("gcn")
    ref = reference_fit(model, data, epochs=3)
    lit = NodeClassifier(torch.compile(model, backend="eager"))
    t = trainer(tmp_path, devices=2, num_chunks=1)
    t.fit(lit, train_dataloaders=graph_loader(data), val_dataloaders=graph_loader(data))
    assert_trained_as_one_device(model, ref, data, t)


class _LearnedInputs(pl.LightningModule):
    """A learned input per vertex held by the LightningModule, added to the features before PyG's GCN."""

    def __init__(self, n: int, f: int):
        super().__init__()
        torch.manual_seed(0)
        self.node_emb = torch.nn.Parameter(0.1 * torch.randn(n, f))
        self.model = make_model("gcn")

    def forward(self, x, edge_index):
        return self.model(x + self.node_emb, edge_index)

    def training_step(self, data, batch_idx):
        out = self(data.x, data.edge_index)
        return F.cross_entropy(out[data.train_mask], data.y[data.train_mask])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_a_learned_per_vertex_input_in_the_lightning_module(data, tmp_path):
    """By default the GCN is distributed and its input, computed from a parameter outside it, is refused naming
    model=''; with model='' the LightningModule's forward is, the parameter cut to each chunk's rows: exact."""
    with pytest.raises(Exception, match=r"requires grad.*nn.Parameter\(num_nodes, d\).*model='': the LightningModule"):
        pl.Trainer(strategy=GNNPipeStrategy(start_method="spawn", comm_timeout=60, num_chunks=1), accelerator="cpu",
                   devices=2, max_epochs=1, logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path)
                   ).fit(_LearnedInputs(data.num_nodes, data.num_features), train_dataloaders=graph_loader(data))
    lit, ref = _LearnedInputs(data.num_nodes, data.num_features), _LearnedInputs(data.num_nodes, data.num_features)
    opt = ref.configure_optimizers()
    for _ in range(3):
        loss = ref.training_step(data, 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    t = pl.Trainer(strategy=GNNPipeStrategy(start_method="spawn", comm_timeout=60, num_chunks=1, model=""),
                   accelerator="cpu", devices=2, max_epochs=3, logger=False, enable_checkpointing=False,
                   default_root_dir=str(tmp_path))
    t.fit(lit, train_dataloaders=graph_loader(data))
    for (name, p), q in zip(lit.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)
