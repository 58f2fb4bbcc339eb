"""The arguments of a call of the user's model, and what each is (:mod:`.localize` cuts them to a chunk).

The engine replaces ``model(...)`` while it trains; every call's arguments are classified once:

========== ========================================================================================
graph      ``edge_index`` (a ``[2, E]`` integer tensor) or a sparse ``adj_t`` -> the chunk's local graph
node       one row per vertex (``x``, ``y``, masks, ...)           -> the chunk's rows
edge       one row per edge (``edge_weight``, ``edge_attr``, ...)  -> the chunk's local edges
other      anything else (``None``, numbers, other tensors)       -> unchanged
========== ========================================================================================

A ``Data`` argument (``forward(self, data)``) is cut attribute by attribute, with PyG's own notion of
node and edge attributes. Node inputs handed to the model are *clean*: a layer that receives one
unchanged gets its true halo rows from the whole input, with no exchange (:mod:`pyg_pipe.engine.step.layers`).
"""
from __future__ import annotations

import copy

from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from .errors import UnsupportedModelError

EDGE_NAMES = ("edge_weight", "edge_attr", "edge_type", "edge_label", "edge_mask")


def is_graph_tensor(value: Any) -> bool:
    """True for ``edge_index`` ([2, E] integer tensor) and sparse adjacency matrices."""
    if isinstance(value, Tensor):
        if value.layout != torch.strided:
            return True
        return value.dim() == 2 and value.size(0) == 2 and not value.is_floating_point() \
            and value.dtype != torch.bool
    return type(value).__name__ == "SparseTensor"


