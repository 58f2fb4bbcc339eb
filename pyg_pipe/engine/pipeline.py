"""The GNNPipe engine: chunked fill/drain schedule over pipeline stages with historical embeddings.

One :class:`GNNPipeEngine` lives on every rank and replaces the ``forward`` of the user's PyG model
(the smallest module holding all its ``MessagePassing`` layers). Rank ``s`` runs stage ``s`` of the
traced program (:mod:`pyg_pipe.model`). Every rank returns the full output, so the user's loss and
metrics code runs unchanged and identically everywhere.

Schedule of one training step (S stages, chunk order ``o = order(t)``, ``C`` chunks)::

    clock     0      1      2     ...   C-1      C     ...  C+S-2
    stage 0  o[0]   o[1]   o[2]   ...  o[C-1]
    stage 1         o[0]   o[1]   ...  o[C-2]  o[C-1]
    ...
    stage S-1                     ...                       o[C-1]     (fill, forward)

then the same in reverse chunk order from stage S-1 down to stage 0 (drain, backward), started by
the gradient of the user's loss. At clock ``k`` stage ``s`` runs all its layers for chunk ``o[k-s]``;
the bubble is ``S-1`` clocks per phase.

Historical embeddings. For every value ``v`` that a layer of the stage reads (its input ``h``, GCNII's
``x0``), the stage keeps a |V|-row buffer ``B_v``. A chunk's layer reads its own rows live and its
halo rows from ``B_v``; after computing ``v`` for a chunk it writes those rows into ``B_v``. So halo
rows of chunks earlier in ``o`` are *fresh* (this step) and the others *historical* (an earlier step).

Gradients. Drain visits chunks in reverse order, so every fresh read of chunk ``c``'s rows is
back-propagated before ``c`` itself: those cross-chunk gradients are accumulated in ``G_v`` and
injected into ``c``'s backward. Gradients of historical reads have no producer this step and are
dropped. Staleness controls (design.md §3):

* ``shuffle_chunks`` (T1): ``o`` is a fresh permutation every step, the same on all ranks
  (``torch.randperm`` seeded with ``seed + t``).
* ``snapshot_period = R`` (T2): at the start of step ``t`` the buffers are copied to a snapshot when
  ``t % R == 0`` and restored from it otherwise, so historical rows are an anchor refreshed every R steps.
* ``unbiased_gradients`` (T3): cross-chunk gradients are scaled by 2 (on average half of a vertex's
  consumers run after it), stale ones zeroed every step.

Before the first step the buffers are filled by one exact layer-wise pass, so history starts exact.
Inference (``model.eval()`` or no grad) is always exact: each stage runs its layers on the whole graph.

Communication per step (fp32, ``d`` = width of the activation at each cut, ``d0`` of carried tensors)::

    stage_activations = stage_gradients = (S-1)·|V|·d·4 bytes
    carried           = 2·(S-1)·|V|·d0·4 bytes          (only when a tensor such as x0 crosses a cut)
    output            = (S-1)·|V|·d_out·4 bytes         (last stage -> every other rank)

independent of the number of layers.

Graph-parallel ways (hybrid and graph parallelism, design.md §1, §4). The ``P = S·W`` ranks form a
grid: rank ``s·W + w`` runs stage ``s`` for way ``w``. The vertices are partitioned into ``W`` parts
(:func:`~pyg_pipe.graph.make_way_chunks`), each cut into ``C/W`` chunks; way ``w`` owns chunks
``w·C/W … (w+1)·C/W - 1`` and all ways walk their chunks in the same shuffled local order ``π``
(chunk ``w·C/W + π[k]`` at pipeline clock ``k``), so the ways of a stage are always at the same
chunk position and the same layer. Graph parallelism is the case ``S = 1``, ``C = W``.

* Forward, at a layer that reads value ``v`` with halos: way ``w`` sends to every other way ``w'``
  the rows of its current chunk that any chunk of ``w'`` reads (its *mirrors*), and receives theirs.
  Received rows are fresh; with ``C/W > 1`` they are also written into ``B_v`` for later chunks.
* Backward (:class:`_HaloJoin`): the gradient of every *fresh* halo row goes back to its owner —
  to ``G_v`` when the owner chunk is the way's own earlier chunk, over the wire to way ``w'``
  otherwise, where it is added to the current chunk's rows or to ``G_v`` of an earlier chunk.
* Values a layer uses only row by row (GCNII's ``x0``) need no halo: this is probed once per layer
  (random halo rows must not change the chunk's rows) and agreed on by all ways of the stage.
* Weight gradients of a stage are summed over its ways after the drain (one all-reduce).

Per step, with one chunk per way (``Σ_p |halo(p)|`` over the ``W`` partitions, ``d_l`` the width
of the value exchanged at layer ``l``)::

    halo_forward = halo_backward = Σ_l d_l · Σ_p |halo(p)| · 4 bytes
    weight_allreduce             = 2·(W-1)·#params·4      output = (P-1)·|V|·d_out·4

With more chunks per way the forward is the same; only gradients of fresh rows travel back.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor
from torch_geometric.nn import MessagePassing

from ..model.program import (EDGE, GRAPH, NODE, Program, UnsupportedModelError, bind_inputs,
                             forward_function, trace)
from ..model.split import Stage, balance, layer_groups, parameter_owner, split
from .chunks import Chunk, ChunkedGraph
from .comm import Comm


@dataclass
class PipelineConfig:
    """Knobs of the GNNPipe schedule (see :class:`pyg_pipe.GNNPipeStrategy` for their docs)."""

    num_chunks: Optional[int] = None
    shuffle_chunks: bool = True
    snapshot_period: Optional[int] = 23
    unbiased_gradients: bool = True
    balance: Union[str, Sequence[int]] = "time"
    partition: Union[str, Callable] = "auto"
    seed: int = 0

    def validate(self) -> None:
        if self.num_chunks is not None and (not isinstance(self.num_chunks, int) or self.num_chunks < 1):
            raise ValueError(f"num_chunks={self.num_chunks!r} must be a positive integer (or None for 4 per stage).")
        if self.snapshot_period is not None and (not isinstance(self.snapshot_period, int) or self.snapshot_period < 1):
            raise ValueError(f"snapshot_period={self.snapshot_period!r} must be a positive integer, or None to "
                             f"turn periodic snapshots off.")
        from ..graph.partition import PARTITION_METHODS
        if not callable(self.partition) and self.partition not in PARTITION_METHODS:
            raise ValueError(f"partition={self.partition!r} must be one of {', '.join(PARTITION_METHODS)} or a "
                             f"callable (edge_index, num_nodes, num_chunks) -> (perm, ptr).")
        if isinstance(self.balance, str) and self.balance not in ("time", "layers"):
            raise ValueError(f"balance={self.balance!r} must be 'time', 'layers' or a list of layers per stage.")


@dataclass
class _ChunkRecord:
    """What the fill keeps of one chunk for the drain."""

    in_leaves: Dict[str, Tensor] = field(default_factory=dict)
    out_roots: Dict[str, Tensor] = field(default_factory=dict)
    produced: Dict[str, Tensor] = field(default_factory=dict)
    local: Dict[str, Tensor] = field(default_factory=dict)


class _Plan:
    """Everything derived from one (graph, call signature): programs, stages, chunks."""

    def __init__(self):
        self.programs: Dict[bool, Program] = {}
        self.stages: Dict[bool, List[Stage]] = {}
        self.graph: Optional[ChunkedGraph] = None
        self.graph_key: Optional[Tensor] = None
        self.num_nodes = 0


class _Fill(torch.autograd.Function):
    """Runs the fill in ``forward`` and the drain in ``backward`` (design.md §6: Lightning zeroes
    gradients between ``training_step`` and ``backward``, so the drain must happen in backward)."""

    @staticmethod
    def forward(ctx, engine: "GNNPipeEngine", anchor: Tensor) -> Tensor:
        ctx.engine = engine
        with torch.enable_grad():
            out = engine._fill()
        ctx.state, engine._state = engine._state, {}  # each call drains its own chunks
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.engine._drain(grad, ctx.state)
        ctx.state = None
        return None, None


class _HaloJoin(torch.autograd.Function):
    """``[chunk rows | halo rows | dummy row]`` of one value, for a chunk's local graph.

    The halo rows are data (history or rows received from other ways); the backward hands the
    gradient of the fresh ones to their owners (:meth:`GNNPipeEngine._halo_backward`) and returns
    the chunk rows' gradient, plus what other ways sent for those rows.
    """

    @staticmethod
    def forward(ctx, rows: Tensor, halo: Tensor, engine: "GNNPipeEngine", name: str, ch: Chunk, dummy: int):
        ctx.engine, ctx.name, ctx.ch = engine, name, ch
        parts = [rows, halo.to(rows.dtype)]
        if dummy:
            parts.append(rows.new_zeros((dummy, *rows.shape[1:])))
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ch = ctx.ch
        g_rows = ctx.engine._halo_backward(ctx.name, ch, grad[:ch.rows], grad[ch.rows:ch.rows + ch.halo.numel()])
        return g_rows, None, None, None, None, None


class GNNPipeEngine:
    """Pipelined execution of one PyG model on this rank's stage.

    Args:
        module: the user's model (its ``forward`` is replaced while the engine is installed).
        config: schedule options.
        comm: this rank's :class:`~pyg_pipe.engine.comm.Comm`.
        num_stages: pipeline depth S (``None``: the world size divided by ``ways``).
        stage: this rank's stage index (``None``: from the rank, ``rank // W``).
        ranks: global rank of every stage along this rank's way (default: the grid's).
        ways: graph-parallel ways W per stage (``None`` with ``num_stages=None``: chosen when the
            model is first traced, the fewest ways ``>= 2`` that leave every stage a layer).
    """

    def __init__(self, module: torch.nn.Module, config: PipelineConfig, comm: Comm, num_stages: Optional[int] = None,
                 stage: Optional[int] = None, ranks: Optional[Sequence[int]] = None, ways: Optional[int] = 1):
        config.validate()
        self.module = module
        self.config = config
        self.comm = comm
        self._request = (num_stages, stage, ranks, ways)
        self.num_stages = num_stages
        self.stage_index = stage
        self.ways, self.way = ways, 0
        self.ranks = list(ranks) if ranks is not None else None
        self.stage_group = None
        if num_stages is not None and ways is not None:
            self._set_grid(num_stages, ways)
        self.step = 0
        self.layers_per_stage: Optional[List[int]] = None
        self.plan: Optional[_Plan] = None
        self.buffers: Dict[str, Tensor] = {}
        self.snapshot: Dict[str, Tensor] = {}
        self.owners: Dict[str, int] = {}
        self._pending_history: Optional[dict] = None
        self._hooks: list = []
        self._trim: Dict[int, bool] = {}
        self._full_cache: Dict = {}
        self._instance_forward = None
        self._forward_fn = forward_function(module)
        self._inside = False
        self._state: dict = {}
        self._row_local: Dict[Tuple[bool, str], Dict[str, bool]] = {}
        self._pruned = False
        self._grads: Dict[str, Tensor] = {}
        self._pos: Optional[Tensor] = None
        self._pi: List[int] = [0]
        self._routes: Dict[int, tuple] = {}
        self._mirror: Dict[Tuple[int, int], Tensor] = {}
        self.out_spec = None
        self.specs: Dict[str, Tuple] = {}
        self.plan_seconds = 0.0  # tracing, splitting, partitioning, the history pass, first-call layer checks

    # ------------------------------------------------------------------ the rank grid
    def _set_grid(self, num_stages: int, ways: int) -> None:
        P = self.comm.world_size
        if ways > 1 and num_stages * ways != P:
            raise ValueError(f"stages={num_stages} x ways={ways} = {num_stages * ways} ranks, but {P} processes run; "
                             f"choose stages and ways whose product is the number of devices.")
        _, stage, ranks, _ = self._request
        self.num_stages, self.ways = num_stages, ways
        self.way = self.comm.rank % ways if ways > 1 else 0
        self.stage_index = stage if stage is not None else self.comm.rank // ways
        if ranks is None or ways > 1:
            ranks = [s * ways + self.way for s in range(num_stages)]
        self.ranks = list(ranks)
        self.stage_group = None
        if ways > 1:
            for s in range(num_stages):  # every rank creates every group, in the same order
                group = dist.new_group([s * ways + w for w in range(ways)])
                if s == self.stage_index:
                    self.stage_group = group

    def _resolve_grid(self, num_layers: int) -> None:
        if self.num_stages is not None and self.ways is not None:
            return
        P = self.comm.world_size
        S, W = self.num_stages, self.ways
        if S is None and W is None:
            W = next((w for w in range(2, P + 1) if P % w == 0 and P // w <= num_layers), 1)
        if S is None:
            if P % W:
                raise ValueError(f"ways={W} does not divide the {P} processes; choose a divisor of the device count.")
            S = P // W
        if W is None:
            if P % S:
                raise ValueError(f"stages={S} does not divide the {P} processes; choose a divisor of the device count.")
            W = P // S
        self._set_grid(S, W)

    def rank_of(self, stage: int, way: int = 0) -> int:
        """Global rank of ``(stage, way)``."""
        return self.ranks[stage] if self.ways == 1 else stage * self.ways + way

    @property
    def owner_ranks(self) -> List[int]:
        """The rank holding the authoritative copy of each stage's parameters (way 0)."""
        return [self.rank_of(s, 0) for s in range(self.num_stages)]

    @property
    def chunks_per_way(self) -> int:
        return self.plan.graph.num_chunks // self.ways

    # ------------------------------------------------------------------ install / call
    def install(self) -> None:
        """Routes ``module(...)`` through the engine and guards its layers against direct calls."""
        self._forward_fn = forward_function(self.module)
        self._instance_forward = self.module.__dict__.get("forward")
        self.module.forward = self.__call__
        for name, m in self.module.named_modules():
            if isinstance(m, MessagePassing):
                self._hooks.append(m.register_forward_pre_hook(self._guard(name)))

    def uninstall(self) -> None:
        self.module.__dict__.pop("forward", None)
        if self._instance_forward is not None:
            self.module.forward = self._instance_forward
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _guard(self, name: str):
        def hook(mod, args):
            if not self._inside:
                raise RuntimeError(
                    f"Layer '{name}' was called directly, outside the forward of the model pyg_pipe pipelines "
                    f"({type(self.module).__name__}). Call the whole model, e.g. `self.model(x, edge_index)`, "
                    f"so its layers run on their pipeline stages.")
        return hook

    def __call__(self, *args, **kwargs):
        bound = bind_inputs(self.module, args, kwargs, self._forward_fn)
        training = self.module.training and torch.is_grad_enabled()
        plan = self._get_plan(bound, training)
        self._state = {"bound": bound, "plan": plan}
        if not training:
            with torch.no_grad():
                if self._partitioned_inference:
                    return self._fill(training=False)
                out, _ = self._run_full(plan.programs[False], plan.stages[False], bound, record=False)
            return out
        for name in plan.programs[True].inputs:
            v = bound[name]
            if isinstance(v, Tensor) and v.requires_grad:
                raise ValueError(
                    f"Input '{name}' of the pipelined model requires grad; pyg_pipe does not back-propagate into "
                    f"the model's inputs. Move the layers that produce '{name}' into the model.")
        anchor = torch.zeros((), device=self.comm.device, requires_grad=True)
        return _Fill.apply(self, anchor)

    # ------------------------------------------------------------------ planning
    def _get_plan(self, bound: Dict[str, Any], training: bool) -> _Plan:
        """The plan for this graph and mode, made on first use (``plan_seconds`` adds up the time)."""
        t0 = time.perf_counter()
        try:
            return self._make_plan(bound, training)
        finally:
            self.plan_seconds += time.perf_counter() - t0

    def _make_plan(self, bound: Dict[str, Any], training: bool) -> _Plan:
        from ..model.program import is_graph_tensor
        graph = next((v for v in bound.values() if is_graph_tensor(v)), None)
        if graph is None:
            raise UnsupportedModelError(
                f"{type(self.module).__name__} was called without an edge_index (or sparse adj_t) argument; "
                f"pyg_pipe needs the graph to cut it into chunks.")
        if type(graph).__name__ == "SparseTensor":
            raise UnsupportedModelError(
                "torch_sparse.SparseTensor adjacencies are not supported by pyg_pipe yet; pass edge_index or a "
                "torch.sparse CSR/COO adj_t (torch_geometric.transforms.ToSparseTensor(layout=torch.sparse_csr)).")
        num_nodes = self._num_nodes(bound, graph)
        plan = self.plan
        if plan is None or not _same_graph(plan.graph_key, graph):
            plan = _Plan()
            plan.graph_key = graph
            plan.num_nodes = num_nodes
            self.plan = plan
            self.buffers, self.snapshot, self._full_cache = {}, {}, {}
        num_edges = graph.size(1) if graph.layout == torch.strided else graph._nnz()
        for mode in ([training] if training else [False]):
            if mode not in plan.programs:
                was = self.module.training
                self.module.train(mode)
                try:
                    prog = trace(self.module, bound, num_nodes, num_edges, self._forward_fn)
                finally:
                    self.module.train(was)
                groups = layer_groups(prog)
                if self.layers_per_stage is None:
                    self._resolve_grid(len(groups))
                    self.layers_per_stage = self._choose_split(prog, bound)
                if len(groups) != sum(self.layers_per_stage):
                    raise UnsupportedModelError(
                        f"{type(self.module).__name__} runs {len(groups)} message-passing layers in "
                        f"{'training' if mode else 'eval'} mode but {sum(self.layers_per_stage)} in the other mode; "
                        f"pyg_pipe needs the same layers in both.")
                plan.programs[mode] = prog
                plan.stages[mode] = split(prog, self.layers_per_stage)
                if mode:
                    self.owners = parameter_owner(self.module, plan.stages[True])
        if (training or self._partitioned_inference) and plan.graph is None:
            self._build_chunks(plan, bound, graph)
        return plan

    @property
    def _partitioned_inference(self) -> bool:
        """Graph parallelism infers partition-parallel (exact: one chunk per way, fresh halos);
        pipelines infer stage by stage over the whole graph."""
        return self.num_stages == 1 and (self.ways or 1) > 1

    def _num_nodes(self, bound, graph) -> int:
        if graph.layout != torch.strided:
            return graph.size(0)
        for name, v in bound.items():
            if isinstance(v, Tensor) and v.dim() > 0 and v.layout == torch.strided and v is not graph \
                    and name not in ("edge_weight", "edge_attr", "edge_type"):
                return v.size(0)
        return int(graph.max()) + 1 if graph.numel() else 0

    def _choose_split(self, prog: Program, bound) -> List[int]:
        groups = layer_groups(prog)
        S, L = self.num_stages, len(groups)
        if S > L:
            raise UnsupportedModelError(
                f"The model has {L} message-passing layers but the pipeline has {S} stages (devices); every stage "
                f"needs at least one layer. Use at most {L} devices, or a deeper model.")
        bal = self.config.balance
        if not isinstance(bal, str):
            sizes = [int(b) for b in bal]
            if len(sizes) != S or sum(sizes) != L or min(sizes) < 1:
                raise ValueError(f"balance={list(bal)} must give {S} positive layer counts summing to {L}.")
            return sizes
        if bal == "layers" or S == 1:
            return [L // S + (1 if s < L % S else 0) for s in range(S)]
        costs = torch.zeros(L, dtype=torch.float64)
        if self.comm.rank == self.rank_of(0):
            costs = torch.tensor(self._profile(prog, groups, bound), dtype=torch.float64)
        costs = self._broadcast(costs, self.rank_of(0))
        return balance(costs.tolist(), S)

    def _profile(self, prog: Program, groups, bound) -> List[float]:
        """Seconds each layer group takes in one no-grad full-graph forward (the balance cost model)."""
        env = self._inputs_env(prog, bound)
        costs = []
        self._inside = True
        try:
            with torch.no_grad():
                scratch: Dict = {}  # layer caches of this pass are dropped afterwards
                last = _last_uses(prog.steps)
                for grp in groups:
                    t0 = time.perf_counter()
                    for node in grp:
                        env[node.name] = self._eval_full(prog, node, env, scratch)
                        _release(env, last, node, keep=())
                    costs.append(time.perf_counter() - t0)
        finally:
            self._inside = False
        return costs

    def _broadcast(self, t: Tensor, src: int) -> Tensor:
        if self.comm.world_size > 1:
            t = t.to(self.comm.device)
            dist.broadcast(t, src, group=self.comm.group)
        return t.cpu()

    def _build_chunks(self, plan: _Plan, bound, graph: Tensor) -> None:
        from ..graph.partition import make_chunks, make_way_chunks
        N = plan.num_nodes
        W = self.ways
        if W > N:
            raise ValueError(f"{W} graph-parallel ways need at least {W} vertices, but the graph has {N}; use at most "
                             f"{N} ways (devices).")
        C = self.config.num_chunks
        if C is None:
            C = min(4 * self.num_stages, N) if W == 1 else W * (1 if self.num_stages == 1 else 4 * self.num_stages)
            C = min(C, N - N % W)
        if C > N:
            raise ValueError(f"num_chunks={C} is larger than the number of vertices ({N}); use at most {N} chunks.")
        if C % W:
            raise ValueError(f"num_chunks={C} must be a multiple of the {W} graph-parallel ways (each way owns the same "
                             f"number of chunks); use e.g. num_chunks={W * max(1, C // W)}.")
        if graph.layout == torch.strided:
            src, dst = graph[0], graph[1]
            weight = bound.get("edge_weight") if isinstance(bound.get("edge_weight"), Tensor) else None
            layout = None
        else:
            coo = graph.to_sparse_coo().coalesce() if graph.layout != torch.sparse_coo else graph.coalesce()
            dst, src = coo.indices()
            weight, layout = coo.values(), graph.layout
        root = self.rank_of(0)
        part = self.config.partition
        # a user's partitioner runs (and is checked) on every rank, so a bad one fails everywhere at once
        if self.comm.rank == root or callable(part):
            if callable(part):
                perm, ptr = part(torch.stack([src, dst]).cpu(), N, C)
                perm, ptr = torch.as_tensor(perm, dtype=torch.long), torch.as_tensor(ptr, dtype=torch.long)
                if ptr.numel() != C + 1 or not torch.equal(torch.sort(perm).values, torch.arange(N)) \
                        or int(ptr[0]) != 0 or int(ptr[-1]) != N:
                    raise ValueError(f"partition callable must return (perm, ptr): a permutation of {N} vertices "
                                     f"and {C + 1} chunk boundaries from 0 to {N}.")
                sizes = ptr[1:] - ptr[:-1]
                if bool((sizes <= 0).any()):
                    empty = torch.nonzero(sizes <= 0).view(-1).tolist()
                    raise ValueError(f"partition callable returned empty chunks {empty}: every chunk (and so every "
                                     f"partition of a graph-parallel way) needs at least one vertex.")
            elif W > 1:
                perm, ptr = make_way_chunks(torch.stack([src, dst]).cpu(), N, W, C // W, method=part,
                                            seed=self.config.seed)
            else:
                perm, ptr = make_chunks(torch.stack([src, dst]).cpu(), N, C, method=part, seed=self.config.seed)
        if self.comm.rank != root:
            perm, ptr = torch.empty(N, dtype=torch.long), torch.empty(C + 1, dtype=torch.long)
        perm = self._broadcast(perm, root)
        ptr = self._broadcast(ptr, root)
        dev = self.comm.device
        plan.graph = ChunkedGraph(src.to(dev), dst.to(dev), None if weight is None else weight.to(dev), N,
                                  perm.to(dev), ptr.to(dev), sparse_layout=layout)
        plan.sparse_coo = (src, dst, weight)
        if W > 1:
            self._build_mirrors(plan.graph)
        # exact layer-wise pass: fills the history buffers and tells every stage the message shapes
        # (graph parallelism keeps no history and exchanges no stage messages: nothing to fill)
        if self.num_stages > 1 or C > W:
            with torch.no_grad():
                self._run_full(plan.programs[True], plan.stages[True], bound, record=True)
        if self._pending_history is not None:
            self._load_history(self._pending_history)
            self._pending_history = None

    def _build_mirrors(self, g: ChunkedGraph) -> None:
        """``_mirror[(c, w')]``: the rows of chunk ``c`` that chunks of another way ``w'`` read (new ids)."""
        cpw = g.num_chunks // self.ways
        self._mirror = {}
        for w2 in range(self.ways):
            halos = [g.chunks[c].halo for c in range(w2 * cpw, (w2 + 1) * cpw)]
            need = torch.unique(torch.cat(halos)) if halos else g.ptr[:0]
            bounds = torch.searchsorted(need, g.ptr).tolist()
            for c in range(g.num_chunks):
                if c // cpw != w2:
                    self._mirror[(c, w2)] = need[bounds[c]:bounds[c + 1]]

    # ------------------------------------------------------------------ evaluation helpers
    def _inputs_env(self, prog: Program, bound) -> Dict[str, Any]:
        env = {}
        for node in prog.graph.nodes:
            if node.op == "placeholder":
                env[node.name] = bound.get(node.target.lstrip("*"))
        return env

    def _eval_full(self, prog: Program, node: fx.Node, env: Dict[str, Any], store: Dict) -> Any:
        """Evaluates a step on the whole graph; a cached layer uses ``store`` for its cache, never its own
        (its own cache belongs to the user's single-device use of the model)."""
        module = prog.module_of(node)
        if isinstance(module, MessagePassing):
            with _chunk_cache(module, store, -1):
                return self._eval(prog, node, env)
        return self._eval(prog, node, env)

    def _eval(self, prog: Program, node: fx.Node, env: Dict[str, Any], args=None, kwargs=None):
        if args is None:
            args = fx.node.map_arg(node.args, lambda n: env[n.name])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
        if node.op == "call_module":
            return prog.modules[node.target](*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "get_attr":
            obj = prog.root
            for part in node.target.split("."):
                obj = getattr(obj, part)
            return obj
        raise RuntimeError(f"unexpected fx node {node.op}")

    def _buffered(self, prog: Program, stage: Stage) -> List[str]:
        """Values this stage's layers read with halos, other than graph inputs: they get history buffers."""
        names = []
        for node in stage.mp_steps:
            for a in node.all_input_nodes:
                if prog.kinds[a.name] == NODE and a.op != "placeholder" and a.name not in names:
                    names.append(a.name)
        return names

    # ------------------------------------------------------------------ exact full-graph pass
    def _run_full(self, prog: Program, stages: List[Stage], bound, record: bool):
        """Exact layer-wise pass: stage after stage, each over the whole graph.

        With ``record`` (training program) it fills the history buffers and records every message's
        shape. Messages carry a small header, and none of it is counted as training traffic.
        """
        stage = stages[self.stage_index]
        env = self._inputs_env(prog, bound)
        prev = self.ranks[self.stage_index - 1] if self.stage_index > 0 else None
        nxt = self.ranks[self.stage_index + 1] if self.stage_index + 1 < self.num_stages else None
        last = self.ranks[-1]
        specs = {}
        for name in stage.inputs:
            env[name] = self.comm.recv_with_header(prev)
            specs[name] = (tuple(env[name].shape[1:]), env[name].dtype)
        self._inside = True
        # the init pass keeps no layer caches; inference keeps them in the engine's full-graph store
        store = {} if record else self._full_cache
        # values are dropped after their last use in this stage, except what is sent on or buffered
        keep = set(stage.outputs) | (set(self._buffered(prog, stage)) if record else set())
        last_use = _last_uses(stage.steps)
        try:
            for node in stage.steps:
                env[node.name] = self._eval_full(prog, node, env, store)
                _release(env, last_use, node, keep)
        finally:
            self._inside = False
        if nxt is not None:
            for name in stage.outputs:
                self.comm.send_with_header(env[name], nxt)
                specs[name] = (tuple(env[name].shape[1:]), env[name].dtype)
        if record:
            g = self.plan.graph
            self.specs = specs
            self.buffers = {} if g.num_chunks == self.ways else {
                v: env[v].detach()[g.perm].clone() for v in self._buffered(prog, stage)}
            self.snapshot = {}
        if self.comm.rank == last:
            out = env[stage.outputs[0]]
            for r in self.ranks:
                if r != last:
                    self.comm.send_with_header(out, r)
        else:
            out = self.comm.recv_with_header(last)
        if record:
            self.out_spec = (tuple(out.shape[1:]), out.dtype)
        self.comm.flush()
        return out, env

    # ------------------------------------------------------------------ chunked training step
    def chunk_order(self, step: int) -> List[int]:
        """This way's chunks in the order of step ``step`` (see :meth:`local_order`)."""
        cpw = self.chunks_per_way
        return [self.way * cpw + i for i in self.local_order(step)]

    def local_order(self, step: int) -> List[int]:
        """The permutation ``π`` of chunk positions within a way used at ``step``, the same on all ranks."""
        cpw = self.chunks_per_way
        if not self.config.shuffle_chunks:
            return list(range(cpw))
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step)
        return torch.randperm(cpw, generator=gen).tolist()

    def _begin_history(self, step: int) -> None:
        R = self.config.snapshot_period
        if R is None or not self.buffers or self.plan.graph.num_chunks == self.ways:
            return
        if step % R == 0 or not self.snapshot:
            self.snapshot = {k: v.clone() for k, v in self.buffers.items()}
        else:
            for k, v in self.buffers.items():
                v.copy_(self.snapshot[k])

    def _fill(self, training: bool = True) -> Tensor:
        """The forward of one step (training) or an exact partition-parallel inference pass."""
        plan: _Plan = self._state["plan"]
        bound = self._state["bound"]
        prog, stage, g = plan.programs[training], plan.stages[training][self.stage_index], plan.graph
        step = self.step
        pi = self.local_order(step) if training else list(range(self.chunks_per_way))
        cpw = self.chunks_per_way
        order = [self.way * cpw + i for i in pi]
        self._set_order(pi)
        if training:
            self._begin_history(step)
        perm = g.perm
        node_in, edge_in = {}, {}
        for node in prog.graph.nodes:
            if node.op != "placeholder":
                continue
            v = bound.get(node.target.lstrip("*"))
            if prog.kinds[node.name] == NODE:
                node_in[node.name] = v[perm]
            elif prog.kinds[node.name] == EDGE:
                edge_in[node.name] = v
        prev = self.ranks[self.stage_index - 1] if self.stage_index > 0 else None
        nxt = self.ranks[self.stage_index + 1] if self.stage_index + 1 < self.num_stages else None
        is_last = nxt is None
        out_new = None
        buffered = set(self.buffers) if training else set()
        nxt_act = self._next_activation(plan)
        out_category = {n: "stage_activations" if n == nxt_act else "carried" for n in stage.outputs}
        records: Dict[int, _ChunkRecord] = {}
        ctx = dict(prog=prog, stage=stage, g=g, node_in=node_in, edge_in=edge_in, bound=bound, buffered=buffered,
                   mode=training, pi=pi)
        self.comm.counting = training
        for k, c in enumerate(order):
            ch = g.chunks[c]
            ctx["k"] = k
            rec = _ChunkRecord()
            env = {}
            for node in prog.graph.nodes:
                if node.op != "placeholder":
                    continue
                kind = prog.kinds[node.name]
                if kind == NODE:
                    env[node.name] = node_in[node.name][ch.start:ch.end]
                elif kind == EDGE:
                    env[node.name] = edge_in[node.name][ch.edge_ids]
                else:
                    env[node.name] = bound.get(node.target.lstrip("*"))
            for name in stage.inputs:
                shape, dtype = self.specs[name]
                t = self.comm.recv((ch.rows, *shape), dtype, prev)
                if t.is_floating_point() and training:
                    t.requires_grad_()
                rec.in_leaves[name] = t
                env[name] = t
                if name in buffered:
                    self.buffers[name][ch.start:ch.end] = t.detach()
            self._inside = True
            try:
                for node in stage.steps:
                    if prog.is_mp(node):
                        out = self._call_mp(node, env, ch, rec, ctx)
                    else:
                        out = self._eval(prog, node, env)
                    env[node.name] = out
                    if node.name in buffered:
                        self.buffers[node.name][ch.start:ch.end] = out.detach()
                        rec.produced[node.name] = out
            finally:
                self._inside = False
            for name in stage.outputs:
                rec.out_roots[name] = env[name]
            if is_last:
                res = env[stage.outputs[0]].detach()
                if out_new is None:
                    self.out_spec = (tuple(res.shape[1:]), res.dtype)
                    out_new = torch.empty((plan.num_nodes, *res.shape[1:]), dtype=res.dtype, device=self.comm.device)
                out_new[ch.start:ch.end] = res
            else:
                for name in stage.outputs:
                    self.comm.send(env[name], nxt, out_category[name])
            rec.local = {}
            if training:
                records[c] = rec
        out_new = self._exchange_output(plan, out_new, is_last)
        self.comm.flush()
        self.comm.counting = False
        if training:
            self._prune_buffers()
            self._state.update(records=records, order=order, pi=pi)
        return out_new[g.inv]

    def _exchange_output(self, plan: _Plan, out_new: Optional[Tensor], is_last: bool) -> Tensor:
        """Every rank gets the whole output: each last-stage way sends its rows to every other rank."""
        g, cpw, S = plan.graph, self.chunks_per_way, self.num_stages
        span = [(int(g.ptr[w * cpw]), int(g.ptr[(w + 1) * cpw])) for w in range(self.ways)]
        if is_last:
            a, b = span[self.way]
            for r in range(self.comm.world_size):
                if r != self.comm.rank:
                    self.comm.send(out_new[a:b], r, "output")
        else:
            shape, dtype = self.out_spec
            out_new = torch.empty((plan.num_nodes, *shape), dtype=dtype, device=self.comm.device)
        shape, dtype = tuple(out_new.shape[1:]), out_new.dtype
        for w in range(self.ways):
            src = self.rank_of(S - 1, w)
            if src != self.comm.rank:
                a, b = span[w]
                out_new[a:b] = self.comm.recv((b - a, *shape), dtype, src)
        return out_new

    def _prune_buffers(self) -> None:
        """After the first step, drop history buffers of values every layer reads row by row only."""
        if self._pruned:
            return
        self._pruned = True
        needed = {name for (mode, _), votes in self._row_local.items() if mode
                  for name, row_local in votes.items() if not row_local}
        for name in list(self.buffers):
            if name not in needed:
                del self.buffers[name]
                self.snapshot.pop(name, None)

    def _next_activation(self, plan: _Plan) -> Optional[str]:
        stages = plan.stages[True]
        return stages[self.stage_index + 1].activation if self.stage_index + 1 < len(stages) else None

    def _call_mp(self, node: fx.Node, env, ch: Chunk, rec: _ChunkRecord, ctx) -> Tensor:
        """Runs one message-passing layer for chunk ``ch`` on its local graph; returns the chunk's rows."""
        prog: Program = ctx["prog"]
        module = prog.modules[node.target]
        sig = _forward_signature(module)
        try:
            ba = sig.bind(*node.args, **node.kwargs)
        except TypeError:
            ba = None
        g: ChunkedGraph = ctx["g"]
        takes_weight = "edge_weight" in sig.parameters
        weight_arg = ba.arguments.get("edge_weight") if ba is not None else None
        complete = takes_weight and (weight_arg is None or (isinstance(weight_arg, fx.Node)
                                                            and weight_arg.op == "placeholder"))
        complete = complete or g.sparse_layout is not None
        if g.sparse_layout is not None:
            user_weight = self.plan.sparse_coo[2]  # the adjacency's values, in the chunked edge order
        elif isinstance(weight_arg, fx.Node):
            user_weight = ctx["bound"].get(weight_arg.target.lstrip("*"))
        else:
            user_weight = None
        dtype = _float_dtype(env, node, prog)
        graph, local_w = g.local_graph(ch, complete, user_weight, dtype)
        n_dummy = g.dummy_edges(ch, complete)

        def call_args(node_value):
            def local(n: fx.Node):
                kind = prog.kinds[n.name]
                if kind == GRAPH:
                    return graph
                if kind == NODE:
                    return node_value(n)
                if kind == EDGE:
                    v = env[n.name]
                    if n_dummy:
                        v = torch.cat([v, v.new_zeros((n_dummy, *v.shape[1:]))])
                    return v
                return env[n.name]

            args = fx.node.map_arg(node.args, local)
            kwargs = dict(fx.node.map_arg(node.kwargs, local))
            if complete and g.sparse_layout is None:
                if ba is not None and "edge_weight" in ba.arguments \
                        and len(node.args) > list(sig.parameters).index("edge_weight"):
                    args = list(args)
                    args[list(sig.parameters).index("edge_weight")] = local_w
                else:
                    kwargs["edge_weight"] = local_w
            return args, kwargs

        key = (ctx["mode"], node.name)
        if key not in self._row_local:
            t0 = time.perf_counter()  # one-time checks count as planning
            self._row_local[key] = self._probe_row_local(node, module, call_args, env, ch, prog)
            self.plan_seconds += time.perf_counter() - t0
        row_local = self._row_local[key]
        args, kwargs = call_args(lambda n: self._local_rows(n, env, ch, rec, ctx, row_local.get(n.name, False)))
        out = self._run_layer(node, module, args, kwargs, ch, ctx["g"])
        if not isinstance(out, Tensor):
            raise UnsupportedModelError(
                f"Layer '{node.target}' returned {type(out).__name__}; pyg_pipe needs each MessagePassing layer to "
                f"return one node tensor (e.g. do not request attention weights during training).")
        return out[:ch.rows]

    def _run_layer(self, node: fx.Node, module: MessagePassing, args, kwargs, ch: Chunk, g: ChunkedGraph):
        """Calls one layer on a chunk's local graph, with its aggregation *trimmed* to the chunk's rows.

        Only the first ``ch.rows`` local vertices (the chunk) need outputs, so a propagate hook
        narrows the aggregated messages to those rows: everything the layer does after aggregating
        (GCNII's residual and matmul, biases, head concatenation) then skips the halo rows. Layers
        that combine the aggregate with full-size tensors (a root weight on ``x``) cannot be trimmed;
        the first chunk call of every layer compares trimmed and untrimmed outputs (in eval mode,
        no grad) and keeps trimming only where they agree. Layers that propagate more than once per
        call (K-hop layers such as APPNP) would need K-hop halos, and are refused with several chunks.
        """
        rows, n_local = ch.rows, ch.num_local
        state = {"trim": False, "calls": 0}

        def pre(mod, inputs):
            state["calls"] += 1

        def post(mod, inputs, out):
            dim = mod.node_dim if mod.node_dim >= 0 else out.dim() + mod.node_dim
            if state["trim"] and isinstance(out, Tensor) and out.size(dim) == n_local:
                return out.narrow(dim, 0, rows)
            return None

        handles = [module.register_propagate_forward_pre_hook(pre), module.register_propagate_forward_hook(post)]
        try:
            mode = self._trim.get(id(module)) if rows < n_local else False
            with _chunk_cache(module, g.layer_cache, ch.index, rows if mode else None):
                if mode is None:
                    t0 = time.perf_counter()
                    mode = self._check_trim(module, args, kwargs, rows, state)
                    self.plan_seconds += time.perf_counter() - t0
                    self._trim[id(module)] = mode
                state["trim"], state["calls"] = mode, 0
                out = module(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
        if state["calls"] > 1 and g.num_chunks > 1:
            raise UnsupportedModelError(
                f"Layer '{node.target}' ({type(module).__name__}) propagates {state['calls']} times per call, so "
                f"its output depends on {state['calls']}-hop neighbourhoods; pyg_pipe's chunks carry 1-hop halos. "
                f"Use num_chunks=1, or stack single-hop layers instead.")
        return out

    @staticmethod
    def _check_trim(module, args, kwargs, rows: int, state) -> bool:
        was = module.training
        module.eval()
        try:
            with torch.no_grad():
                state["trim"] = False
                full = module(*args, **kwargs)
                state["trim"] = True
                try:
                    trimmed = module(*args, **kwargs)
                except Exception:  # noqa: BLE001 - shapes do not line up: the layer cannot be trimmed
                    return False
        finally:
            module.train(was)
            state["trim"] = False
        return (isinstance(full, Tensor) and isinstance(trimmed, Tensor) and trimmed.size(0) >= rows
                and full.shape[1:] == trimmed.shape[1:]
                and torch.allclose(full[:rows], trimmed[:rows], atol=1e-5, rtol=1e-4))

    def _probe_row_local(self, node: fx.Node, module: MessagePassing, call_args, env, ch: Chunk,
                         prog: Program) -> Dict[str, bool]:
        """Which node inputs of a layer it reads only row by row (their halo rows cannot change the
        chunk's rows, like GCNII's ``x0``). Probed once per layer: random halo rows for each input
        in turn, in eval mode; the ways of a stage agree (all must find an input row-local)."""
        names = list(dict.fromkeys(a.name for a in node.all_input_nodes if prog.kinds[a.name] == NODE))
        extra = ch.halo.numel() + int(ch.has_dummy)
        votes = {n: True for n in names}
        if ch.halo.numel():
            gen = torch.Generator().manual_seed(12345)

            def noise(n: str) -> Tensor:
                v = env[n]
                return torch.randn((extra, *v.shape[1:]), generator=gen).to(v.device, v.dtype)

            base = {n: noise(n) for n in names if env[n].is_floating_point()}
            for n in names:
                if n not in base:
                    votes[n] = False  # integer node data: always give it its halo

            def run(fill):
                args, kwargs = call_args(lambda a: torch.cat([env[a.name].detach(), fill[a.name]])
                                         if a.name in fill else self._local_rows(a, env, ch, None, None, False))
                with _chunk_cache(module, {}, -2):
                    return module(*args, **kwargs)

            was = module.training
            module.eval()
            try:
                with torch.no_grad():
                    try:
                        ref = run(base)
                        for n in base:
                            out = run({**base, n: noise(n)})
                            votes[n] = bool(torch.allclose(ref[:ch.rows], out[:ch.rows], atol=1e-6, rtol=1e-5))
                    except Exception:  # noqa: BLE001 - cannot probe: every input gets its halo
                        votes = {n: False for n in names}
            finally:
                module.train(was)
        if self.ways > 1 and names:
            t = torch.tensor([float(votes[n]) for n in names], device=self.comm.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.stage_group)
            votes = {n: bool(v > 0.5) for n, v in zip(names, t.tolist())}
        return votes

    def _local_rows(self, n: fx.Node, env, ch: Chunk, rec: Optional[_ChunkRecord], ctx, row_local: bool) -> Tensor:
        """``[chunk rows | halo rows | dummy row]`` of a node value for the chunk's local graph.

        Halo rows of graph inputs are read from the input itself, of computed values from other
        ways (:meth:`_exchange`) and from history; row-local inputs get zero rows instead.
        """
        name = n.name
        rows = env[name]
        extra = ch.halo.numel() + int(ch.has_dummy)
        if row_local or (rec is None and n.op != "placeholder"):
            return torch.cat([rows, rows.new_zeros((extra, *rows.shape[1:]))]) if extra else rows
        hit = rec.local.get(name) if rec is not None else None
        if hit is not None and hit[0] is rows:
            return hit[1]
        if n.op == "placeholder":
            parts = [rows]
            if ch.halo.numel():
                parts.append(ctx["node_in"][name][ch.halo] if ctx is not None else
                             rows.new_zeros((ch.halo.numel(), *rows.shape[1:])))
            if ch.has_dummy:
                parts.append(rows.new_zeros((1, *rows.shape[1:])))
            out = torch.cat(parts) if len(parts) > 1 else rows
        else:
            halo = self._gather_halo(name, rows, ch, ctx)
            if rows.requires_grad and torch.is_grad_enabled():
                out = _HaloJoin.apply(rows, halo, self, name, ch, int(ch.has_dummy))
            else:
                parts = [rows, halo] + ([rows.new_zeros((1, *rows.shape[1:]))] if ch.has_dummy else [])
                out = torch.cat(parts)
        if rec is not None:
            rec.local[name] = (rows, out)
        return out

    def _gather_halo(self, name: str, rows: Tensor, ch: Chunk, ctx) -> Tensor:
        received = self._exchange(name, rows, ch, ctx) if self.ways > 1 else []
        buf = self.buffers.get(name)
        if buf is not None:
            for ids, r in received:
                buf[ids] = r
            return buf[ch.halo]
        halo = rows.detach().new_zeros((ch.halo.numel(), *rows.shape[1:]))
        filled = 0
        for ids, r in received:
            halo[torch.searchsorted(ch.halo, ids)] = r
            filled += ids.numel()
        if filled != ch.halo.numel():
            raise RuntimeError(f"pyg_pipe: no history buffer for '{name}' and {ch.halo.numel() - filled} halo rows "
                               f"of chunk {ch.index} have no source")
        return halo

    def _exchange(self, name: str, rows: Tensor, ch: Chunk, ctx) -> List[Tuple[Tensor, Tensor]]:
        """Mirror exchange among the ways of this stage at the current clock: sends this chunk's rows
        that other ways read, returns ``(new ids, rows)`` received from the other ways' chunks."""
        cpw, k = self.chunks_per_way, ctx["k"]
        for w in range(self.ways):
            if w != self.way:
                ids = self._mirror[(ch.index, w)]
                if ids.numel():
                    self.comm.send(rows[ids - ch.start], self.rank_of(self.stage_index, w), "halo_forward")
        received = []
        for w in range(self.ways):
            if w != self.way:
                ids = self._mirror[(w * cpw + ctx["pi"][k], self.way)]
                if ids.numel():
                    r = self.comm.recv((ids.numel(), *rows.shape[1:]), rows.dtype, self.rank_of(self.stage_index, w))
                    received.append((ids, r))
        return received

    def _set_order(self, pi: List[int]) -> None:
        """Chunk positions of this step (``pos[c]`` = clock at which chunk ``c`` runs, on every way)."""
        cpw = self.chunks_per_way
        pos = torch.empty(self.plan.graph.num_chunks, dtype=torch.long, device=self.comm.device)
        for w in range(self.ways):
            pos[torch.tensor([w * cpw + i for i in pi], device=pos.device)] = torch.arange(cpw, device=pos.device)
        self._pos, self._pi = pos, pi
        self._routes: Dict[int, tuple] = {}

    def _route(self, ch: Chunk) -> tuple:
        """Where the gradients of ``ch``'s halo rows go and which rows other ways send back, for this
        step's order: the same for every layer of the chunk, so computed once per chunk and step."""
        hit = self._routes.get(ch.index)
        if hit is not None:
            return hit
        g, cpw, pos = self.plan.graph, self.chunks_per_way, self._pos
        k = int(pos[ch.index])
        own, send, recv = None, [], []
        if ch.halo.numel():
            owner = ch.halo_chunk
            fresh = pos[owner] <= k
            owner_way = owner // cpw
            own = fresh & (owner_way == self.way)
            own = own if bool(own.any()) else None
            for w in range(self.ways):
                if w != self.way:
                    sel = fresh & (owner_way == w)
                    if bool(sel.any()):
                        send.append((w, sel))
        for w in range(self.ways):
            if w == self.way:
                continue
            other = g.chunks[w * cpw + self._pi[k]]
            if not other.halo.numel():
                continue
            ids = other.halo[(other.halo_chunk // cpw == self.way) & (pos[other.halo_chunk] <= k)]
            if ids.numel():
                cur = (ids >= ch.start) & (ids < ch.end)
                recv.append((w, ids, cur, bool(cur.all())))
        self._routes[ch.index] = hit = (own, send, recv)
        return hit

    def _halo_backward(self, name: str, ch: Chunk, g_rows: Tensor, g_halo: Tensor) -> Tensor:
        """Routes the gradient of a chunk's halo rows to their owners; returns the chunk rows' gradient.

        A halo row is *fresh* when its owner chunk ran at this clock or earlier (``pos <= k``); its
        gradient (times the T3 scale) goes to ``G_v`` for the way's own chunks and to the owning way
        otherwise. Stale rows' gradients are dropped. Then the gradients other ways send for this
        way's rows are received: rows of the current chunk join ``g_rows``, earlier chunks' ``G_v``.
        """
        own, send, recv = self._route(ch)
        g_rows = g_rows.clone()
        if own is not None:
            self._grad_buffer(name, g_halo).index_add_(0, ch.halo[own], g_halo[own] * self._scale)
        for w, sel in send:
            self.comm.send(g_halo[sel] * self._scale, self.rank_of(self.stage_index, w), "halo_backward")
        for w, ids, cur, all_cur in recv:
            r = self.comm.recv((ids.numel(), *g_halo.shape[1:]), g_halo.dtype, self.rank_of(self.stage_index, w))
            g_rows.index_add_(0, ids[cur] - ch.start, r[cur])
            if not all_cur:
                self._grad_buffer(name, g_halo).index_add_(0, ids[~cur], r[~cur])
        return g_rows

    def _grad_buffer(self, name: str, like: Tensor) -> Tensor:
        if name not in self._grads:
            self._grads[name] = like.new_zeros((self.plan.num_nodes, *like.shape[1:]))
        return self._grads[name]

    def _drain(self, grad_out: Tensor, state: dict) -> None:
        plan: _Plan = state["plan"]
        records: Dict[int, _ChunkRecord] = state["records"]
        order: List[int] = state["order"]
        stage = plan.stages[True][self.stage_index]
        g = plan.graph
        prev = self.ranks[self.stage_index - 1] if self.stage_index > 0 else None
        nxt = self.ranks[self.stage_index + 1] if self.stage_index + 1 < self.num_stages else None
        cpw = self.chunks_per_way
        self._set_order(state["pi"])
        self._scale = 2.0 if (self.config.unbiased_gradients and cpw > 1) else 1.0
        grads: Dict[str, Tensor] = {}
        self._grads = grads
        grad_new = grad_out[g.perm] if nxt is None else None
        self.comm.counting = True
        for c in reversed(order):
            ch = g.chunks[c]
            rec = records.pop(c)
            pairs: Dict[int, List] = {}

            def add(t: Tensor, gr: Tensor):
                if not t.requires_grad:
                    return
                if id(t) in pairs:
                    pairs[id(t)][1] = pairs[id(t)][1] + gr
                else:
                    pairs[id(t)] = [t, gr]

            if nxt is None:
                add(rec.out_roots[stage.outputs[0]], grad_new[ch.start:ch.end])
            else:
                for name in stage.outputs:
                    shape, dtype = self.specs[name]
                    if dtype.is_floating_point:
                        add(rec.out_roots[name], self.comm.recv((ch.rows, *shape), dtype, nxt))
            for name, t in rec.produced.items():
                if name in grads:
                    add(t, grads[name][ch.start:ch.end])
            if pairs:
                roots, gs = zip(*pairs.values())
                torch.autograd.backward(list(roots), list(gs))
            if prev is not None:
                for name in stage.inputs:
                    leaf = rec.in_leaves[name]
                    if not leaf.is_floating_point():
                        continue
                    gr = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                    if name in grads:
                        gr = gr + grads[name][ch.start:ch.end]
                    cat = "stage_gradients" if name == stage.activation else "carried"
                    self.comm.send(gr, prev, cat)
        self.comm.flush()
        if self.ways > 1:
            self._allreduce_weight_grads()
        self.comm.counting = False
        self._grads = {}
        self.step += 1

    def _allreduce_weight_grads(self) -> None:
        """Sums this stage's weight gradients over its ways (each way saw only its own vertices)."""
        params = [p for n, p in self.module.named_parameters()
                  if self.owners.get(n, 0) == self.stage_index and p.grad is not None]
        if not params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.comm.all_reduce(flat, self.stage_group, self.ways, first=self.way == 0)
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
            off += p.numel()

    # ------------------------------------------------------------------ history state (checkpoints)
    def history_state(self) -> dict:
        """This stage's history buffers, snapshot and chunk permutation, for checkpoints."""
        if self.plan is None or self.plan.graph is None:
            return {}
        return {"buffers": {k: v.cpu() for k, v in self.buffers.items()},
                "snapshot": {k: v.cpu() for k, v in self.snapshot.items()},
                "perm": self.plan.graph.perm.cpu(), "ptr": self.plan.graph.ptr.cpu()}

    def set_history_state(self, state: dict) -> None:
        """Restores :meth:`history_state` at the next plan (or now, if the graph is already chunked)."""
        if not state:
            return
        if self.plan is not None and self.plan.graph is not None:
            self._load_history(state)
        else:
            self._pending_history = state

    def _load_history(self, state: dict) -> None:
        g = self.plan.graph
        if not torch.equal(state["perm"].to(g.perm.device), g.perm) or not set(state["buffers"]) <= set(self.buffers):
            raise ValueError("The checkpoint's pipeline history was saved for a different graph, chunking or model "
                             "split; resume with the same graph, num_chunks, partition, seed and devices.")
        dev = self.comm.device
        for k in set(self.buffers) - set(state["buffers"]):  # pruned before saving: read row by row only
            del self.buffers[k]
        self._pruned = bool(state["buffers"]) or self._pruned
        for k, v in state["buffers"].items():
            self.buffers[k].copy_(v.to(dev))
        self.snapshot = {k: v.to(dev).clone() for k, v in state["snapshot"].items()}


def _last_uses(steps: Sequence[fx.Node]) -> Dict[str, List[str]]:
    """For every step, the values whose last use (within ``steps``) it is."""
    last: Dict[str, str] = {}
    for node in steps:
        for a in node.all_input_nodes:
            last[a.name] = node.name
    out: Dict[str, List[str]] = {}
    for value, user in last.items():
        out.setdefault(user, []).append(value)
    return out


def _release(env: Dict[str, Any], last: Dict[str, List[str]], node: fx.Node, keep) -> None:
    """Drops from ``env`` the computed values ``node`` was the last user of (graph inputs stay)."""
    for value in last.get(node.name, ()):
        if value not in keep and value in env and not isinstance(env[value], (str, int, float)):
            env.pop(value)


def _same_graph(a: Optional[Tensor], b: Tensor) -> bool:
    if a is None:
        return False
    if a is b:
        return True
    if a.layout != b.layout or a.shape != b.shape or a.device != b.device:
        return False
    if a.layout == torch.strided:
        return torch.equal(a, b)
    if a.layout == torch.sparse_csr:
        return torch.equal(a.crow_indices(), b.crow_indices()) and torch.equal(a.col_indices(), b.col_indices())
    return torch.equal(a.coalesce().indices(), b.coalesce().indices())


_SIGNATURES: Dict[type, inspect.Signature] = {}


def _forward_signature(module: torch.nn.Module) -> inspect.Signature:
    cls = type(module)
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(module.forward)
    return _SIGNATURES[cls]


def _float_dtype(env, node: fx.Node, prog: Program) -> torch.dtype:
    for a in node.all_input_nodes:
        v = env.get(a.name)
        if isinstance(v, Tensor) and v.is_floating_point() and prog.kinds[a.name] == NODE:
            return v.dtype
    return torch.get_default_dtype()


def _keep_rows(cached: Any, rows: Optional[int]) -> Any:
    """A cached normalised adjacency cut down to the chunk's destination rows.

    The halo rows and the degree-completing edges are needed to *compute* the normalisation; once it
    is cached only the edges into the chunk's rows matter. Used for layers whose aggregation was
    verified to work on the chunk rows alone (trimmed), so later calls skip halo and dummy work.
    """
    if rows is None or cached is None:
        return cached
    if isinstance(cached, Tensor) and cached.layout == torch.sparse_csr and cached.size(0) > rows:
        crow = cached.crow_indices()[:rows + 1]
        nnz = int(crow[-1])
        return torch.sparse_csr_tensor(crow, cached.col_indices()[:nnz], cached.values()[:nnz],
                                       size=(rows, cached.size(1)))
    if isinstance(cached, Tensor) and cached.layout == torch.sparse_coo and cached.size(0) > rows:
        c = cached.coalesce()
        keep = c.indices()[0] < rows
        return torch.sparse_coo_tensor(c.indices()[:, keep], c.values()[keep], (rows, c.size(1))).coalesce()
    if isinstance(cached, tuple) and len(cached) == 2 and isinstance(cached[0], Tensor) \
            and cached[0].layout == torch.strided and cached[0].dim() == 2:
        edge_index, weight = cached
        keep = edge_index[1] < rows
        return edge_index[:, keep], (weight[keep] if isinstance(weight, Tensor) else weight)
    return cached


class _chunk_cache:
    """Gives a ``cached=True`` layer one cache per chunk while it runs on that chunk.

    design.md §7: a cached layer (GCNConv, GCN2Conv, ...) would otherwise reuse the first chunk's
    normalisation for every later chunk. The layer's ``_cached*`` attributes are swapped with the
    chunk's own entry in ``store`` around the call and the layer's own cache is put back after, so
    caching stays as fast as on one device and stays correct.
    """

    def __init__(self, module, store: Dict[Tuple[int, int], Dict[str, Any]], chunk: int, rows: Optional[int] = None):
        self.module = module
        self.enabled = bool(getattr(module, "cached", False))
        self.key = (id(module), chunk)
        self.store = store
        self.rows = rows
        self.saved: Dict[str, Any] = {}

    def __enter__(self):
        if self.enabled:
            names = [k for k in vars(self.module) if k.startswith("_cached")]
            mine = self.store.get(self.key, {})
            for k in names:
                self.saved[k] = getattr(self.module, k)
                setattr(self.module, k, mine.get(k))

    def __exit__(self, *exc):
        if self.enabled:
            self.store[self.key] = {k: _keep_rows(getattr(self.module, k), self.rows) for k in self.saved}
            for k, v in self.saved.items():
                setattr(self.module, k, v)


def sync_module_state(module: torch.nn.Module, owners: Dict[str, int], ranks: Sequence[int], group=None) -> None:
    """Copies every parameter and buffer from the rank of the stage that owns it to all ranks.

    Used before checkpoints and at the end of ``fit`` so that every rank (and so the user's model in
    the main process, whichever launcher ran) holds the whole trained model.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    tensors = dict(module.named_parameters())
    tensors.update(dict(module.named_buffers()))
    by_stage: Dict[int, List[Tensor]] = {}
    for name, t in tensors.items():
        by_stage.setdefault(owners.get(name, 0), []).append(t)
    with torch.no_grad():
        for s, ts in sorted(by_stage.items()):
            for dtype in sorted({t.dtype for t in ts}, key=str):
                same = [t for t in ts if t.dtype == dtype]
                flat = torch.cat([t.detach().reshape(-1) for t in same])
                dist.broadcast(flat, ranks[s], group=group)
                off = 0
                for t in same:
                    t.copy_(flat[off:off + t.numel()].view_as(t))
                    off += t.numel()
