"""NGra chunk streaming on one device: exact training of a graph whose activations do not fit it.

The model is cut into its layer groups (:func:`pyg_pipe.model.split.layer_groups`, one per
``MessagePassing`` unit), and the graph into chunks. Every value crossing a group boundary (the
hidden state, GCNII's ``x0``, ...) lives in a :class:`Store` with one row per vertex, in the memory
tier the knobs choose (:mod:`..runtime.tiers`: the device within ``offload_budget``, then host memory or
memory-mapped files); the device holds one chunk of one group at a time. Group by group, all chunks
run before the next group starts, so every neighbour row a chunk reads is this step's (NGra's
dataflow: vertex data streamed in chunks, never a stale read)::

    forward                                        backward (from the gradient of the output rows)
    for g in groups:                               for g in reversed(groups):
        for c in chunks:                               for c in chunks:
            rows + halo of g's inputs  <- store            replay g on c (same random numbers)
            run g on c                                     backward from the gradients of its outputs
            c's rows of g's outputs    -> store            input gradients (rows + halo) -> store

A chunk reads its halo at the group's inputs directly: the inputs are handed to the group with their
true halo rows (*clean*, :mod:`.layers`), so a layer that propagates its input, or a per-vertex
function of it computed inside the layer (GCNConv's ``lin(x)``), needs nothing else. A propagate whose
sources are computed inside the group before the layer (DeepGCNLayer's ``conv(act(norm(x)))``, the
second hop of APPNP) is a **barrier**: a first pass over all chunks stops there and writes every
chunk's source rows into a site buffer, the next pass reads them; the backward splits the same way,
so the gradient of every source row is complete before any chunk goes on to what precedes the site::

    K barrier sites in a group:   forward  K + 1 passes, the last one stores the outputs
                                  backward phase K .. 1: replay, back-propagate to site k only, its
                                                         source-row gradients (own and halo) -> G_k
                                           phase 0:      replay, full backward; every site's rows take
                                                         G_k, which already holds what flowed through it

Everything every chunk reads is fresh, so the result is the one-device result: exact, like
inference, and like plain PyG up to the order of floating-point sums. Memory on the device: one
chunk's activations of one group, plus the store buffers the budget keeps there. Each group runs
twice per step (forward, replay), as with recomputation. Inference runs the forward only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ...graph.chunks import ChunkedGraph, LocalGraph
from ...model.errors import UnsupportedModelError
from ...model.inputs import CallInputs
from ...model.localize import Localizer
from ..context import ChunkContext
from ..runtime.runtime import Runtime
from ..runtime.sites import same_as_first_chunk, site_keys
from ..runtime.statistics import Statistics
from ..runtime.store import Store
from ..tree import flatten, pack_rows, unflatten
from .barriers import StreamHalo, StreamInput, _Barrier
from .checks import call_kind, check_output, row_check, run_checked
from .chunk import SavedBytes, rng_state, same_rng
from .direct import DirectCalls
from .layer_cache import CacheView, by_chunk


#: whether a step captured as CUDA graphs (:mod:`.capture`) keeps activations too, instead of replaying each
#: chunk's forward in its backward. Measured on an H100 (docs/benchmarks.md, fifth GPU run): 2.16x plain PyG's
#: step at 20k vertices and 1.55x at 200k against 3.14x and 2.16x replaying, every GPU test equal to
#: uncaptured training. A capture keeping them that fails is taken again replaying them (:mod:`.capture`)
KEEP_WHEN_CAPTURED = True


@dataclass
class StreamRecord:
    """What the forward of one call keeps for its backward."""

    runtime: Runtime
    inputs: CallInputs
    localizer: Localizer
    runners: list
    store: Store
    barriers: List[List[str]]                             # per group: its barrier sites, in pass order
    rng: Dict[Tuple[int, int], tuple] = field(default_factory=dict)
    caches: Optional[Dict[int, dict]] = None                  # per chunk: cached=True layers' entries at the start
    received: List[List[str]] = field(default_factory=list)   # per group: the names it receives
    structure: Any = None                                     # how the model's output unpacks (tree.unpack_rows)
    kept: Dict[Tuple[int, int], "_Ran"] = field(default_factory=dict)  # (group, chunk) run with autograd kept
    saved_bytes: int = 0                                      # what the replays saved (deciding rt.stream_keep)


def forward(rt: Runtime, inputs: CallInputs, train: bool, store: Store) -> Tuple[Tensor, StreamRecord]:
    """The model on ``inputs``, group by group over all chunks (module docstring), its values in ``store``:
    the output (packed: :func:`~..tree.pack_rows`, ``record.structure`` unpacks it) and the record.
    ``train``: keep what the backward needs (random states, the store)."""
    cg = rt.graph
    if rt.direct is None:
        rt.direct = DirectCalls()
    runners = rt.programs.stage_runners(inputs)
    localizer = Localizer(inputs, rt.chunked, rt.adjacency, rt.tables, rt.keep_inputs)
    record = StreamRecord(rt, inputs, localizer, runners, store, [])
    record.localizer.call = rt.call if train else 0
    kind = call_kind(rt, inputs)
    checking = row_check(rt, cg.chunks[0].rows, kind) is not None  # this kind of call's first pass checks every group
    capturing = cg.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    keep = train and rt.stream_keep is True and (not capturing or (KEEP_WHEN_CAPTURED and rt.captured.keep_inside))
    out_full = None
    for g, runner in enumerate(runners):
        record.received.append(list(runner.stage.inputs) if g > 0 else [])  # (one untraced group: g = 0)
        check = row_check(rt, cg.chunks[0].rows, kind) if checking else None
        complete: List[str] = []
        reference = None
        while True:  # one pass over the chunks per barrier site met, and the last pass
            barrier = None
            for c in range(cg.num_chunks):
                lg = cg.chunks[c]
                if c + 1 < cg.num_chunks:  # the next chunk's inputs on their way in from the tier while c runs
                    store.prefetch(record.received[g], cg.chunks[c + 1])
                grad = keep and not complete  # (a group with barrier sites is replayed: its passes differ)
                if check is not None:  # every chunk of the checked pass (each runs to its end)
                    check.next_chunk(lg.rows)
                try:
                    with torch.set_grad_enabled(grad):
                        rec = _run(rt, record, g, c, StreamHalo(store, complete), grad=grad,
                                   check=check, moves=not complete)
                except _Barrier as b:
                    if barrier is not None and b.key != barrier:
                        raise UnsupportedModelError(_differs(b.key, barrier))
                    barrier = b.key
                    continue
                if barrier is not None:
                    raise UnsupportedModelError(_differs(None, barrier))
                keys = site_keys(rec.ctx.sites)
                if reference is None:
                    reference = keys
                else:
                    same_as_first_chunk(keys, reference)
                if grad:
                    record.kept[(g, c)] = rec
                if g == len(runners) - 1:
                    out, record.structure = check_output(rec.out, lg.rows, rt), rec.structure
                    if out_full is None:
                        out_full = out.new_empty((cg.num_nodes, *out.shape[1:]))
                    out_full[lg.start:lg.end] = out.detach()
                else:
                    for name, value in rec.sent.items():
                        if name not in record.received[g]:  # (values passed on unchanged are stored already)
                            store.put(name, lg, value)
            if barrier is None:
                break
            complete.append(barrier)
            for c in range(cg.num_chunks):
                record.kept.pop((g, c), None)
        if g < len(runners) - 1:
            store.settle([n for n in rec.sent if n not in record.received[g]])
        if check is not None:
            check.verdict(rt.comm)
        record.barriers.append(complete)
        for key in complete:  # a barrier's rows are read again in the backward only
            if not train:
                store.drop(key)
        if not train:  # inference: a value is not needed after the last group that receives it
            for name in _last_used_by(record, g):
                store.drop(name)
    if checking:
        rt.rows_checked.add(kind)
    return out_full[cg.inv], record


def backward(grad: Tensor, record: StreamRecord) -> None:
    """The backward of :func:`forward` (module docstring): weight gradients accumulate, group by group."""
    rt, store = record.runtime, record.store
    cg = rt.graph
    store.grads[_OUTPUT] = grad[cg.perm]  # (on the device: autograd holds the output's gradient anyway)
    for g in range(len(record.runners) - 1, -1, -1):
        barriers = record.barriers[g]
        for k in range(len(barriers), -1, -1):  # phase k > 0 gathers G of barrier k-1; phase 0 is the full backward
            target = barriers[k - 1] if k > 0 else None
            for c in range(cg.num_chunks):
                if c + 1 < cg.num_chunks and (g, c + 1) not in record.kept:  # (read ahead for a replay)
                    store.prefetch(record.received[g], cg.chunks[c + 1])
                with torch.enable_grad():
                    halo = StreamHalo(store, barriers, capture=target)
                    rec = record.kept.pop((g, c), None)
                    if rec is None:  # replay the chunk's forward (the same random numbers)
                        with SavedBytes(rt.stream_keep is None) as saved:
                            rec = _run(rt, record, g, c, halo, grad=True, check=None, moves=False)
                        record.saved_bytes += saved.bytes
                    roots, grads = _roots(record, g, rec, cg.chunks[c])
                    if not roots:
                        continue
                    with rec.ctx:
                        if target is None:
                            torch.autograd.backward(roots, grads)
                        elif target in halo.sites:  # back-propagate only as far as the site
                            torch.autograd.backward(roots, grads, inputs=[halo.sites[target].anchor])
                        else:  # the site runs in a layer the model recomputes in the backward (checkpointing):
                            kept = _weight_grads(rt.module)  # a whole backward, its weight gradients undone
                            torch.autograd.backward(roots, grads)
                            _restore(rt.module, kept)
                    if target is None:
                        _check_reached(halo, barriers, g)
                        _collect(record, g, rec, cg.chunks[c])
        for name in _produced_by(record, g):
            store.drop(name)
        for key in barriers:
            store.drop(key)
    store.clear()
    if rt.stream_keep is None:
        decide_keep(rt, record.saved_bytes)
    rt.direct.settle(rt.layer_cache)


def decide_keep(rt: Runtime, saved_bytes: int) -> None:
    """``recompute="auto"`` when streaming: after the first step's backward replayed every chunk, saving
    ``saved_bytes`` for autograd in all, keep every chunk's activations from the forward to the backward from
    now on (no replay: a third less compute) if they fit a quarter of the memory the device has free; else go
    on replaying. Decided once; the results are the same bit for bit either way."""
    from ..runtime.tiers import free_memory
    rt.stream_keep = saved_bytes <= free_memory(rt.comm.device) // 4


# ---------------------------------------------------------------------------------------------
# one chunk of one group
# ---------------------------------------------------------------------------------------------

_OUTPUT = "__output__"


@dataclass
class _Ran:
    ctx: ChunkContext
    sent: Dict[str, Any]
    out: Any
    leaves: List[Tuple[str, Tensor, Any]]      # (value name, leaf, its StreamInput or vertex ids of its rows)
    chunk_leaves: Dict[str, Any]
    structure: Any = None                      # the last group's output is packed (tree.pack_rows)


def _run(rt: Runtime, record: StreamRecord, g: int, c: int, halo: StreamHalo, grad: bool, check, moves: bool) -> _Ran:
    """Group ``g`` on chunk ``c``: its inputs from the store (node values with their true halo rows: clean)."""
    cg = rt.graph
    lg = cg.chunks[c]
    store = record.store
    stats = Statistics(rt.comm, None, None, lg.rows, update_running=True, replay=not moves)
    if record.caches is None:  # cached=True layers: every run of this step sees the cache as it was
        record.caches = by_chunk(rt.layer_cache)
    cache = CacheView(rt.layer_cache, record.caches.get(c, {}), c)
    ctx = ChunkContext(cg, lg, halo, record.localizer.resolver(c, rt.derive), stats, cache, check, replay=False)
    ctx.direct = rt.direct
    leaves: List[Tuple[str, Tensor, Any]] = []
    chunk_leaves: Dict[str, Any] = {}
    received: Dict[str, Any] = {}
    inputs: List[Tuple[str, StreamInput]] = []
    state = record.rng.get((g, c))
    if state is None:  # the first run of this chunk of this group: its random numbers, for every later pass
        record.rng[(g, c)] = rng_state(rt.comm.device)
    with ctx, same_rng(state, rt.comm.device):
        args, kwargs = record.localizer.localize(c, ctx)
        for name in record.received[g]:
            if name in store.rows:
                rows = None if rt.direct.wants_halo(g, name) else store.gather_rows(name, lg)
                inp = StreamInput(store.gather_local(name, lg), lg.rows, grad) if rows is None else \
                    StreamInput(rows, lg.rows, grad, lambda name=name: store.gather_local(name, lg))
                inputs.append((name, inp))
                if inp.grad:
                    leaves.append((name, inp.rows, inp))
                ctx.add_clean(inp.rows, _extender(store, name, inp, lg, leaves, grad), inp.whole)
                received[name] = inp.rows
            else:
                value = store.chunks[name][lg.index]
                if grad:
                    ls, spec = flatten(value)
                    ls = [t.detach().requires_grad_() if isinstance(t, Tensor) and t.is_floating_point() else t
                          for t in ls]
                    value = unflatten(ls, spec)
                    chunk_leaves[name] = value
                received[name] = value
        runner = record.runners[g]
        sent, out = run_checked(rt, check, runner, args, kwargs, received)
    for name, inp in inputs:
        rt.direct.saw(g, name, inp.used)
    structure = None
    if g == len(record.runners) - 1:
        out, structure = pack_rows(out, lg.rows)
    return _Ran(ctx, sent, out, leaves, chunk_leaves, structure)


def _extender(store: Store, name: str, inp: StreamInput, lg: LocalGraph, leaves: list, grad: bool):
    """The halo rows of a received node value, for the primary graph's chunk or another graph's."""
    def extend(cg2: ChunkedGraph, lg2: LocalGraph) -> Tensor:
        if lg2 is lg:
            return inp.whole()[lg.rows:]
        rows = store.gather(name, lg2.halo)
        if grad and rows.is_floating_point():
            rows.requires_grad_()
            leaves.append((name, rows, lg2.halo))
        return rows
    return extend


def _roots(record: StreamRecord, g: int, rec: _Ran, lg: LocalGraph) -> Tuple[List[Tensor], List[Tensor]]:
    """The group's outputs for the chunk and the gradients that reached their rows."""
    store = record.store
    roots, grads = [], []
    produced = {_OUTPUT: rec.out} if g == len(record.runners) - 1 else \
        {k: v for k, v in rec.sent.items() if k not in record.received[g]}
    for name, value in produced.items():
        if name in store.rows or name in store.grads:
            gr = store.grad_rows(name, lg)
            if gr is not None and isinstance(value, Tensor) and value.requires_grad:
                roots.append(value)
                grads.append(gr.to(value.dtype))
        else:
            got = store.chunk_grads.get(name, {}).get(lg.index)
            if got is None:
                continue
            for leaf, gr in zip(flatten(value)[0], flatten(got)[0]):
                if isinstance(leaf, Tensor) and leaf.requires_grad and gr is not None:
                    roots.append(leaf)
                    grads.append(gr)
    return roots, grads