def graph_edges(graph: Tensor) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(src, dst, values)`` of an ``edge_index`` or of a sparse ``adj_t`` (rows are destinations)."""
    if type(graph).__name__ == "SparseTensor":
        raise UnsupportedModelError(
            "torch_sparse.SparseTensor adjacencies are not supported by pyg_pipe yet; pass edge_index or a "
            "torch.sparse CSR/COO adj_t (torch_geometric.transforms.ToSparseTensor(layout=torch.sparse_csr)).")
    if graph.layout == torch.strided:
        return graph[0], graph[1], None
    coo = graph.to_sparse_coo().coalesce()
    dst, src = coo.indices()
    return src, dst, coo.values()


def same_structure(a: Tensor, b: Tensor, version: Optional[int] = None) -> bool:
    """Whether graph tensors ``a`` and ``b`` have the same edges (a sparse graph's values aside). ``version``: that of
    ``a`` when it was seen; the same tensor changed in place since then is another graph (its old edges are gone)."""
    if a is b:
        return version is None or b._version == version
    if a.layout != b.layout or a.shape != b.shape or a.device != b.device:
        return False
    if a.layout == torch.strided:
        return torch.equal(a, b)
    if a.layout == torch.sparse_csr:
        return torch.equal(a.crow_indices(), b.crow_indices()) and torch.equal(a.col_indices(), b.col_indices())
    return torch.equal(a.coalesce().indices(), b.coalesce().indices())


def same_graph(a: Tensor, b: Tensor) -> bool:
    """Whether graph tensors ``a`` and ``b`` hold the same edges with the same values (a new tensor of the same
    graph every step, as Lightning's move of the batch to the device gives)."""
    if a is b:
        return True
    if not (a.dtype == b.dtype and same_structure(a, b)):
        return False
    if a.layout == torch.strided:
        return True
    if a.layout == torch.sparse_csr:
        return torch.equal(a.values(), b.values())
    return torch.equal(a.coalesce().values(), b.coalesce().values())


def fingerprint(value: Tensor) -> tuple:
    """Tells a tensor's values apart from other values: shape, dtype, the count of non-finite values and
    two sums (plain and position-weighted), computed block by block in float64 (a few MB extra at most).
    Sparse tensors are taken by their indices and values."""
    v = value.detach()
    if v.layout == torch.sparse_coo:
        v = v.coalesce()
        parts = [v.indices().reshape(-1), v.values().reshape(-1)]
    elif v.layout == torch.sparse_csr:
        parts = [v.crow_indices(), v.col_indices(), v.values().reshape(-1)]
    else:
        parts = [v.reshape(-1)]
    sums, offset = torch.zeros(3, dtype=torch.float64, device=v.device), 0   # non-finite, sum, weighted sum
    for part in parts:
        for start in range(0, part.numel(), 1 << 20):
            flat = part[start:start + (1 << 20)].double()
            bad = (~torch.isfinite(flat)).sum()
            flat = torch.nan_to_num(flat, nan=0.5, posinf=1.5, neginf=-1.5)
            pos = torch.arange(offset + 1, offset + flat.numel() + 1, dtype=torch.float64, device=flat.device) % 997
            sums += torch.stack([bad.double(), flat.sum(), (flat * pos).sum()])
            offset += flat.numel()
    bad, total, weighted = sums.tolist()   # (one read on the host, after every block)
    # 12 significant digits: a sum's last bits may differ with the order a reduction runs in
    return (tuple(value.shape), str(value.dtype), int(bad), float(f"{total:.12g}"), float(f"{weighted:.12g}"))


def _untyped(value):
    """PyG's ``EdgeIndex`` (a tensor subclass caching its sort order and CSR) as the plain ``[2, E]`` tensor it
    wraps, also inside a ``Data`` (a shallow copy): the engine cuts it into chunk-local graphs, which are plain."""
    from torch_geometric.data import Data
    if type(value).__name__ == "EdgeIndex" and hasattr(value, "as_tensor"):
        return value.as_tensor()
    if isinstance(value, Data) and any(type(v).__name__ == "EdgeIndex" for _, v in value.items()):
        value = copy.copy(value)
        for key, v in list(value.items()):
            if type(v).__name__ == "EdgeIndex":
                value[key] = v.as_tensor()
    return value


class CallInputs:
    """One call's arguments, with the graph tensors and sizes found in them.

    Attributes:
        args, kwargs: as given.
        graphs: every graph tensor (top level or inside a ``Data``), in order; ``graphs[0]`` is the
            primary graph, which chunks the vertices.
        num_nodes, num_edges: |V| and the primary graph's |E|.
    """

    def __init__(self, args: tuple, kwargs: dict):
        args, kwargs = tuple(_untyped(a) for a in args), {k: _untyped(v) for k, v in kwargs.items()}
        self.args, self.kwargs = args, kwargs
        self.graphs: List[Tensor] = []
        self.data = []
        for value in list(args) + list(kwargs.values()):
            self._scan(value)
        if not self.graphs:
            raise UnsupportedModelError(self._no_graph())
        self.primary = self.graphs[0]
        self.num_nodes = self._num_nodes()
        #: every graph's edge count (an edge tensor is cut with the first graph of its length)
        self.edge_counts = [graph_edges(g)[0].numel() for g in self.graphs]
        self.num_edges = self.edge_counts[0]

    def _scan(self, value) -> None:
        from torch_geometric.data import Data
        if is_graph_tensor(value):
            if not any(value is g for g in self.graphs):
                self.graphs.append(value)
        elif isinstance(value, Data):
            self.data.append(value)
            for _, v in value.items():
                if is_graph_tensor(v):
                    self._scan(v)
        elif isinstance(value, (tuple, list)):
            for v in value:
                self._scan(v)

    def _no_graph(self) -> str:
        """Why no graph was found among the arguments: a malformed ``edge_index``, or none at all."""
        named = [(f"argument {i}", v) for i, v in enumerate(self.args)] + list(self.kwargs.items())
        for d in self.data:
            named += [(f"data.{k}", v) for k, v in d.items()]
        for name, v in named:
            if isinstance(v, Tensor) and v.dim() == 2 and v.size(0) == 2 and v.layout == torch.strided \
                    and (v.is_floating_point() or v.dtype == torch.bool or v.is_complex()):
                return (f"The pipelined model was given {name} of shape {tuple(v.shape)} and dtype {v.dtype}, which "
                        f"looks like an edge_index, but an edge_index must hold integer vertex ids (torch.long). "
                        f"Convert it with edge_index.long() (or build it as a LongTensor).")
        return ("The pipelined model was called without a graph (an edge_index [2, E] tensor or a sparse adj_t "
                "among its arguments, or a Data object holding one). pyg_pipe needs the graph to cut it into "
                "chunks: pass it to forward (forward(x, edge_index) or forward(data)), rather than reading a "
                "global variable inside forward.")

    def _num_nodes(self) -> int:
        if self.data:
            return int(self.data[0].num_nodes)
        g = self.primary
        if g.layout != torch.strided:
            return g.size(0)
        for v in list(self.args) + list(self.kwargs.values()):
            if isinstance(v, Tensor) and v.dim() > 0 and v.layout == torch.strided and not is_graph_tensor(v) \
                    and v.is_floating_point():
                return v.size(0)
        return int(g.max()) + 1 if g.numel() else 0

    def edge_tensors(self, holders: bool = False) -> List[Tensor]:
        """The call's per-edge inputs (edge weights, attributes, sparse adjacency values), in order; ``holders``:
        a sparse adjacency itself instead of its values (the same object from call to call, its version counter
        shared with its values and indices, where its values come out as a new tensor each time)."""
        out: List[Tensor] = []
        for v in list(self.args) + list(self.kwargs.values()):
            self._edge_tensors(v, out, holders)
        return out

    def _edge_tensors(self, v, out: List[Tensor], holders: bool) -> None:
        from torch_geometric.data import Data
        if isinstance(v, Tensor) and v.layout != torch.strided:
            out.append(v if holders else graph_edges(v)[2])
        elif isinstance(v, Tensor) and v.dim() > 0 and not is_graph_tensor(v) and v.size(0) in self.edge_counts \
                and v.size(0) != self.num_nodes:
            out.append(v)
        elif isinstance(v, Data):
            for _, a in v.items():
                self._edge_tensors(a, out, holders)
        elif isinstance(v, (tuple, list)):
            for a in v:
                self._edge_tensors(a, out, holders)

    def refuse_grad(self, model: str) -> None:
        """Refuses an input that requires grad (pyg_pipe does not back-propagate into the inputs of ``model``)."""
        name = next((f"argument {i}" for i, v in enumerate(self.args) if isinstance(v, Tensor) and v.requires_grad),
                    next((k for k, v in self.kwargs.items() if isinstance(v, Tensor) and v.requires_grad), None))
        if name is not None:
            raise ValueError(
                f"Input '{name}' of the distributed model ({model}) requires grad; pyg_pipe does not back-propagate "
                f"into the model's inputs. Move what computes it into the model (layers, or a learned per-vertex "
                f"input, nn.Parameter(num_nodes, d), which each chunk sees its rows of), or under a strategy pass "
                f"model='<attribute>' naming a module that holds both (model='': the LightningModule itself, its "
                f"forward distributed).")


def node_input_bytes(inputs: CallInputs) -> int:
    """The bytes of a call's tensors with a row per vertex (what keeping their chunk rows costs)."""
    return sum(t.numel() * t.element_size() for t in call_tensors(inputs)
               if t.layout == torch.strided and t.dim() > 0 and t.size(0) == inputs.num_nodes)


def call_tensors(inputs: CallInputs) -> List[Tensor]:
    """The tensors of a call, top level and in its ``Data`` objects."""
    values = list(inputs.args) + list(inputs.kwargs.values())
    for d in inputs.data:
        values += [v for _, v in d.items()]
    return [v for v in values if isinstance(v, Tensor)]
