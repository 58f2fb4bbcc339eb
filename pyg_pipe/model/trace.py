"""A model's forward as a program of units, for cutting it into pipeline stages (torch.fx).

Only pipelines (more than one stage) need this; graph parallelism runs the forward as it is.
:func:`trace` records the forward with ``torch.fx``, keeping as one opaque *unit*:

* every ``MessagePassing`` layer and every ``torch.nn`` built-in module,
* every graph-wide statistics module (BatchNorm, GraphNorm, ...),
* every submodule whose own forward does not trace (Python control flow on tensor values, such as
  ``DeepGCNLayer(block="res+", ckpt_grad=...)``): it is found from the failure, made a unit, and
  the trace is retried, so a model traces as finely as it can.

If the top-level forward itself does not trace, the model cannot be split (the error says how to
fix it). ``torch_geometric.nn.Sequential`` models are read from their declared dataflow
(``'x, x0, edge_index -> x'``) instead of traced. Split points follow the convention of
``torch.distributed.pipelining``: ``pipe_split()`` calls in the forward, or
``split_points={"layers.4": SplitPoint.BEGINNING}``.
"""
from __future__ import annotations

import inspect
import operator
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set

import torch
import torch.fx as fx
from torch.distributed.pipelining import SplitPoint, pipe_split
from torch_geometric.nn import MessagePassing

from .errors import CannotTrace, NoLayerCalled, UnsupportedModelError
from .norms import needs_statistics

__all__ = ["Program", "trace", "pipe_split", "SplitPoint", "forward_function", "as_layer_call"]

_torch_pipe_split = pipe_split
_TRACING: List["_Tracer"] = []


def pipe_split() -> None:
    """Marks a pipeline stage boundary in a model's forward (a no-op when the model runs).

    The convention of ``torch.distributed.pipelining``, whose ``pipe_split`` is understood too::

        def forward(self, x, edge_index):
            x = self.convs[0](x, edge_index).relu()
            pyg_pipe.pipe_split()            # stage 1 starts here
            ...
    """
    if _TRACING:
        _TRACING[-1].create_proxy("call_function", pipe_split, (), {})


_PIPE_SPLIT_TARGETS = (pipe_split, _torch_pipe_split)
_RANDOM = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "rand",
           "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli", "bernoulli_",
           "normal", "normal_", "uniform_", "multinomial", "dropout_edge", "dropout_node", "dropout_adj",
           "dropout_path"}