def _collect(record: StreamRecord, g: int, rec: _Ran, lg: LocalGraph) -> None:
    """After a chunk's full backward: the gradients of its inputs into the store."""
    store = record.store
    for name, leaf, ids in rec.leaves:
        if leaf.grad is None:  # (a halo gradient comes with the rows': _Whole's backward gives both)
            continue
        if isinstance(ids, StreamInput):  # the chunk's rows, and its halo's gradient where it was propagated
            store.add_grad_local(name, lg, leaf.grad, ids.halo_grad)
        else:  # another graph's halo
            store.add_grad(name, ids, leaf.grad)
    for name, value in rec.chunk_leaves.items():
        ls, spec = flatten(value)
        gs = [t.grad if isinstance(t, Tensor) and t.requires_grad else None for t in ls]
        if any(x is not None for x in gs):
            prev = store.chunk_grads.setdefault(name, {}).get(lg.index)
            if prev is not None:
                gs = [a if b is None else b if a is None else a + b for a, b in zip(gs, flatten(prev)[0])]
            store.chunk_grads[name][lg.index] = unflatten(gs, spec)


def _weight_grads(module: torch.nn.Module) -> List[Optional[Tensor]]:
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


def _restore(module: torch.nn.Module, kept: List[Optional[Tensor]]) -> None:
    for p, g in zip(module.parameters(), kept):
        p.grad = g


