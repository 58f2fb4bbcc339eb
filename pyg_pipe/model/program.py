"""A PyG model as a program of steps with named dataflow, traced with torch.fx.

Every supported model form (PyG ``BasicGNN`` models, ``torch_geometric.nn.Sequential``
and plain ``torch.nn.Module`` models built from ``MessagePassing`` layers) goes through
one mechanism: :func:`trace` records the model's forward as an ``fx`` graph in which every
``MessagePassing`` module, and every ``torch.nn`` module, is a single opaque step.
Each value of that graph gets a *kind*:

======== =====================================================================
``node`` one row per vertex (features, hidden states, GCNII's ``x0``)
``edge`` one row per edge (``edge_weight``, ``edge_attr``)
``graph`` the connectivity itself (``edge_index`` or a sparse ``adj_t``)
``const`` anything else (parameters fetched with ``get_attr``, Python values)
======== =====================================================================

Operations between message-passing steps must be row-wise (per vertex or per edge):
that is what lets the engine run them on the rows of one chunk at a time.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx
from torch import Tensor
from torch_geometric.nn import MessagePassing

NODE, EDGE, GRAPH, CONST = "node", "edge", "graph", "const"

GRAPH_ARG_NAMES = ("edge_index", "adj_t", "adj")
EDGE_ARG_NAMES = ("edge_weight", "edge_attr", "edge_type")


class UnsupportedModelError(ValueError):
    """The model cannot be split into pipeline stages; the message says why and what to do."""


class _LeafTracer(fx.Tracer):
    """Keeps every ``MessagePassing`` layer (and every ``torch.nn`` module) as one step."""

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return isinstance(m, MessagePassing) or super().is_leaf_module(m, qualname)


def is_graph_tensor(value: Any) -> bool:
    """True for ``edge_index`` ([2, E] integer tensor) and sparse adjacency matrices."""
    if isinstance(value, Tensor):
        if value.layout != torch.strided:
            return True
        return value.dim() == 2 and value.size(0) == 2 and not value.is_floating_point()
    return type(value).__name__ == "SparseTensor"


@dataclass
class Program:
    """A traced forward: ``fx`` nodes in execution order with their value kinds.

    Attributes:
        root: the traced module (owner of the sub-modules the steps call).
        graph: the ``fx`` graph.
        inputs: names of the forward's tensor arguments, in call order.
        steps: compute nodes (everything but placeholders and the output) in order.
        kinds: value kind of every node, keyed by node name.
        mp_steps: the steps that call a ``MessagePassing`` module, in order.
        output: the node whose value the forward returns.
    """

    root: torch.nn.Module
    graph: fx.Graph
    inputs: List[str]
    steps: List[fx.Node]
    kinds: Dict[str, str]
    mp_steps: List[fx.Node]
    output: fx.Node
    modules: Dict[str, torch.nn.Module] = field(default_factory=dict)

    def module_of(self, node: fx.Node) -> Optional[torch.nn.Module]:
        return self.modules.get(node.target) if node.op == "call_module" else None

    def is_mp(self, node: fx.Node) -> bool:
        return isinstance(self.module_of(node), MessagePassing)


def forward_function(model: torch.nn.Module):
    """The plain function behind ``model.forward``.

    Usually the class attribute; PyG's ``Sequential`` generates a forward per instance and stores it on
    the instance, so that one wins when present.
    """
    inst = model.__dict__.get("forward")
    if inst is not None and getattr(inst, "__self__", None) is model:
        return inst.__func__
    return type(model).forward


def bind_inputs(model: torch.nn.Module, args: tuple, kwargs: dict, fn=None) -> Dict[str, Any]:
    """Binds a forward call's arguments to the parameter names of the model's forward function."""
    fn = fn or forward_function(model)
    if _is_generic_sequential(model, fn):
        names = list(model.signature.param_dict)
        out = dict(zip(names, args))
        out.update(kwargs)
        return {n: out.get(n) for n in names}
    sig = inspect.signature(fn)
    bound = sig.bind(model, *args, **kwargs)
    bound.apply_defaults()
    out = dict(bound.arguments)
    out.pop("self", None)
    for name, p in sig.parameters.items():
        if p.kind == p.VAR_KEYWORD and name in out:
            out.update(out.pop(name))
        elif p.kind == p.VAR_POSITIONAL and name in out:
            if out.pop(name):
                raise UnsupportedModelError(
                    f"{type(model).__name__}.forward takes *{name}; pass the graph tensors as named "
                    f"arguments (x, edge_index, ...) so pyg_pipe can tell them apart.")
    return out


def trace(model: torch.nn.Module, bound: Dict[str, Any], num_nodes: int, num_edges: int, fn=None) -> Program:
    """Traces ``model`` for a call whose arguments are ``bound`` (from :func:`bind_inputs`).

    Tensor arguments become graph inputs; ``None`` and Python values are baked in, as
    ``fx`` does with ``concrete_args``. Raises :class:`UnsupportedModelError` with the reason
    and the fix when the model cannot be traced or split.
    """
    _check_modules(model)
    concrete = {k: v for k, v in bound.items() if not isinstance(v, Tensor) and not is_graph_tensor(v)}
    tracer = _LeafTracer()
    fn = fn or forward_function(model)
    cls = type(model)
    if fn is not cls.forward:  # trace the instance's own forward: swap in a subclass for the duration
        model.__class__ = type(cls.__name__, (cls,), {"forward": fn})
    try:
        if _is_generic_sequential(model, fn):
            graph = _sequential_graph(model)
        else:
            graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as exc:  # noqa: BLE001 - re-raised with advice
        raise UnsupportedModelError(
            f"pyg_pipe could not trace {type(model).__name__}.forward with torch.fx ({type(exc).__name__}: "
            f"{exc}). Its layers must be MessagePassing modules called in a fixed order, with no Python "
            f"control flow that depends on tensor values; write the model as a BasicGNN, a "
            f"torch_geometric.nn.Sequential, or a module whose forward chains its layers.") from exc
    finally:
        model.__class__ = cls
    modules = dict(model.named_modules())
    inputs: List[str] = []
    kinds: Dict[str, str] = {}
    steps: List[fx.Node] = []
    mp_steps: List[fx.Node] = []
    output = None
    for node in graph.nodes:
        if node.op == "placeholder":
            name = node.target.lstrip("*")
            value = bound.get(name)
            kinds[node.name] = _input_kind(name, value, num_nodes, num_edges)
            if isinstance(value, Tensor) or is_graph_tensor(value):
                inputs.append(name)
            continue
        if node.op == "output":
            output = node
            continue
        steps.append(node)
        arg_kinds = [kinds[a.name] for a in _input_nodes(node)]
        module = modules.get(node.target) if node.op == "call_module" else None
        if isinstance(module, MessagePassing):
            mp_steps.append(node)
            kinds[node.name] = NODE
        elif node.op == "get_attr":
            kinds[node.name] = CONST
        elif NODE in arg_kinds:
            kinds[node.name] = NODE
        elif EDGE in arg_kinds:
            kinds[node.name] = EDGE
        elif GRAPH in arg_kinds:
            kinds[node.name] = GRAPH
        else:
            kinds[node.name] = CONST
    assert output is not None
    if not mp_steps:
        raise UnsupportedModelError(
            f"{type(model).__name__} calls no MessagePassing layer in its forward, so there is nothing to "
            f"pipeline. pyg_pipe splits models whose layers are torch_geometric MessagePassing modules.")
    out_nodes = _input_nodes(output)
    if len(out_nodes) != 1 or kinds[out_nodes[0].name] != NODE or not isinstance(output.args[0], fx.Node):
        raise UnsupportedModelError(
            f"{type(model).__name__}.forward must return one tensor with a row per vertex; it returns "
            f"{output.args[0]!r}. Return the node embeddings or logits only.")
    for node in steps:
        if node in mp_steps:
            continue
        for a in _input_nodes(node):
            if kinds[a.name] == GRAPH:
                raise UnsupportedModelError(
                    f"{type(model).__name__}.forward uses the connectivity '{a.name}' outside a MessagePassing "
                    f"layer (in '{node.name}'). pyg_pipe hands each layer a chunk's local graph, so graph "
                    f"computations belong inside a MessagePassing layer or in the data pipeline.")
    for node in mp_steps:
        for a in _input_nodes(node):
            if kinds[a.name] == GRAPH and a.op != "placeholder":
                raise UnsupportedModelError(
                    f"Layer '{node.target}' receives a connectivity computed inside forward ({a.name}); "
                    f"pyg_pipe cuts the graph into chunks before the model runs. Apply graph transforms "
                    f"(self loops, edge dropout, ...) in the data pipeline instead.")
    return Program(model, graph, inputs, steps, kinds, mp_steps, output, modules)


def _input_nodes(node: fx.Node) -> List[fx.Node]:
    return list(node.all_input_nodes)


def _input_kind(name: str, value: Any, num_nodes: int, num_edges: int) -> str:
    if is_graph_tensor(value) or name in GRAPH_ARG_NAMES:
        return GRAPH
    if isinstance(value, Tensor) and value.dim() > 0:
        if name in EDGE_ARG_NAMES or (value.size(0) == num_edges and value.size(0) != num_nodes):
            return EDGE
        if value.size(0) == num_nodes:
            return NODE
    return CONST


# Modules whose statistics span all vertices: they cannot run one chunk at a time.
_GRAPH_WIDE_NORMS = ("BatchNorm", "InstanceNorm", "GraphNorm", "PairNorm", "DiffGroupNorm",
                     "MeanSubtractionNorm", "GraphSizeNorm", "SyncBatchNorm")


def _check_modules(model: torch.nn.Module) -> None:
    """Refuses modules that read across chunks (with the fix in the message)."""
    from torch_geometric.nn import JumpingKnowledge
    from torch_geometric.nn import LayerNorm as PygLayerNorm

    if getattr(model, "jk_mode", None) is not None:
        raise UnsupportedModelError(
            f"{type(model).__name__}(jk='{model.jk_mode}') combines the outputs of every layer "
            f"(JumpingKnowledge), so the last pipeline stage would need every stage's activations. "
            f"Use jk=None with strategy='gnnpipe'.")
    for name, m in model.named_modules():
        cls = type(m).__name__
        if isinstance(m, JumpingKnowledge):
            raise UnsupportedModelError(
                f"Module '{name}' is a JumpingKnowledge layer: it needs every layer's output in one stage, "
                f"which pipelined training cannot provide. Remove it (jk=None) for strategy='gnnpipe'.")
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) or any(cls.startswith(p) for p in _GRAPH_WIDE_NORMS):
            raise UnsupportedModelError(
                f"Module '{name}' ({cls}) normalises with statistics over all vertices, but pyg_pipe runs a "
                f"stage one chunk of vertices at a time. Use a per-vertex norm instead: "
                f"torch.nn.LayerNorm or torch_geometric.nn.LayerNorm(mode='node') (norm='layer_norm' with "
                f"norm_kwargs={{'mode': 'node'}} for BasicGNN models).")
        if isinstance(m, PygLayerNorm) and m.mode != "node":
            raise UnsupportedModelError(
                f"Module '{name}' is torch_geometric.nn.LayerNorm(mode='{m.mode}'), which normalises over "
                f"all vertices of the graph. Use mode='node' (per vertex), or torch.nn.LayerNorm.")
        if isinstance(m, MessagePassing) and getattr(m, "flow", "source_to_target") != "source_to_target":
            raise UnsupportedModelError(
                f"Layer '{name}' uses flow='{m.flow}'; pyg_pipe cuts chunks by destination vertex and supports "
                f"flow='source_to_target' only. Reverse edge_index in the data and use the default flow.")


def _is_generic_sequential(model: torch.nn.Module, fn) -> bool:
    from torch_geometric.nn import Sequential
    return isinstance(model, Sequential) and any(
        p.kind == p.VAR_POSITIONAL for p in inspect.signature(fn).parameters.values())


def _sequential_graph(model: torch.nn.Module) -> fx.Graph:
    """The dataflow of a ``torch_geometric.nn.Sequential`` as an fx graph, read from its descriptors
    (``'x, x0, edge_index -> x'``): no tracing needed, the names already say what flows where."""
    import operator
    graph = fx.Graph()
    values = {name: graph.placeholder(name) for name in model.signature.param_dict}
    out = None
    for child in model._children:
        module = getattr(model, child.name)
        args = tuple(values[n] for n in child.param_names)
        if isinstance(module, torch.nn.Module):
            if not isinstance(module, MessagePassing) and any(isinstance(m, MessagePassing) for m in module.modules()):
                raise UnsupportedModelError(
                    f"Sequential entry '{child.name}' ({type(module).__name__}) wraps MessagePassing layers; "
                    f"list the layers in the Sequential directly so pyg_pipe can place them on stages.")
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