@dataclass
class Program:
    """A traced forward.

    Attributes:
        root: the traced module.
        graph: the fx graph (nodes in execution order).
        units: the call_module nodes that contain a ``MessagePassing`` layer (the pipeline's layers).
        splits: nodes where the user marked a stage boundary (``pipe_split()``), in order.
        modules: qualified name -> module for every call_module target.
    """

    root: torch.nn.Module
    graph: fx.Graph
    units: List[fx.Node]
    splits: List[fx.Node]
    modules: Dict[str, torch.nn.Module] = field(default_factory=dict)

    @property
    def steps(self) -> List[fx.Node]:
        return [n for n in self.graph.nodes if n.op not in ("placeholder", "output")]

    @property
    def output(self) -> fx.Node:
        return next(n for n in self.graph.nodes if n.op == "output")

    @property
    def placeholders(self) -> List[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def recomputable(self, node: fx.Node, memo: Dict[str, bool]) -> bool:
        """Whether ``node`` depends only on the inputs through parameter-free, non-random operations:
        any stage can then compute it itself instead of receiving it (``data.x``, ``x.size(0)``,
        ``edge_index.flip(0)``)."""
        if node.name in memo:
            return memo[node.name]
        if node.op == "placeholder":
            ok = True
        elif node.op in ("call_function", "call_method"):
            name = getattr(node.target, "__name__", str(node.target))
            ok = name not in _RANDOM and node.target not in _PIPE_SPLIT_TARGETS and all(
                self.recomputable(a, memo) for a in node.all_input_nodes)
        else:
            ok = False
        memo[node.name] = ok
        return ok


def forward_function(model: torch.nn.Module):
    """The plain function behind ``model.forward`` (PyG's ``Sequential`` keeps one per instance)."""
    inst = model.__dict__.get("forward")
    if inst is not None and getattr(inst, "__self__", None) is model:
        return inst.__func__
    return type(model).forward


def as_layer_call(model: torch.nn.Module, fn: Callable) -> Callable:
    """The function the engine runs for ``model``'s method ``fn``: ``fn`` itself, except where the model is one
    ``MessagePassing`` layer (``model = SGConv(...)``) and ``fn`` its forward. Then a function of the same
    parameters that calls the layer as a layer, ``self(...)``, so the engine runs it as it runs a model's layers
    (cut into chunks, its halo joined, its degrees completed), and a trace sees one unit."""
    if not isinstance(model, MessagePassing) or fn is not forward_function(model):
        return fn
    params = list(inspect.signature(fn).parameters.values())
    kinds = inspect.Parameter
    heads, calls, star = [], [], False  # (fx reads a traced function's parameters from its code: written out)
    for i, p in enumerate(params):
        if p.kind is kinds.VAR_POSITIONAL:
            heads.append(f"*{p.name}")
            calls.append(f"*{p.name}")
            star = True
        elif p.kind is kinds.VAR_KEYWORD:
            heads.append(f"**{p.name}")
            calls.append(f"**{p.name}")
        elif p.kind is kinds.KEYWORD_ONLY:
            if not star:
                heads.append("*")
                star = True
            heads.append(p.name)
            calls.append(f"{p.name}={p.name}")
        else:
            heads.append(p.name)
            calls.append(p.name)
        if p.kind is kinds.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.kind):
            heads.append("/")
    scope: Dict[str, Any] = {}
    exec(f"def forward({', '.join(heads)}):\n    return {params[0].name}({', '.join(calls[1:])})\n", scope)
    whole = scope["forward"]
    base = inspect.unwrap(fn)  # (a decorated forward, ``@torch.no_grad()`` on LabelPropagation's: the defaults are its)
    whole.__defaults__, whole.__kwdefaults__ = base.__defaults__, base.__kwdefaults__
    whole.__annotations__ = dict(getattr(base, "__annotations__", {}))
    whole.__qualname__ = f"{type(model).__name__}.forward"
    return whole


#: functions fx records as one call instead of tracing into (DropEdge's: :mod:`pyg_pipe.engine.step.dropedge`)
AUTOWRAP: List[Callable] = []


class _Tracer(fx.Tracer):
    def __init__(self, leaves: Set[str], buffers: bool = True):
        super().__init__(autowrap_functions=tuple(AUTOWRAP))
        # a buffer read in the forward is an attribute read when the program runs (``get_attr``), not a constant
        # taken at the trace: what is computed from it (``self.scale[:, None]``) follows the buffer, and a chunk's
        # rows of a per-vertex buffer (:func:`~.find.vertex_tables`) reach it
        self.proxy_buffer_attributes = buffers
        self.leaves = leaves
        self.failed: Optional[str] = None

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return (isinstance(m, MessagePassing) or qualname in self.leaves or needs_statistics(m)
                or super().is_leaf_module(m, qualname))

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed is None:
                self.failed = self.path_of_module(m)
            raise


def trace(model: torch.nn.Module, args: tuple, kwargs: dict, fn: Optional[Callable] = None) -> Program:
    """Traces ``model`` for a call with ``args`` / ``kwargs`` (tensors and ``Data`` become inputs;
    ``None`` and Python values are baked in, as fx's ``concrete_args``). ``fn``: the method traced (a plain
    function of ``model``; ``None``: its forward), such as a link predictor's ``encode``."""
    fn = forward_function(model) if fn is None else fn
    if _is_generic_sequential(model, fn):
        graph = _sequential_graph(model)
    else:
        graph = _trace_with_fallback(model, fn, args, kwargs)
    modules = dict(model.named_modules())
    units, splits = [], []
    for node in graph.nodes:
        if node.op == "call_module":
            m = modules[node.target]
            if any(isinstance(x, MessagePassing) for x in m.modules()):
                units.append(node)
        elif node.op == "call_function" and node.target in _PIPE_SPLIT_TARGETS:
            splits.append(node)
    if not units:
        mode = "training" if model.training else "eval"
        raise NoLayerCalled(
            f"{type(model).__name__} calls no MessagePassing layer in its {fn.__name__} in {mode} mode, so there is "
            f"nothing to cut into pipeline stages. Use strategy='gnnpipe' without a stage count (a model with fewer "
            f"layers than devices runs on graph-parallel ways) or strategy='graph_parallel'.")
    return Program(model, graph, units, splits, modules)


