"""Which part of a user's module pyg_pipe runs: the submodule holding the message-passing layers, the methods
of it through which they are called (``forward``; a link predictor's ``encode``), whether a call is handed a
graph, and its tensors with a row per vertex (embedding tables, per-vertex parameters and buffers)."""
from __future__ import annotations

import types
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch_geometric.nn import MessagePassing

from .errors import UnsupportedModelError
from .inputs import is_graph_tensor


def pipelined_module(root: torch.nn.Module, attr: Optional[str] = None) -> torch.nn.Module:
    """The module to run through the engine: ``root.<attr>`` when named, else the smallest submodule of
    ``root`` that holds every ``MessagePassing`` layer (the module around a single layer, and above any
    container such as a ``ModuleList``, which has no forward of its own; the layer itself where the module
    around it is ``root`` and defines no forward: a LightningModule whose steps call ``self.model = SGConv(..)``)."""
    if attr is not None:
        target = root.get_submodule(attr)
        if not any(isinstance(m, MessagePassing) for m in target.modules()):
            raise UnsupportedModelError(f"model='{attr}': that module holds no MessagePassing layer.")
        return target
    names = [name for name, m in root.named_modules() if isinstance(m, MessagePassing)]
    if not names:
        raise UnsupportedModelError(
            f"{type(root).__name__} holds no torch_geometric MessagePassing layer, so a pyg_pipe strategy has "
            f"nothing to pipeline. Use strategy='ddp' for models without graph layers.")
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if len(names) == 1 and common == parts[0] and (len(common) > 1 or _own_forward(root)):
        common = common[:-1]  # a single layer: the module around it (not a LightningModule calling it from its steps)
    while common and isinstance(root.get_submodule(".".join(common)), (torch.nn.ModuleList, torch.nn.ModuleDict)):
        common = common[:-1]
    return root.get_submodule(".".join(common)) if common else root


#: the packages whose classes' methods are the framework's (hooks a user overrides, such as ``training_step``), not
#: methods of a model that pyg_pipe could distribute
_FRAMEWORKS = ("torch.", "lightning.", "pytorch_lightning.")


def _own_forward(module: torch.nn.Module) -> bool:
    """Whether ``module``'s class defines a forward (not only ``nn.Module``'s or ``LightningModule``'s)."""
    return not getattr(type(module).forward, "__module__", "").startswith(_FRAMEWORKS)


def _framework_methods(module: torch.nn.Module) -> set:
    """The method names the framework's base classes of ``module`` define (Lightning's hooks)."""
    return {name for cls in type(module).__mro__ if cls.__module__.startswith(_FRAMEWORKS) for name in vars(cls)}


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped, else ``module``: the engine routes and hooks the original, and its own
    code runs outside the compiler (:class:`~..engine.reroute.Rerouted`), so a compiled model runs eagerly under
    pyg_pipe: the engine's per-chunk Python cannot be captured as one graph."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) and type(module).__name__ == "OptimizedModule" else module


def count_layers(module: torch.nn.Module) -> int:
    """Message-passing layers of a model (those not inside another message-passing layer)."""
    names = [n for n, m in module.named_modules() if isinstance(m, MessagePassing)]
    return sum(1 for n in names if not any(n.startswith(o + ".") for o in names))


def routes_forward(module: torch.nn.Module, fn, methods: Dict[str, types.FunctionType]) -> bool:
    """Whether ``forward`` (plain function ``fn``) itself is distributed: unless its code reaches the layers
    only through other methods that call them (``decode(self.encode(x, edge_index), pairs)``: then those
    are, inside it, and the rest of forward runs as written on their whole output)."""
    if not isinstance(fn, types.FunctionType) or not methods:
        return True
    names = _names(fn.__code__)
    return bool(_holders(module) & names) or not (set(methods) & names)


def _holders(module: torch.nn.Module) -> set:
    """The names of the children that hold a message-passing layer."""
    return {name for name, child in module.named_children()
            if any(isinstance(m, MessagePassing) for m in child.modules())}


def layer_methods(module: torch.nn.Module) -> Dict[str, types.FunctionType]:
    """The methods of ``module`` other than ``forward`` that call its message-passing layers themselves
    (PyG's link predictors train through ``encode(x, edge_index)`` and never call ``forward``): those whose
    code names a child module that holds a ``MessagePassing`` layer. Found from the code, not by running it,
    so every rank finds the same; methods of ``torch.nn`` and of PyG's layers, Lightning's hooks (a
    ``training_step`` that calls the layers computes a loss, not rows), dunders, properties and
    static or class methods are not candidates. Whether a call is distributed is decided per call (it must
    be handed a graph, :mod:`pyg_pipe.engine.engine`)."""
    holders = _holders(module)
    found: Dict[str, types.FunctionType] = {}
    seen = _framework_methods(module)  # (a LightningModule's training_step computes the loss: not a model method)
    for cls in type(module).__mro__:
        if cls is object or cls.__module__.startswith(_FRAMEWORKS) or issubclass(cls, MessagePassing):
            continue
        for name, value in vars(cls).items():
            if name in seen:
                continue
            seen.add(name)
            if (name == "forward" or name.startswith("__") or not isinstance(value, types.FunctionType)
                    or name in module.__dict__):
                continue
            if holders & _names(value.__code__):
                found[name] = value
    return found


