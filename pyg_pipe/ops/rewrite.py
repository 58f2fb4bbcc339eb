"""The SAGA dataflow rewrite: ApplyEdge split into per-vertex work before Scatter and per-edge work after.

A SAGA layer's ``apply_edge(src, dst, ...)`` reads the data of an edge's source and destination
vertices. Any part of it that reads only ``src`` (or only ``dst``) through *row-wise* operations
computes the same value for every edge out of one vertex, so it can run once per vertex before the
Scatter instead of once per edge after it (|V| instead of |E| evaluations)::

    apply_edge:  sigmoid(A(dst) + B(src)) * V(src)            |E| products with A, B and V

    vertex side: a = A(x), b = B(x), c = V(x)                 |V| products      (before Scatter)
    edge side:   sigmoid(a_i + b_j) * c_j                     element-wise      (after Scatter)

This is NGra's rewrite for an ApplyEdge linear in the source vertex, applied to every row-wise
function of one end: ``f(x)[j] == f(x[j])`` for any ``f`` that maps each row on its own. Which
operations are row-wise is decided from the traced program's structure only (a fixed list of
operations and their arguments, never weight values or data): linear layers and element-wise
activations, arithmetic with parameters and constants, reductions and reshapes that keep dimension 0.
Anything else (dropout, which draws per edge; a reduction over dimension 0; an unknown call) stays on
the edge side, where it runs exactly as written.

:func:`compile_apply_edge` traces ``apply_edge`` with ``torch.fx`` and returns a :class:`SAGAProgram`:
the vertex programs of both ends, the edge program over their *lifted* values, and the Gather route
(:mod:`pyg_pipe.saga.layer`) read off the edge program's last operations. A function ``torch.fx``
cannot trace (Python control flow on tensor values) is not rewritten: the program then runs
``apply_edge`` itself on the lifted rows, as PyG would.
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

#: parameters ``apply_edge`` may take: vertex data at the two ends, edge data, and PyG's per-edge
#: destination index / destination count (for :func:`torch_geometric.utils.softmax`)
ENDS = ("src", "dst")
EDGE_INPUTS = ("edge_attr", "index", "size_i")
PARAMETERS = ENDS + EDGE_INPUTS

_ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.sigmoid, torch.tanh, torch.relu,
    torch.exp, torch.log, torch.abs, torch.sqrt, torch.rsqrt, torch.sin, torch.cos, torch.clamp, torch.where,
    torch.maximum, torch.minimum, torch.erf, torch.square,
    F.relu, F.leaky_relu, F.elu, F.gelu, F.silu, F.sigmoid, F.tanh, F.softplus, F.mish, F.selu, F.celu,
    F.hardtanh, F.relu6, F.linear,
}
_ELEMENTWISE_METHODS = {
    "add", "sub", "mul", "div", "neg", "pow", "sigmoid", "tanh", "relu", "exp", "log", "abs", "sqrt", "rsqrt",
    "clamp", "square", "contiguous", "float", "double", "__add__", "__mul__", "__sub__", "__truediv__",
}
#: row-wise modules (leaves of the trace); any other module is traced through, or not row-wise
_ROWWISE_MODULES = (nn.Linear, nn.Identity, nn.ReLU, nn.LeakyReLU, nn.Sigmoid, nn.Tanh, nn.ELU, nn.GELU, nn.SiLU,
                    nn.Softplus, nn.PReLU, nn.Mish, nn.SELU, nn.CELU, nn.Hardtanh, nn.ReLU6)


def _pyg_leaves() -> tuple:
    from torch_geometric.nn import Linear as PygLinear
    return (PygLinear,)


def _softmax_functions() -> tuple:
    from torch_geometric.utils import softmax
    return (softmax,)


class _Tracer(fx.Tracer):
    """Traces ``apply_edge`` of a layer (``traced_func_name``), keeping linear layers and PyG's
    ``softmax`` as single operations."""

    def __init__(self):
        super().__init__(autowrap_functions=_softmax_functions())
        self.traced_func_name = "apply_edge"

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, _ROWWISE_MODULES + _pyg_leaves()) or super().is_leaf_module(m, qualname)


def _keeps_rows(dim: Any) -> bool:
    """A dimension argument that is not the vertex/edge dimension 0 (negative counts from the end)."""
    if isinstance(dim, (tuple, list)):
        return len(dim) > 0 and all(_keeps_rows(d) for d in dim)
    return isinstance(dim, int) and not isinstance(dim, bool) and dim != 0


def _rowwise(node: fx.Node, root: nn.Module) -> bool:
    """Whether ``node`` maps each row of its tensor inputs to the same row of its output, on its own."""
    if node.op == "call_module":
        return isinstance(root.get_submodule(node.target), _ROWWISE_MODULES + _pyg_leaves())
    if node.op == "call_function":
        if node.target in _ELEMENTWISE_FUNCTIONS:
            return True
        if node.target in (torch.cat, torch.stack):
            return _keeps_rows(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0))
        if node.target in (torch.sum, torch.mean, torch.amax, torch.amin, torch.prod, torch.logsumexp):
            return _keeps_rows(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None))
        if node.target in (torch.unsqueeze, torch.squeeze, torch.flatten):
            return _keeps_rows(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None))
        if node.target is F.normalize:
            return _keeps_rows(node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 1))
        if node.target is operator.getitem:   # x[..., k] or x[:, a:b]: the first index must be a full slice
            idx = node.args[1]
            first = idx[0] if isinstance(idx, tuple) and idx else idx
            return first is Ellipsis or first == slice(None)
        return False
    if node.op == "call_method":
        name = node.target
        if name in _ELEMENTWISE_METHODS:
            return True
        if name in ("sum", "mean", "amax", "amin", "prod", "logsumexp", "unsqueeze", "squeeze", "softmax",
                    "log_softmax"):
            return _keeps_rows(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None))
        if name in ("view", "reshape"):   # the first size -1 keeps one row per row
            sizes = node.args[1:]
            if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
                sizes = sizes[0]
            return len(sizes) > 0 and sizes[0] == -1
        if name == "flatten":
            start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
            return _keeps_rows(start)
        return False
    return False


@dataclass
class VertexProgram:
    """Per-vertex values of one end (``"src"`` or ``"dst"``), computed before Scatter."""

    end: str
    graph: fx.Graph
    outputs: List[str] = field(default_factory=list)   # names of the values, in order


@dataclass
class SAGAProgram:
    """``apply_edge`` compiled: vertex programs, the edge program and the Gather route.

    ``route`` is one of ``"copy"`` (the message is a source value: Gather aggregates vertex rows),
    ``"weighted"`` (a per-edge weight times a source value), ``"gated"`` (``sigmoid(d_i + s_j) * v_j``)
    or ``"edges"`` (anything else: messages are built per edge and PyG aggregates them); ``route_args``
    names the values the route reads; ``weight`` is the edge sub-program of the weighted route.
    """

    parameters: Tuple[str, ...]
    vertex: Dict[str, VertexProgram]
    edge: Optional[fx.Graph]                       # None: not traced, run apply_edge itself
    route: str = "edges"
    route_args: Tuple[str, ...] = ()
    weight: Optional[fx.Graph] = None
    reason: str = ""                              # why nothing was rewritten, when nothing was

    @property
    def weight_inputs(self) -> Set[str]:
        """The placeholders the weight sub-program reads (computed once)."""
        if not hasattr(self, "_weight_inputs"):
            self._weight_inputs = {n.target for n in self.weight.nodes if n.op == "placeholder"} \
                if self.weight is not None else set()
        return self._weight_inputs

    def hoisted(self, end: str) -> List[str]:
        return self.vertex[end].outputs if end in self.vertex else []


def _deps(graph: fx.Graph) -> Dict[fx.Node, Set[str]]:
    deps: Dict[fx.Node, Set[str]] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            deps[node] = {node.target}
        else:
            deps[node] = set().union(*(deps[a] for a in node.all_input_nodes)) if node.all_input_nodes else set()
    return deps


def compile_apply_edge(layer: nn.Module, rewrite: bool = True) -> SAGAProgram:
    """Traces ``layer.apply_edge`` and splits it (module docstring)."""
    params = tuple(inspect.signature(type(layer).apply_edge).parameters)[1:]
    unknown = [p for p in params if p not in PARAMETERS]
    if unknown:
        raise TypeError(f"{type(layer).__name__}.apply_edge takes {unknown}; a SAGA ApplyEdge takes only "
                        f"{', '.join(PARAMETERS)} (vertex data at the edge's source and destination, edge data, "
                        f"the destination of every edge and the number of destinations).")
    if not rewrite:
        return SAGAProgram(params, {}, None, reason="rewrite=False")
    try:
        traced = _Tracer().trace(layer)
    except Exception as exc:  # noqa: BLE001 - untraceable Python: run apply_edge as written
        return SAGAProgram(params, {}, None, reason=f"apply_edge could not be traced ({type(exc).__name__}: {exc})")
    deps = _deps(traced)
    side: Dict[fx.Node, Optional[str]] = {}   # the end a node can be computed at, "" for constants
    for node in traced.nodes:
        if node.op == "placeholder":
            side[node] = node.target if node.target in ENDS else None
        elif node.op == "output":
            side[node] = None
        elif not deps[node]:   # parameters and what is computed from them alone
            side[node] = ""
        else:
            ends = {side[a] for a in node.all_input_nodes}
            if None in ends or len(ends - {""}) > 1 or not _rowwise(node, layer):
                side[node] = None
            else:
                side[node] = next(iter(ends - {""}), "")
    frontier: Dict[str, List[fx.Node]] = {end: [] for end in ENDS}
    for node in traced.nodes:
        if side[node] in ENDS and any(side[u] is None for u in node.users):
            frontier[side[node]].append(node)
    vertex = {end: _vertex_program(traced, end, frontier[end], side) for end in ENDS if frontier[end]}
    names = {n: f"{side[n]}:{n.name}" for end in ENDS for n in frontier[end]}
    edge = _edge_program(traced, side, names)
    program = SAGAProgram(params, vertex, edge)
    _choose_route(program, edge)
    return program


def _vertex_program(traced: fx.Graph, end: str, outputs: List[fx.Node], side) -> VertexProgram:
    g = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    needed = _ancestors(outputs)
    for node in traced.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            env[node] = g.placeholder("x")
        else:
            env[node] = g.node_copy(node, lambda a: env[a])
    g.output(tuple(env[n] for n in outputs))
    return VertexProgram(end, g, [f"{end}:{n.name}" for n in outputs])


def _ancestors(nodes: List[fx.Node]) -> Set[fx.Node]:
    seen: Set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _edge_program(traced: fx.Graph, side, names: Dict[fx.Node, str]) -> fx.Graph:
    """The per-edge rest: hoisted values become placeholders named ``"<end>:<node>"``."""
    g = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    out = next(n for n in traced.nodes if n.op == "output")
    needed = _ancestors([out])
    for node in traced.nodes:
        if node not in needed or node in env:
            continue
        if node in names:
            env[node] = g.placeholder(names[node])
        elif side[node] in ENDS:
            continue   # computed at a vertex; read through a frontier value
        elif node.op == "placeholder":
            env[node] = g.placeholder(node.target)
        else:
            env[node] = g.node_copy(node, lambda a: env[a])
    return g


# ---- Gather routes --------------------------------------------------------------------------------

def _choose_route(program: SAGAProgram, edge: fx.Graph) -> None:
    out = next(n for n in edge.nodes if n.op == "output")
    result = out.args[0]
    if not isinstance(result, fx.Node):
        return
    if _is_value(result, "src"):
        program.route, program.route_args = "copy", (result.target,)
        return
    if _is_mul(result):
        a, b = result.args[0], result.args[1]
        for gate, value in ((a, b), (b, a)):
            if not (isinstance(gate, fx.Node) and _is_value(value, "src")):
                continue
            terms = _gate_terms(gate)
            if terms is not None:
                program.route, program.route_args = "gated", (terms[0], terms[1], value.target)
                return
            if value not in _ancestors([gate]):   # a weight per edge that does not read the value itself
                program.route, program.route_args = "weighted", (value.target,)
                program.weight = _sub_program(edge, gate)
                return


def _is_value(node, end: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "placeholder" and str(node.target).startswith(end + ":")


def _is_mul(node: fx.Node) -> bool:
    return ((node.op == "call_function" and node.target in (operator.mul, torch.mul))
            or (node.op == "call_method" and node.target in ("mul", "__mul__"))) and len(node.args) == 2 \
        and not node.kwargs


def _gate_terms(node: fx.Node) -> Optional[Tuple[str, str]]:
    """``(dst value, src value)`` when ``node`` is ``sigmoid(d_i + s_j)`` (either order)."""
    is_sigmoid = (node.op == "call_function" and node.target in (torch.sigmoid, F.sigmoid)) or \
        (node.op == "call_method" and node.target == "sigmoid")
    if not is_sigmoid or len(node.args) != 1 or node.kwargs:
        return None
    inner = node.args[0]
    if not (isinstance(inner, fx.Node) and len(inner.args) == 2 and not inner.kwargs and (
            (inner.op == "call_function" and inner.target in (operator.add, torch.add))
            or (inner.op == "call_method" and inner.target in ("add", "__add__")))):
        return None
    a, b = inner.args
    if _is_value(a, "dst") and _is_value(b, "src"):
        return a.target, b.target
    if _is_value(b, "dst") and _is_value(a, "src"):
        return b.target, a.target
    return None


def _sub_program(edge: fx.Graph, result: fx.Node) -> fx.Graph:
    g = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    needed = _ancestors([result])
    for node in edge.nodes:
        if node in needed:
            env[node] = g.node_copy(node, lambda a: env[a])
    g.output(env[result])
    return g


# ---- the Gather route of a PyG layer's own message ---------------------------------------------------

@dataclass
class MessageRoute:
    """What a PyG layer's ``message`` computes, when it is a fused Gather's input: ``value`` is the
    ``*_j`` argument gathered, ``weight`` the sub-program of its per-edge weight (``None``: unweighted),
    reading only arguments that are not lifted vertex data (edge tensors, ``index``, ``size_i``, ...)."""

    value: str
    weight: Optional[fx.Graph] = None


def compile_message(module: nn.Module, none_args: Tuple[str, ...] = ()) -> Optional[MessageRoute]:
    """The route of ``module.message`` called with the arguments ``none_args`` set to ``None``: ``x_j``
    alone, or ``w * x_j`` with ``w`` computed from arguments other than vertex data; ``None`` for any
    other message (and for one ``torch.fx`` cannot trace). Decided from the traced structure only."""
    tracer = _Tracer()
    tracer.traced_func_name = "message"
    try:
        traced = tracer.trace(module, concrete_args={name: None for name in none_args})
    except Exception:  # noqa: BLE001 - untraceable: PyG's own path
        return None
    out = next(n for n in traced.nodes if n.op == "output").args[0]
    if not isinstance(out, fx.Node):
        return None

    def lifted(node) -> bool:
        return isinstance(node, fx.Node) and node.op == "placeholder" and str(node.target)[-2:] in ("_i", "_j") \
            and node.target not in ("edge_index_i", "edge_index_j", "size_i", "size_j")

    def value(node) -> bool:
        return lifted(node) and str(node.target).endswith("_j")

    if value(out):
        return MessageRoute(out.target)
    if _is_mul(out):
        for gate, val in ((out.args[0], out.args[1]), (out.args[1], out.args[0])):
            if value(val) and isinstance(gate, fx.Node) and not any(lifted(n) for n in _ancestors([gate])):
                return MessageRoute(val.target, _sub_program(traced, gate))
    return None


# ---- running a program ----------------------------------------------------------------------------

def run_graph(graph: fx.Graph, root: nn.Module, inputs: Dict[str, Any]) -> Any:
    """Evaluates ``graph`` with ``root``'s modules and attributes; placeholders read ``inputs`` by name."""
    env: Dict[fx.Node, Any] = {}

    def arg(a):
        return fx.node.map_arg(a, lambda n: env[n])

    for node in graph.nodes:
        op = node.op
        if op == "placeholder":
            env[node] = inputs[node.target]
        elif op == "get_attr":
            obj = root
            for part in node.target.split("."):
                obj = getattr(obj, part)
            env[node] = obj
        elif op == "call_module":
            env[node] = root.get_submodule(node.target)(*arg(node.args), **arg(node.kwargs))
        elif op == "call_function":
            env[node] = node.target(*arg(node.args), **arg(node.kwargs))
        elif op == "call_method":
            self_, *rest = arg(node.args)
            env[node] = getattr(self_, node.target)(*rest, **arg(node.kwargs))
        else:   # output
            return arg(node.args[0])
    return None