def trace_other_mode(model: torch.nn.Module, args: tuple, kwargs: dict, fn: Optional[Callable] = None) -> None:
    """Traces ``model`` in the other mode (eval when training, and back) and raises :class:`NoLayerCalled`
    if that mode calls no message-passing layer (PyG's ``PMLP`` trains as an MLP and propagates only in eval), so
    that the grid is decided for both modes, whichever runs first (Lightning's sanity check runs eval first). Every
    module's mode is restored; other refusals are left for that mode's first call."""
    modes = [(m, m.training) for m in model.modules()]
    model.train(not model.training)
    try:
        trace(model, args, kwargs, fn)
    except NoLayerCalled:
        raise
    except Exception:  # noqa: BLE001 - that mode's own refusal (or a trace fallback) comes when it runs
        pass
    finally:
        for m, mode in modes:
            m.training = mode


def _trace_with_fallback(model, fn, args, kwargs) -> fx.Graph:
    from torch import Tensor
    from torch_geometric.data import Data
    sig = inspect.signature(fn)
    bound = sig.bind(model, *args, **kwargs)
    bound.apply_defaults()
    concrete = {k: v for k, v in bound.arguments.items()
                if k != "self" and not isinstance(v, (Tensor, Data)) and sig.parameters[k].kind not in
                (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}
    cls = type(model)
    leaves: Set[str] = set()
    apply = torch.autograd.Function.__dict__["apply"]
    buffers = [(m, dict(m._buffers)) for m in model.modules()]
    proxied = True  # buffers read as attributes (:class:`_Tracer`), unless the forward assigns one
    while True:
        tracer = _Tracer(leaves, proxied)
        if fn is not cls.forward:  # trace the instance's own forward: swap in a subclass for the duration
            model.__class__ = type(cls.__name__, (cls,), {"forward": fn})
        # fx would trace into a custom autograd Function (reversible blocks, checkpointing) and lose its
        # backward: such a call makes its module a unit instead
        torch.autograd.Function.apply = classmethod(_refuse_custom_function)
        # torch's pipe_split (a no-argument call fx would not record) is swapped for ours in the forward's globals
        swapped = [k for k, v in fn.__globals__.items() if v is _torch_pipe_split]
        for k in swapped:
            fn.__globals__[k] = pipe_split
        _TRACING.append(tracer)
        factories = {n: getattr(torch, n) for n in _SIZED}
        for n, f in factories.items():
            setattr(torch, n, _packed(f))
        try:
            graph = tracer.trace(model, concrete_args=concrete or None)
        except Exception as exc:  # noqa: BLE001 - a unit that does not trace, or a refusal with advice
            if proxied:  # (a buffer read as a Proxy where its value is used, in control flow or an assignment: traced
                proxied = False  # as before, on the buffers themselves, units and refusals decided there)
                continue
            if tracer.failed is not None and tracer.failed not in leaves:
                leaves.add(tracer.failed)  # run that submodule whole, as one unit
                continue
            utility = _graph_utility(exc)
            if utility is not None:
                raise UnsupportedModelError(
                    f"pyg_pipe cannot split {type(model).__name__} into pipeline stages: its forward computes a graph "
                    f"with {utility} (torch.fx cannot trace it: {type(exc).__name__}), and a graph computed inside "
                    f"forward cannot be cut into chunks in any mode. Compute it in the data pipeline, as a "
                    f"transform (T.ToUndirected(), T.AddSelfLoops()) or as another graph passed to forward "
                    f"(data.edge_index2 = ...; every graph passed is cut into chunks).") from exc
            method, reason = f"{type(model).__name__}.{fn.__name__}", f"{type(exc).__name__}: {exc}"
            raise CannotTrace(
                f"pyg_pipe cannot split {type(model).__name__} into pipeline stages: torch.fx cannot trace "
                f"{method} ({reason}). A submodule that does not trace "
                f"runs whole as one pipeline unit, but the method the strategy distributes must chain its units "
                f"without Python control flow on tensor values or item assignment: move that code into a submodule "
                f"(then pipe_split() or split_points={{...}} choose where stages start), or leave the stage count to "
                f"strategy='gnnpipe' or use strategy='graph_parallel', which run any method as it is on "
                f"graph-parallel ways.", method, reason) from exc
        finally:
            model.__class__ = cls
            assigned = any(m._buffers.get(k) is not t for m, held in buffers for k, t in held.items())
            for m, held in buffers:
                m._buffers.update(held)
            torch.autograd.Function.apply = apply
            for n, f in factories.items():
                setattr(torch, n, f)
            _TRACING.pop()
            for k in swapped:
                fn.__globals__[k] = _torch_pipe_split
        if assigned and proxied:  # ``self.n += 1`` on a buffer: a Proxy was stored, and fx has no in-place add; traced
            proxied = False       # again on the buffers themselves, which the trace changes, as the forward would
            continue              # (refused by name where the forward does not run once: :mod:`..engine.step.state`)
        return graph


#: torch's factories that take a size as separate numbers (``torch.ones(n, 1)``). Given a number read from a traced
#: tensor (``x.size(0)``, an fx Proxy) among them, torch's argument parser rejects the call ("ones() takes 1 positional
#: argument but 2 were given": a forward doing so could not be split into stages), while the same size as one tuple is
#: recorded; so while tracing they are called with such sizes packed into a tuple (the program calls torch's own).
_SIZED = ("ones", "zeros", "empty", "rand", "randn")


def _packed(factory: Callable) -> Callable:
    def call(*size, **kwargs):
        if len(size) > 1 and any(isinstance(n, fx.Proxy) for n in size):
            return factory(size, **kwargs)
        return factory(*size, **kwargs)
    return call


#: PyG's utilities that make a new graph from one (``torch_geometric.utils``)
_GRAPH_UTILITIES = {"to_undirected", "coalesce", "sort_edge_index", "add_self_loops", "add_remaining_self_loops",
                    "remove_self_loops", "segregate_self_loops", "remove_isolated_nodes", "dropout_edge",
                    "dropout_node", "dropout_path", "dropout_adj", "subgraph", "k_hop_subgraph", "to_edge_index",
                    "to_torch_coo_tensor", "to_torch_csr_tensor", "to_torch_csc_tensor", "to_torch_sparse_tensor",
                    "negative_sampling", "add_random_edge", "shuffle_node"}


def _graph_utility(exc: BaseException) -> Optional[str]:
    """``torch_geometric.utils.<name>`` when the trace failed inside one of PyG's utilities that make a graph (the
    outermost one called), else ``None``."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if "/torch_geometric/utils/" in code.co_filename.replace(os.sep, "/"):
            return f"torch_geometric.utils.{code.co_name}" if code.co_name in _GRAPH_UTILITIES else None
        tb = tb.tb_next
    return None


def _refuse_custom_function(cls, *args, **kwargs):
    raise fx.proxy.TraceError(f"custom autograd Function {cls.__name__} cannot be traced")


def _is_generic_sequential(model: torch.nn.Module, fn) -> bool:
    from torch_geometric.nn import Sequential
    return isinstance(model, Sequential) and any(
        p.kind == p.VAR_POSITIONAL for p in inspect.signature(fn).parameters.values())


def _sequential_graph(model: torch.nn.Module) -> fx.Graph:
    """The dataflow of a ``torch_geometric.nn.Sequential`` as an fx graph, read from its descriptors
    (``'x, x0, edge_index -> x'``): the names already say what flows where."""
    graph = fx.Graph()
    values: Dict[str, Any] = {name: graph.placeholder(name) for name in model.signature.param_dict}
    out = None
    for child in model._children:
        module = getattr(model, child.name)
        args = tuple(values[n] for n in child.param_names)
        if isinstance(module, torch.nn.Module):
            out = graph.call_module(child.name, args)
        else:
            out = graph.call_function(module, args)
        if len(child.return_names) == 1:
            values[child.return_names[0]] = out
        else:
            for i, name in enumerate(child.return_names):
                values[name] = graph.call_function(operator.getitem, (out, i))
    graph.output(out)
    return graph