def _names(code: types.CodeType) -> set:
    """The attribute and global names a function's code (and the functions and comprehensions in it) loads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def vertex_tables(module: torch.nn.Module, num_nodes: int) -> List[Tuple[torch.nn.Module, str]]:
    """The tensors of ``module`` with one row per vertex, as ``(submodule, attribute)``, found by their type, owner and
    size, never their values:

    * ``nn.Embedding(num_nodes, d)``'s weight (learned node features, LightGCN's embeddings), and a message-passing
      layer's ``weight`` with a row per vertex, which it propagates (PyG's ``SparseLinear(num_nodes, d)``: ``A @ W``,
      LINKX's adjacency embedding);
    * a parameter or buffer of the user's own module (no class of it but ``nn.Module`` from torch or PyG's building
      blocks: not a message-passing layer, not a subclass of ``nn.Linear``) whose first dimension has ``num_nodes``
      entries: a learned per-vertex input (``nn.Parameter(torch.randn(num_nodes, d))``), a per-vertex value computed
      once and kept (a degree normalisation, a positional encoding, ``register_buffer``).

    A chunk sees its rows of each, and their true halo rows where a layer reads them. A tensor of the user's that has
    ``num_nodes`` rows by coincidence (a weight matrix as wide as the graph is large) and is not per vertex is then
    refused by the row check where the graph is cut (its rows combined across vertices, ``x @ W``), and runs unchanged
    with one chunk (the identity order)."""
    from torch_geometric.nn import MessagePassing
    out: List[Tuple[torch.nn.Module, str]] = []
    for m in module.modules():
        if isinstance(m, (torch.nn.Embedding, MessagePassing)):
            if _vertex_weight(m, num_nodes):
                out.append((m, "weight"))
        elif _users_own(type(m)):
            for store in (m._parameters, m._buffers):
                out += [(m, k) for k, t in store.items() if t is not None and t.dim() >= 1 and t.size(0) == num_nodes]
    return out


def _vertex_weight(m: torch.nn.Module, num_nodes: int) -> bool:
    """Whether ``m``'s ``weight`` is a 2-D parameter with a row per vertex (an embedding table, ``SparseLinear``'s)."""
    weight = m._parameters.get("weight")
    return isinstance(weight, torch.nn.Parameter) and weight.dim() == 2 and weight.size(0) == num_nodes


def layer_vertex_tensors(module: torch.nn.Module, num_nodes: int) -> List[Tuple[str, str, str]]:
    """``(layer name, its class, attribute)`` of the tensors with one row per vertex that a message-passing layer of
    the user's own holds itself (found by size, as :func:`vertex_tables`; a ``weight`` it propagates is a table
    there): read inside the layer's forward, they cannot be cut to a chunk's rows, which depend on how the layer is
    called (its rows alone, or with their halo)."""
    from torch_geometric.nn import MessagePassing
    out = []
    for name, m in module.named_modules():
        if isinstance(m, MessagePassing) and not type(m).__module__.startswith("torch_geometric."):
            tables = {"weight"} if _vertex_weight(m, num_nodes) else set()
            out += [(name, type(m).__name__, k) for store in (m._parameters, m._buffers) for k, t in store.items()
                    if k not in tables and t is not None and t.dim() >= 1 and t.size(0) == num_nodes]
    return out


def refuse_layer_tensors(module: torch.nn.Module, num_nodes: int, num_chunks: int) -> None:
    """Where the graph is cut (``num_chunks`` > 1: a plan, or a measuring pass over a chunk), a tensor with a row per
    vertex held by a message-passing layer of the user's own (:func:`layer_vertex_tensors`) is refused by name, with
    the fix, before anything runs (it failed with a size mismatch inside the layer)."""
    found = layer_vertex_tensors(module, num_nodes) if num_chunks > 1 else []
    if found:
        name, cls, attr = found[0]
        raise UnsupportedModelError(
            f"Layer '{name}' ({cls}) holds '{attr}', a tensor with one row per vertex ({num_nodes} rows). With "
            f"num_chunks={num_chunks}, the layer runs on part of the vertices at a time, and pyg_pipe cannot cut "
            f"a tensor a layer holds to the rows each of its calls is given. Hold it in the model instead "
            f"(a buffer or parameter of the model's own module, or a forward argument) and pass it to the layer, "
            f"e.g. self.conv(x + self.{attr}, edge_index): each chunk then sees its rows; or train with one chunk and "
            f"no graph-parallel ways (strategy='gnnpipe', num_chunks=1), which is exact.")


def _users_own(cls: type) -> bool:
    """Whether ``cls`` is a module class of the user's own: none of its classes but ``nn.Module`` comes from torch, nor
    from PyG's building blocks (a subclass of ``nn.Linear`` keeps the meaning of the weight torch gave it); Lightning's
    classes and PyG's models (``torch_geometric.nn.models``: ``class Net(GCN)``) may be among them."""
    def building_block(c: type) -> bool:
        m = c.__module__
        return m.startswith("torch.") or (m.startswith("torch_geometric.") and not m.startswith(_MODELS))
    return all(c in (object, torch.nn.Module) or not building_block(c) for c in cls.__mro__)


_MODELS = "torch_geometric.nn.models."


def tensor_attributes(module: torch.nn.Module) -> Dict[str, Tensor]:
    """The plain tensor attributes of ``module`` (not parameters or buffers; nor the constants torch.fx keeps on
    a module it traces, ``_tensor_constant0`` ...)."""
    return {k: v for k, v in vars(module).items() if isinstance(v, Tensor) and not k.startswith("_tensor_constant")}


def takes_graph(args: tuple, kwargs: dict) -> bool:
    """Whether a call's arguments include a graph (an ``edge_index``, an adjacency, a ``Data``)."""
    from torch_geometric.data import Data
    for value in list(args) + list(kwargs.values()):
        if is_graph_tensor(value) or isinstance(value, Data):
            return True
        if isinstance(value, (tuple, list)) and takes_graph(tuple(value), {}):
            return True
    return False
