"""``strategy="gnnpipe"``: pipelined layer-level model parallelism for full-graph training in Lightning."""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Literal, Optional, Sequence, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor

from ..engine import Comm, GNNPipeEngine, PipelineConfig, refuse_graph_builders, sync_module_state
from ..engine.runtime.timeline import write_trace
from ..memory import PeakMemory
from ..model import UnsupportedModelError
from ..model.find import count_layers, pipelined_module
from .batch import SameGraph, check_batch, check_graph, graph_of
from .callbacks import (CommLogger, GlobalNormClipping, MemoryCheck, StalenessLogger, TimelineLogger,
                        clip_by_global_norm, memory_check)
from .checkpoint import PipelineCheckpoints
from .errors import PostsErrors
from .launchers import CheckedScriptLauncher, ResultsLauncher


class GNNPipeStrategy(PostsErrors, DDPStrategy):
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
        num_chunks, grid, shuffle_chunks, snapshot_period, unbiased_gradients, late_gradients, balance, partition,
        seed, per_chunk_statistics, split_points, recompute, memory_budget, offload, offload_budget, offload_dir,
        streaming, cuda_graphs, overlap, boundary_dtype, history_dtype, timeline_trace, staleness_meter, max_age,
        max_staleness, smoothing, halo_exchange: the engine's knobs, each documented in
            :class:`pyg_pipe.engine.PipelineConfig` (and when to use which in docs/gnnpipe.md).
        model: attribute name of the module to pipeline inside the LightningModule (``""``: the LightningModule
            itself); by default the smallest sub-module that holds every ``MessagePassing`` layer.
        comm_timeout: seconds a send, receive or collective may wait before failing (a stuck peer never
            hangs the run).
        checkpoint_history: also store the historical embeddings in checkpoints, so resuming
            continues exactly (they are as large as one copy of every stage's layer inputs).
        fused_kernels: while training, route PyG's sparse-adjacency aggregation (layers given a
            torch.sparse ``adj_t``), and the Gather of layers given an ``edge_index`` whose message is the
            source row, optionally weighted per edge (GCNConv, GCN2Conv, SAGEConv, GINConv, GraphConv,
            GATConv, ...: :func:`pyg_pipe.ops.fuse_messages`), to the compiled CSR kernels of
            :mod:`pyg_pipe.ops` (built on first use; ``PYG_PIPE_DISABLE_EXTENSIONS=1`` or ``False`` here
            keeps PyG's own path).
        start_method, timeout, process_group_backend, cluster_environment, ...: as for
            :class:`~lightning.pytorch.strategies.DDPStrategy` (``"popen"`` by default, also under
            ``torchrun`` and SLURM through Lightning's cluster environments).
    """

    strategy_name = "gnnpipe"

    def __init__(
        self,
        num_chunks: Optional[Union[int, str]] = "auto",
        grid: str = "pipeline",
        shuffle_chunks: Union[bool, str] = True,
        snapshot_period: Optional[int] = 11,
        unbiased_gradients: bool = True,
        late_gradients: bool = False,
        balance: Union[str, Sequence[int]] = "time",
        partition: str = "auto",
        seed: int = 0,
        model: Optional[str] = None,
        comm_timeout: float = 600.0,
        checkpoint_history: bool = True,
        fused_kernels: bool = True,
        per_chunk_statistics: Union[bool, str] = "auto",
        split_points: Optional[Dict[str, Any]] = None,
        recompute: Union[bool, str] = "auto",
        memory_budget: Optional[int] = None,
        offload: Optional[str] = None,
        offload_budget: Union[None, int, str] = None,
        offload_dir: Optional[str] = None,
        streaming: Union[bool, str] = "auto",
        cuda_graphs: bool = True,
        overlap: bool = True,
        boundary_dtype: Optional[torch.dtype] = None,
        history_dtype: Optional[torch.dtype] = None,
        timeline_trace: Optional[str] = None,
        staleness_meter: bool = True,
        max_age: Optional[int] = None,
        max_staleness: Optional[float] = None,
        smoothing: Optional[float] = None,
        halo_exchange: str = "all_to_all",
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
        self.config = PipelineConfig(num_chunks=num_chunks, grid=grid, shuffle_chunks=shuffle_chunks,
                                     snapshot_period=snapshot_period, unbiased_gradients=unbiased_gradients,
                                     late_gradients=late_gradients,
                                     balance=balance, partition=partition, seed=seed,
                                     per_chunk_statistics=per_chunk_statistics, split_points=split_points,
                                     recompute=recompute, memory_budget=memory_budget, offload=offload,
                                     offload_budget=offload_budget,
                                     offload_dir=offload_dir, streaming=streaming, cuda_graphs=cuda_graphs,
                                     overlap=overlap,
                                     boundary_dtype=boundary_dtype, history_dtype=history_dtype,
                                     timeline_trace=timeline_trace,
                                     staleness_meter=staleness_meter, max_age=max_age, max_staleness=max_staleness,
                                     smoothing=smoothing, halo_exchange=halo_exchange)
        self.config.validate()
        if comm_timeout <= 0:
            raise ValueError(f"comm_timeout={comm_timeout} must be a positive number of seconds.")
        self.model_attr = model
        self.comm_timeout = float(comm_timeout)
        self.checkpoint_history = checkpoint_history
        self.fused_kernels = fused_kernels
        self.engine: Optional[GNNPipeEngine] = None
        self.comm: Optional[Comm] = None
        self.comm_history: List[Dict[str, int]] = []
        self.plan_seconds = 0.0  # time the engine spent planning (tracing, partitioning, history passes)
        self.notes: List[str] = []  # what the engine decided on its own (e.g. graph-parallel ways for a shallow model)
        self.planned_chunks: Optional[int] = None  # the plan's chunk count (with num_chunks="auto": the choice)
        self._chunk_choice: Optional[tuple] = None  # num_chunks="auto": (count, predicted step, offload) measured once
        self._grid_choice: Optional[tuple] = None  # grid="auto": (stages, ways) measured once
        self.plan_check: Optional[dict] = None  # num_chunks="auto": predicted against measured step (callbacks.py)
        self.peak_memory: List[int] = []  # per rank: peak bytes of the fit net of the start (pyg_pipe.memory)
        self._memory: Optional[PeakMemory] = None
        self.memory_prediction = None  # this rank's predicted peak after the first step (callbacks.MemoryCheck)
        self.memory_check: Optional[dict] = None  # per rank: predicted against measured peak, at the end
        self.checkpoints = PipelineCheckpoints(self)
        self._kernels = None
        self._fused_messages = None   # pyg_pipe.ops.fuse_messages' handle while training
        self._same_graph = SameGraph()
        self._failed = False

    # ----------------------------------------------------------------------- registration and launch
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        base = cls.strategy_name
        for name, start_method in ((base, "popen"), (f"{base}_spawn", "spawn"), (f"{base}_fork", "fork")):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"{cls.__name__} (start_method '{start_method}')",
                                           start_method=start_method)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = CheckedScriptLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = ResultsLauncher(self, start_method=self._start_method)

    def check_before_launch(self, *args: Any, **kwargs: Any) -> None:
        """Refusals that the model's structure decides, and a malformed graph among the arguments of the
        trainer's call (``args``, ``kwargs``), raised in the launching process before any worker starts (the
        workers would each raise them after starting)."""
        for value in list(args) + list(kwargs.values()):
            data = graph_of(value)
            if data is not None:
                check_graph(data)
        if self.lightning_module is None:
            return
        target = self._find_model()
        refuse_graph_builders(target)
        stages, ways, _ = self._grid()
        devices = self.num_nodes * self.num_processes
        if stages is None and ways is not None and devices % ways == 0:
            stages = devices // ways
        layers = count_layers(target)
        if stages is not None and stages > layers:
            raise UnsupportedModelError(
                f"{type(self).__name__}: {stages} pipeline stages but the model has {layers} message-passing layers; "
                f"every stage needs at least one. Use stages <= {layers} (e.g. pyg_pipe.HybridStrategy("
                f"stages={max(1, layers)}, ways=...)) or strategy='gnnpipe', which adds graph-parallel ways by itself.")

    def worker_results(self) -> dict:
        """What a spawned worker sends home (rank 0's): the pipeline state at the end of fit, counters."""
        return {"state": self.checkpoints.final_state, "comm_history": self.comm_history,
                "plan_seconds": self.plan_seconds, "notes": self.notes, "peak_memory": self.peak_memory,
                "planned_chunks": self.planned_chunks, "plan_check": self.plan_check,
                "memory_check": self.memory_check, "chunk_choice": self._chunk_choice,
                "grid_choice": self._grid_choice}

    def take_worker_results(self, results: dict) -> None:
        """Takes what :meth:`worker_results` sent, in the main process."""
        self.checkpoints.final_state, self.comm_history = results["state"], results["comm_history"]
        self.plan_seconds, self.notes = results["plan_seconds"], results["notes"]
        self.peak_memory, self.planned_chunks = results["peak_memory"], results["planned_chunks"]
        self.plan_check, self.memory_check = results["plan_check"], results["memory_check"]
        self._chunk_choice, self._grid_choice = results["chunk_choice"], results["grid_choice"]

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
        sync_module_state(self.lightning_module, {}, [0], comm=self.comm)
        stages, ways, min_ways = self._grid()
        self.engine = GNNPipeEngine(target, self.config, self.comm, num_stages=stages, ways=ways, min_ways=min_ways)
        self.engine.chunk_choice = self._chunk_choice  # (validate, fit, test: num_chunks="auto" measured once)
        self.engine.grid_choice = self._grid_choice    # (and grid="auto")
        self.engine.steps_only()  # training passes only inside training_step
        self.engine.install()
        if self.fused_kernels:
            from .. import ops
            self._fused_messages = ops.fuse_messages(target)
        self.checkpoints.install_pending()
        self._memory = PeakMemory(self.root_device).start()
        for kind in (CommLogger, TimelineLogger, StalenessLogger, MemoryCheck, GlobalNormClipping):
            if not any(isinstance(cb, kind) for cb in trainer.callbacks):
                trainer.callbacks.append(kind(self))

    def _grid(self):
        """``(stages, ways, min_ways)`` of the rank grid: one stage per process (``None``: decided from the
        model; graph-parallel ways are added when the model has fewer layers than devices)."""
        return None, None, 1

    def _find_model(self) -> torch.nn.Module:
        return pipelined_module(self.lightning_module, self.model_attr)

    def teardown(self) -> None:
        if self._kernels is not None:
            self._kernels.__exit__(None, None, None)
            self._kernels = None
        if self._fused_messages is not None:
            self._fused_messages.remove()
            self._fused_messages = None
        if self.engine is not None:
            self.plan_seconds = self.engine.setup_seconds
            self.notes += [n for n in self.engine.notes if n not in self.notes]  # (fit, then test: both said)
            if self.engine.plan is not None:
                self.planned_chunks = self.engine.plan.num_chunks
                self._grid_choice = self.engine.grid_choice
                if self.config.num_chunks == "auto" and self.engine.plan.predicted_step is not None:
                    self._chunk_choice = (self.planned_chunks, self.engine.plan.predicted_step,
                                          self.engine.plan.offload)
            self.engine.uninstall()
            self.engine = None
        if self.comm is not None:
            if self.world_size > 1 and not self._failed:
                self.comm.barrier("the end of the run")  # no rank leaves while another still talks to it
            self.comm = None
        super().teardown()

    # ----------------------------------------------------------------------- steps
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        return self._posting_errors(self._batch_to_device, batch, device, dataloader_idx)

    def _batch_to_device(self, batch: Any, device: Optional[torch.device], dataloader_idx: int) -> Any:
        check_batch(batch)
        if self._same_graph.new(batch):  # (once per graph object: the id range costs a pass over the edges)
            check_graph(batch)
        moved = super().batch_to_device(batch, device, dataloader_idx)
        if self.comm is not None:  # (known by the loader's objects: a GPU copy is new every step, digested once)
            self._same_graph.check(batch, self.comm, moved)
        return moved

    def _training_step(self, *args: Any, **kwargs: Any):
        """The training step (:class:`PostsErrors` wraps it): Lightning's, marked for the engine."""
        trainer = self.lightning_module.trainer
        if self.engine is None:
            out = DDPStrategy.training_step(self, *args, **kwargs)
        else:
            self.comm.reset_counters()
            with self.engine.training_step(trainer.global_step):
                out = DDPStrategy.training_step(self, *args, **kwargs)
        loss = out.get("loss") if isinstance(out, dict) else out
        if isinstance(loss, Tensor) and not bool(torch.isfinite(loss.detach()).all()):
            raise FloatingPointError(
                f"training_step returned a non-finite loss ({loss.detach().float().item()}) at epoch "
                f"{trainer.current_epoch}. pyg_pipe stops every rank here instead of stepping on NaN gradients. "
                f"Check the inputs for NaN/inf (torch.isfinite(data.x).all()), lower the learning rate, or clip "
                f"gradients (Trainer(gradient_clip_val=1.0)).")
        return out

    def on_train_end(self) -> None:
        super().on_train_end()
        self.checkpoints.at_train_end(gather_now=isinstance(self._launcher, ResultsLauncher))
        if self._memory is not None and self.comm is not None:
            mine = self.memory_prediction.state_dict() if self.memory_prediction is not None else None
            plan = self.engine.plan if self.engine is not None else None
            if mine is not None and plan is not None and plan.first_step_peak is not None:
                mine["first_step_estimate_bytes"] = plan.first_step_peak  # (num_chunks="auto" under a budget)
            gathered = self.comm.all_gather_objects((self._memory.net_bytes(), mine), "gathering peak memory")
            self.peak_memory = [m for m, _ in gathered]
            self.memory_check = memory_check([p for _, p in gathered], self.peak_memory)
            if self.memory_check["line"]:
                self.notes.append(self.memory_check["line"])
        if self.config.timeline_trace is not None and self.engine is not None and self.comm is not None:
            events = self.comm.all_gather_objects(self.engine.timeline.chrome_events(self.global_rank),
                                                  "gathering the timeline")
            if self.global_rank == 0:
                write_trace(self.config.timeline_trace, [e for rank in events for e in rank])

    # ----------------------------------------------------------------------- gradients and checkpoints
    def clip_gradients_by_global_norm(self, optimizer, max_norm: float) -> None:
        """``clip_grad_norm_`` over the whole model, the norm summed over the stages (a collective)."""
        owners, name_of = self.checkpoints.owners(), {id(p): n for n, p in self.lightning_module.named_parameters()}
        clip_by_global_norm(optimizer, lambda p: owners.get(name_of.get(id(p)), 0) == self.global_rank, max_norm,
                            self.comm, self.root_device)

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        self.checkpoints.sync_parameters()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer) -> Dict[str, Any]:
        return self.checkpoints.optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        self.checkpoints.add_to(checkpoint, filepath)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath) -> None:
        self.checkpoints.remove(filepath)
        super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=False if weights_only is None
                                             else weights_only)
        self.checkpoints.restore_from(checkpoint, checkpoint_path)
        return checkpoint