def _check_reached(halo: StreamHalo, keys: List[str], g: int) -> None:
    """In a chunk's full backward every barrier site's join must have run its backward (else the complete
    gradient of its rows, which includes other chunks' reads of them, would be lost). (In a phase that
    gathers one site's gradient, sites with no path to it need not run: they contribute nothing there.)"""
    for key in keys:
        site = halo.sites.get(key)
        if key in halo.constant and site is None:
            continue
        if site is None or not site.reached:
            raise UnsupportedModelError(
                f"Streaming: the output of layer group {g} does not depend on call site '{key}' of the same chunk, "
                f"but other chunks read its rows; the gradient of those reads has no path back. Train without "
                f"streaming (streaming=False) or with num_chunks=1.")


def _produced_by(record: StreamRecord, g: int) -> List[str]:
    """Values first received by group ``g + 1`` (produced by group ``g``), and the output for the last group."""
    if g == len(record.runners) - 1:
        return []
    earlier = {n for names in record.received[:g + 1] for n in names}
    return [n for n in record.received[g + 1] if n not in earlier]


def _last_used_by(record: StreamRecord, g: int) -> List[str]:
    """Values no group after ``g`` receives (inference drops them then)."""
    later = {n for r in record.runners[g + 1:] for n in r.stage.inputs}
    return [n for n in record.received[g] if n not in later]


def _differs(key: Optional[str], other: str) -> str:
    return (f"Streaming: chunks of one layer group stopped at different call sites ({key or 'none'} and {other}); "
            f"the forward's layer calls depend on the data. Train without streaming (streaming=False).")
