"""``strategy="gnnpipe"``: pipelined layer-level model parallelism for full-graph training in Lightning."""
from __future__ import annotations

import io
from datetime import timedelta
from typing import Any, Dict, List, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import Tensor
from torch_geometric.data import Batch, Data, HeteroData
from torch_geometric.nn import MessagePassing

from ..engine import CATEGORIES, Comm, GNNPipeEngine, PipelineConfig, sync_module_state
from ..engine.engine import refuse_graph_builders
from ..model import UnsupportedModelError


class GNNPipeStrategy(DDPStrategy):
    """Trains an unchanged PyG model with GNNPipe: its layers split into one pipeline stage per
    device, the graph cut into chunks that flow through the stages (see docs/gnnpipe.md).

    Every process loads the same whole graph (use :class:`pyg_pipe.FullGraphDataModule` or a
    ``DataLoader([data], batch_size=None)``); the model's forward returns the full output on every
    rank, so ``training_step``, ``validation_step``, metrics, ``ModelCheckpoint`` and
    ``EarlyStopping`` work as on one device. One optimizer step per epoch.

    .. code-block:: python

        import lightning as L
        import pyg_pipe

        trainer = L.Trainer(strategy="gnnpipe", accelerator="cpu", devices=4, max_epochs=200)
        # or configured:
        trainer = L.Trainer(strategy=pyg_pipe.GNNPipeStrategy(num_chunks=16), devices=4)

    Args:
        num_chunks: chunks the graph is cut into (default ``4 × devices``, at most |V|). One chunk
            gives exact model parallelism; more chunks shrink the pipeline bubble but read
            neighbours from historical embeddings.
        shuffle_chunks: a new chunk order every epoch (staleness control T1).
        snapshot_period: historical embeddings are snapshotted every this many epochs and restored
            in between (T2); ``None`` turns snapshots off.
        unbiased_gradients: scale cross-chunk gradients by 2 and drop stale ones (T3).
        balance: ``"time"`` (measure each layer once and split stages by cost), ``"layers"`` (equal
            layer counts) or a list with the number of message-passing layers of every stage.
        partition: vertex partitioner for chunks: ``"auto"`` (METIS via ``pymetis`` when installed,
            else a locality-preserving greedy fallback), ``"metis"``, ``"greedy"``, ``"random"``,
            ``"contiguous"``.
        seed: seed of the partitioner and of the chunk shuffling.
        model: attribute name of the module to pipeline inside the LightningModule; by default the
            smallest sub-module that holds every ``MessagePassing`` layer.
        comm_timeout: seconds a pipeline send/receive may wait before failing (a stuck peer never
            hangs the run).
        checkpoint_history: also store the historical embeddings in checkpoints, so resuming
            continues exactly (they are as large as one copy of every stage's layer inputs).
        per_chunk_statistics: let graph-wide statistics (BatchNorm, GraphNorm, ...) use each chunk's rows
            when a way runs several chunks (approximate, as GPipe does for micro-batches); without it such
            models are refused with several chunks per way. With one chunk per way they are exact.
        split_points: ``{"module.name": SplitPoint.BEGINNING | SplitPoint.END}``: cut the pipeline
            before / after that module (the convention of ``torch.distributed.pipelining``; calling
            ``pyg_pipe.pipe_split()`` in the forward does the same).
        fused_kernels: while training, route PyG's sparse-adjacency aggregation (layers given a
            torch.sparse ``adj_t``) to the compiled CSR kernels of :mod:`pyg_pipe.ops` (built on
            first use; ``PYG_PIPE_DISABLE_EXTENSIONS=1`` or ``False`` here keeps PyG's own path).
        start_method, timeout, process_group_backend, cluster_environment, ...: as for
            :class:`~lightning.pytorch.strategies.DDPStrategy` (``"popen"`` by default, also under
            ``torchrun`` and SLURM through Lightning's cluster environments).
    """

    strategy_name = "gnnpipe"

    def __init__(
        self,
        num_chunks: Optional[int] = None,
        shuffle_chunks: bool = True,
        snapshot_period: Optional[int] = 23,
        unbiased_gradients: bool = True,
        balance: Union[str, Sequence[int]] = "time",
        partition: str = "auto",
        seed: int = 0,
        model: Optional[str] = None,
        comm_timeout: float = 600.0,
        checkpoint_history: bool = True,
        fused_kernels: bool = True,
        per_chunk_statistics: bool = False,
        split_points: Optional[Dict[str, Any]] = None,
        accelerator=None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self.config = PipelineConfig(num_chunks=num_chunks, shuffle_chunks=shuffle_chunks,
                                     snapshot_period=snapshot_period, unbiased_gradients=unbiased_gradients,
                                     balance=balance, partition=partition, seed=seed,
                                     per_chunk_statistics=per_chunk_statistics, split_points=split_points)
        self.config.validate()
        if comm_timeout <= 0:
            raise ValueError(f"comm_timeout={comm_timeout} must be a positive number of seconds.")
        self.model_attr = model
        self.comm_timeout = float(comm_timeout)
        self.checkpoint_history = checkpoint_history
        self.fused_kernels = fused_kernels
        self._kernels = None
        self.engine: Optional[GNNPipeEngine] = None
        self.comm: Optional[Comm] = None
        self.comm_history: List[Dict[str, int]] = []
        self.plan_seconds = 0.0  # time the engine spent planning (tracing, partitioning, history pass)
        self.notes: List[str] = []  # what the engine decided on its own (e.g. graph-parallel ways for a shallow model)
        self._pending_state: Optional[dict] = None
        # the pipeline state at the end of fit, for save_checkpoint after it: gathered on rank 0 when the
        # workers end with fit (spawn / fork), else this rank's part, gathered if a checkpoint is saved
        self._final_state: Optional[dict] = None
        self._final_local: Optional[dict] = None
        self._failed = False

    # ----------------------------------------------------------------------- registration
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, start_method in (("gnnpipe", "popen"), ("gnnpipe_spawn", "spawn"), ("gnnpipe_fork", "fork")):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"GNNPipe pipelined full-graph training "
                                           f"(start_method '{start_method}')", start_method=start_method)

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _MultiProcessingLauncher:  # spawn / fork: bring rank 0's results home
            self._launcher.__class__ = _ResultsLauncher
        elif type(self._launcher) is _SubprocessScriptLauncher:  # popen: check the model before starting
            self._launcher.__class__ = _CheckedScriptLauncher

    def check_before_launch(self) -> None:
        """Refusals that the model's structure decides, raised in the launching process before any
        worker starts (the workers would each raise them after starting)."""
        if self.lightning_module is None:
            return
        target = self._find_model()
        refuse_graph_builders(target)
        stages, ways, _ = self._grid()
        devices = self.num_nodes * self.num_processes
        if stages is None and ways is not None and devices % ways == 0:
            stages = devices // ways
        layers = _count_layers(target)
        if stages is not None and stages > layers:
            raise UnsupportedModelError(
                f"{type(self).__name__}: {stages} pipeline stages but the model has {layers} message-passing layers; "
                f"every stage needs at least one. Use stages <= {layers} (e.g. pyg_pipe.HybridStrategy("
                f"stages={max(1, layers)}, ways=...)) or strategy='gnnpipe', which adds graph-parallel ways by itself.")

    # ----------------------------------------------------------------------- setup / teardown
    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        # every rank sees the whole graph: no sharding of the (one-graph) dataset
        return {"num_replicas": 1, "rank": 0}

    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: each stage owns its own parameters."""

    def setup(self, trainer) -> None:
        if trainer.log_every_n_steps == 50:
            # Lightning's default; with one optimizer step per epoch it would log the training loss every
            # 50 epochs (and warn about it): log every step, i.e. every epoch
            trainer.log_every_n_steps = 1
        if self.fused_kernels and self._kernels is None:
            from .. import ops
            self._kernels = ops.fused_kernels()
            self._kernels.__enter__()
        super().setup(trainer)
        if self.engine is None:
            self._setup_pipeline(trainer)

    def _setup_pipeline(self, trainer) -> None:
        target = self._find_model()
        self.comm = Comm(self.root_device, timeout=self.comm_timeout)
        # every rank starts from rank 0's weights (processes started by `popen` build their own model)
        sync_module_state(self.lightning_module, {}, [0])
        stages, ways, min_ways = self._grid()
        self.engine = GNNPipeEngine(target, self.config, self.comm, num_stages=stages, ways=ways, min_ways=min_ways)
        self.engine.stage_hint = "eval"  # training passes only inside training_step (see _training_step)
        self.engine.install()
        if self._pending_state is not None:
            self.engine.load_state_dict(self._pending_state)
            self._pending_state = None
        # gradient_clip_val with norm clipping must use the norm over all stages, not one stage's
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm
        if not any(isinstance(cb, _CommLogger) for cb in trainer.callbacks):
            trainer.callbacks.append(_CommLogger(self))

    def _grid(self):
        """``(stages, ways, min_ways)`` of the rank grid: one stage per process (``None``: decided from the
        model; graph-parallel ways are added when the model has fewer layers than devices)."""
        return None, None, 1

    def _owner_rank(self, owners: Dict[str, int], name: Optional[str]) -> int:
        """The rank whose copy of parameter ``name`` is authoritative (way 0 of its stage)."""
        return self.engine.owner_ranks[owners.get(name, 0)] if self.engine is not None and self.engine.owners else 0

    def _clip_grad_by_global_norm(self, optimizer, clip_val) -> None:
        """``clip_grad_norm_`` over the whole model: each stage adds the squared norms of the parameters
        it owns (replicated parameters are counted once, on rank 0), one all-reduce sums them."""
        owners = _prefixed(self.lightning_module, self.engine.module, self.engine.owners) if self.engine else {}
        name_of = {id(p): n for n, p in self.lightning_module.named_parameters()}
        grads = [p.grad for p in self.precision_plugin.main_params(optimizer) if p.grad is not None]
        mine = [p.grad for p in self.precision_plugin.main_params(optimizer)
                if p.grad is not None and self._owner_rank(owners, name_of.get(id(p))) == self.global_rank]
        sq = torch.zeros((), dtype=torch.float64, device=self.root_device)
        for g in mine:
            sq += g.detach().double().pow(2).sum()
        if self.world_size > 1:
            dist.all_reduce(sq)
        coef = float(clip_val) / (float(sq.sqrt()) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.detach().mul_(coef)

    def _find_model(self) -> torch.nn.Module:
        lm = self.lightning_module
        if self.model_attr is not None:
            target = lm.get_submodule(self.model_attr)
            if not any(isinstance(m, MessagePassing) for m in target.modules()):
                raise UnsupportedModelError(f"GNNPipeStrategy(model='{self.model_attr}'): that module holds no "
                                            f"MessagePassing layer.")
            return target
        mp = [name for name, m in lm.named_modules() if isinstance(m, MessagePassing)]
        if not mp:
            raise UnsupportedModelError(
                f"{type(lm).__name__} holds no torch_geometric MessagePassing layer, so strategy='gnnpipe' has "
                f"nothing to pipeline. Use strategy='ddp' for models without graph layers.")
        parts = [n.split(".") for n in mp]
        common = []
        for level in zip(*parts):
            if len(set(level)) != 1:
                break
            common.append(level[0])
        if len(mp) == 1 and common == parts[0]:
            common = common[:-1]  # a single layer: pipeline the module around it
        # containers (ModuleList, ModuleDict) have no forward: the module that calls the layers is above them
        while common and isinstance(lm.get_submodule(".".join(common)), (torch.nn.ModuleList, torch.nn.ModuleDict)):
            common = common[:-1]
        return lm.get_submodule(".".join(common)) if common else lm

    def teardown(self) -> None:
        if self._kernels is not None:
            self._kernels.__exit__(None, None, None)
            self._kernels = None
        if self.engine is not None:
            self.plan_seconds = self.engine.plan_seconds
            self.notes = list(self.engine.notes)
            self.engine.uninstall()
            self.engine = None
        if self.comm is not None:
            self.comm.close()
            self.comm = None
            if dist.is_initialized() and self.world_size > 1 and not self._failed:
                self.barrier("pyg_pipe.teardown")  # no rank leaves while another still talks to it
        super().teardown()

    # ----------------------------------------------------------------------- steps
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        return self._posting_errors(self._batch_to_device, batch, device, dataloader_idx)

    def _batch_to_device(self, batch: Any, device: Optional[torch.device], dataloader_idx: int) -> Any:
        _check_batch(batch)
        batch = super().batch_to_device(batch, device, dataloader_idx)
        self._check_same_data(batch)
        return batch

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.engine is not None:
            self.engine.step = self.lightning_module.trainer.global_step
            self.comm.reset_counters()

    def _posting_errors(self, fn, *args, **kwargs):
        """Runs ``fn``; if it raises, every other rank learns why before this one exits (the spawn and
        fork launchers run the trainer without Lightning's exception hooks in the workers)."""
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            self._failed = True
            if self.comm is not None:
                self.comm.post_error(exc)
            raise

    def validation_step(self, *args: Any, **kwargs: Any):
        return self._posting_errors(super().validation_step, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        return self._posting_errors(super().test_step, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        return self._posting_errors(super().predict_step, *args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer, *args: Any, **kwargs: Any) -> Tensor:
        return self._posting_errors(super().backward, closure_loss, optimizer, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any):
        return self._posting_errors(self._training_step, *args, **kwargs)

    def _training_step(self, *args: Any, **kwargs: Any):
        if self.engine is not None:
            self.engine.stage_hint = "train"
        try:
            out = super().training_step(*args, **kwargs)
        finally:
            if self.engine is not None:
                self.engine.stage_hint = "eval"
        loss = out.get("loss") if isinstance(out, dict) else out
        if isinstance(loss, Tensor) and not bool(torch.isfinite(loss.detach()).all()):
            trainer = self.lightning_module.trainer
            raise FloatingPointError(
                f"training_step returned a non-finite loss ({loss.detach().float().item()}) at epoch "
                f"{trainer.current_epoch}. pyg_pipe stops every rank here instead of stepping on NaN gradients. "
                f"Check the inputs for NaN/inf (torch.isfinite(data.x).all()), lower the learning rate, or clip "
                f"gradients (Trainer(gradient_clip_val=1.0)).")
        return out

    def on_train_end(self) -> None:
        super().on_train_end()
        self._sync_parameters()
        if self.checkpoint_history and self.engine is not None and self.engine.plan is not None:
            if isinstance(self._launcher, _ResultsLauncher):  # the workers end with fit: rank 0 takes it home
                self._final_state = self._pipeline_state()
            else:  # every process lives on (and calls save_checkpoint with the others): gather only then
                self._final_local = self.engine.state_dict()

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        if self.comm is not None:
            self.comm.post_error(exception)
        super().on_exception(exception)

    # ----------------------------------------------------------------------- checkpoints
    def _sync_parameters(self) -> None:
        if self.engine is not None and self.engine.owners:
            owners = _prefixed(self.lightning_module, self.engine.module, self.engine.owners)
            sync_module_state(self.lightning_module, owners, self.engine.owner_ranks)

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        self._sync_parameters()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer) -> Dict[str, Any]:
        """The optimizer state with every parameter's entry taken from the stage that owns it."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        state = optimizer.state_dict()
        if self.engine is None or not self.engine.owners or self.world_size == 1:
            return state
        owners = _prefixed(self.lightning_module, self.engine.module, self.engine.owners)
        name_of = {id(p): n for n, p in self.lightning_module.named_parameters()}
        index_owner, i = {}, 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                index_owner[i] = self._owner_rank(owners, name_of.get(id(p)))
                i += 1
        mine = {k: v for k, v in state["state"].items() if index_owner.get(k, 0) == self.global_rank}
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, {k: _to_cpu(v) for k, v in mine.items()})
        merged = {}
        for rank_states in gathered:
            merged.update(rank_states)
        state["state"] = {k: merged[k] for k in sorted(merged)}
        return state

    def _pipeline_state(self, mine: Optional[dict] = None) -> Optional[dict]:
        """Every rank's engine state (plan and history; ``mine`` or the engine's now), gathered on
        rank 0 (a collective; ``None`` on the other ranks)."""
        if mine is None:
            if self.engine is None or self.engine.plan is None:
                return None
            mine = self.engine.state_dict()
        gathered: List[Any] = [mine]
        if self.world_size > 1:
            gathered = _gather_on_root(mine, self.global_rank, self.world_size, self.root_device)
            if self.global_rank != 0:  # only rank 0 writes checkpoints
                return None
        return {"plan": gathered[0]["plan"], "ranks": [g["rank"] for g in gathered], "world_size": self.world_size}

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if self.checkpoint_history:
            if self.engine is not None:
                state = self._pipeline_state()
            elif self._final_local is not None:
                state = self._pipeline_state(self._final_local)
            else:
                state = self._final_state
            if state is not None:
                checkpoint["pyg_pipe"] = state
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=False if weights_only is None
                                             else weights_only)
        extra = checkpoint.get("pyg_pipe")
        if extra:
            same = extra.get("world_size") == self.world_size
            state = {"plan": extra["plan"], "rank": extra["ranks"][self.global_rank] if same else None}
            if self.engine is not None:
                self.engine.load_state_dict(state)
            else:
                self._pending_state = state
        return checkpoint

    # ----------------------------------------------------------------------- data checks
    def _check_same_data(self, batch: Data) -> None:
        if self.world_size == 1 or not dist.is_initialized():
            return
        # the same tensors, unchanged since the last check (one graph, every epoch): nothing to compare
        key = tuple((k, id(v), v._version) for k, v in batch.items() if isinstance(v, Tensor))
        same = torch.tensor([float(key == getattr(self, "_checked_batch", None))], device=self.root_device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)  # skip only where every rank can (a collective follows)
        if same.item() == 1.0:
            return
        mine = _fingerprint(batch)
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        bad = sorted({k for other in gathered for k in set(other) | set(mine)
                      if other.get(k) != gathered[0].get(k)})
        if bad:
            raise ValueError(
                f"The graph differs between ranks (attributes: {', '.join(bad)}). pyg_pipe's strategies need the "
                f"same whole graph on every process: build it deterministically (seed the generator, e.g. "
                f"lightning.seed_everything(0) before creating it) or load it from the same file on every rank.")
        self._checked_batch = key


def _count_layers(module: torch.nn.Module) -> int:
    """Message-passing layers of a model (those not inside another message-passing layer)."""
    names = [n for n, m in module.named_modules() if isinstance(m, MessagePassing)]
    return sum(1 for n in names if not any(n.startswith(o + ".") for o in names))


class _CheckedScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script (popen) launcher, checking the model before it starts the other processes."""

    def launch(self, function, *args, trainer=None, **kwargs):
        if trainer is not None:
            trainer.strategy.check_before_launch()
        return super().launch(function, *args, trainer=trainer, **kwargs)


class _ResultsLauncher(_MultiProcessingLauncher):
    """Lightning's spawn / fork launcher, also returning the pipeline's state and counters of rank 0 to
    the main process (so ``trainer.save_checkpoint`` after ``fit`` includes the history)."""

    def launch(self, function, *args, trainer=None, **kwargs):
        self._strategy.check_before_launch()
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def get_extra_results(self, trainer) -> Dict[str, Any]:
        extra = super().get_extra_results(trainer)
        s = self._strategy
        buffer = io.BytesIO()
        torch.save({"state": s._final_state, "comm_history": s.comm_history, "plan_seconds": s.plan_seconds,
                    "notes": s.notes}, buffer)
        extra["pyg_pipe"] = buffer.getvalue()
        return extra

    def update_main_process_results(self, trainer, extra: Dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if "pyg_pipe" in extra:
            got = torch.load(io.BytesIO(extra["pyg_pipe"]), weights_only=False)
            s = self._strategy
            s._final_state, s.comm_history, s.plan_seconds, s.notes = (got["state"], got["comm_history"],
                                                                      got["plan_seconds"], got["notes"])


class _CommLogger(Callback):
    """Logs the pipeline's communication of every training epoch: ``comm/bytes`` (summed over all
    ranks) and ``comm/<category>`` for each category of :mod:`pyg_pipe.engine.comm`."""

    def __init__(self, strategy: GNNPipeStrategy):
        self.strategy = strategy
        self._epoch: Dict[str, int] = {}

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._epoch = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.strategy.comm is None:
            return
        for k, v in self.strategy.comm.totals(reduce=True).items():
            self._epoch[k] = self._epoch.get(k, 0) + v
        self.strategy.comm.reset_counters()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self._epoch:
            return
        self.strategy.comm_history.append(dict(self._epoch))
        # the counts are already summed over ranks (the same on every rank): sync_dist only keeps
        # Lightning from asking for it
        log = dict(on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
        pl_module.log("comm/bytes", torch.tensor(float(self._epoch["total"]), dtype=torch.float64), **log)
        for cat in self.categories:
            pl_module.log(f"comm/{cat}", torch.tensor(float(self._epoch.get(cat, 0)), dtype=torch.float64), **log)

    @property
    def categories(self) -> List[str]:
        """The categories this grid can send (pipeline ones with stages, halo ones with ways)."""
        engine = self.strategy.engine
        stages, ways = (engine.num_stages, engine.ways) if engine is not None and engine.grid is not None else (2, 2)
        skip = set()
        if stages == 1:
            skip |= {"stage_activations", "stage_gradients", "carried"}
        if ways == 1:
            skip |= {"halo_forward", "halo_backward", "weight_allreduce"}
        return [c for c in CATEGORIES if c not in skip]


def _check_batch(batch: Any) -> None:
    fix = ("pyg_pipe trains on one whole graph per step: the dataloader must yield a single "
           "torch_geometric.data.Data, e.g. pyg_pipe.FullGraphDataModule(data) or DataLoader([data], batch_size=None).")
    if isinstance(batch, HeteroData):
        raise TypeError(f"The dataloader yielded a HeteroData; heterogeneous graphs are not supported yet. {fix}")
    if isinstance(batch, Batch) and batch.num_graphs != 1:
        raise ValueError(f"The dataloader yielded a Batch of {batch.num_graphs} graphs. {fix}")
    if not isinstance(batch, Data):
        raise TypeError(f"The dataloader yielded a {type(batch).__name__}, not a Data object. {fix}")


def _fingerprint(data: Data) -> Dict[str, tuple]:
    """Per attribute: shape, dtype, count of non-finite values and two checksums (plain and position
    weighted), computed block by block so the check never holds more than a few MB extra."""
    out = {}
    for key, value in data.items():
        if isinstance(value, Tensor):
            v = value.detach()
            if v.layout == torch.sparse_coo:
                v = v.coalesce()
                parts = [v.indices().reshape(-1), v.values().reshape(-1)]
            elif v.layout == torch.sparse_csr:
                parts = [v.crow_indices(), v.col_indices(), v.values().reshape(-1)]
            else:
                parts = [v.reshape(-1)]
            bad, total, weighted, offset = 0, 0.0, 0.0, 0
            for part in parts:
                for start in range(0, part.numel(), 1 << 20):
                    flat = part[start:start + (1 << 20)].double()
                    if flat.is_floating_point():
                        bad += int((~torch.isfinite(flat)).sum())
                        flat = torch.nan_to_num(flat, nan=0.5, posinf=1.5, neginf=-1.5)
                    pos = torch.arange(offset + 1, offset + flat.numel() + 1, dtype=torch.float64,
                                       device=flat.device) % 997
                    total += float(flat.sum())
                    weighted += float((flat * pos).sum())
                    offset += flat.numel()
            out[key] = (tuple(value.shape), str(value.dtype), bad, round(total, 6), round(weighted, 4))
        elif isinstance(value, (int, float, str, bool)):
            out[key] = (value,)
    return out


def _prefixed(root: torch.nn.Module, sub: torch.nn.Module, owners: Dict[str, int]) -> Dict[str, int]:
    """Owner map of ``sub``'s parameters, keyed by their names inside ``root``."""
    prefix = next((n for n, m in root.named_modules() if m is sub), "")
    return {(f"{prefix}.{k}" if prefix else k): v for k, v in owners.items()}


def _gather_on_root(state: Any, rank: int, world_size: int, device: torch.device) -> Optional[List[Any]]:
    """Every rank's ``state`` (nested dicts / lists of tensors and small values) on rank 0, as CPU
    tensors; ``None`` elsewhere. The structure, with each tensor's shape and dtype, travels pickled
    (small); the tensors (the history, up to |V| x width per call site) travel one at a time as they
    are, so rank 0 holds each only once, in its result, instead of several pickled copies of everything."""
    tensors: List[Tensor] = []

    def strip(obj):
        if isinstance(obj, Tensor):
            tensors.append(obj)
            return _TensorSlot(len(tensors) - 1)
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(strip(v) for v in obj)
        return obj

    skeleton = strip(state)
    mine = (skeleton, [(tuple(t.shape), t.dtype) for t in tensors])
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        for t in tensors:
            dist.send(t.detach().to(device).contiguous(), dst=0)
        return None

    def fill(obj, received: List[Tensor]):
        if isinstance(obj, _TensorSlot):
            return received[obj.index]
        if isinstance(obj, dict):
            return {k: fill(v, received) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(fill(v, received) for v in obj)
        return obj

    out = [fill(skeleton, [t.detach().cpu() for t in tensors])]
    for src in range(1, world_size):
        skeleton, meta = gathered[src]
        received = []
        for shape, dtype in meta:  # in the order the sender sends them
            buf = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buf, src=src)
            received.append(buf.cpu())
        out.append(fill(skeleton, received))
    return out


class _TensorSlot:
    """Where the ``index``-th tensor sits in a gathered state (see :func:`_gather_on_root`)."""

    def __init__(self, index: int):
        self.index = index


def _to_cpu(obj):
    if isinstance(obj, Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj
