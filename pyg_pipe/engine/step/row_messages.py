"""What the row check (:mod:`.rows`) says when it refuses: each text names what the forward calls and where
(``found``, from :func:`describe`), why it would differ from one device with the graph cut
(``cut``: ``"num_chunks=4"``), and the fixes that work, ending with the exact way out."""
from __future__ import annotations

import os
from typing import Optional

import torch

#: the way out every refusal names last
EXACT = ("or train with one chunk and no graph-parallel ways, which is exact: on one device, or as a pipeline of the "
         "model's layers (strategy='gnnpipe', num_chunks=1) where its method splits into stages.")
#: the fix named first when the operation found is a normalisation over the vertices written by hand
NORM_FIX = ("For a normalisation over the vertices, use PyG's module for it (torch_geometric.nn's BatchNorm, "
            "InstanceNorm, GraphNorm, PairNorm, LayerNorm(mode='graph')), whose statistics pyg_pipe takes over "
            "the whole graph. ")
#: the sources named for a layer aggregating at edge_index[0] (``Invocation.reverse``)
ENDS = {False: "", True: " (with flow='target_to_source' the sources are edge_index[1], the end the layer reads its "
                         "neighbours at)"}


def _opening(found: str) -> str:
    return f"{found[0].upper()}{found[1:]}"


def combines(found: str, cut: str) -> str:
    """An operation of the forward (or of a layer's, outside ``propagate``) that combines the rows of different
    vertices."""
    return (f"{_opening(found)}. With {cut}, each process runs the forward on part of the vertices at a time (and the "
            f"edges into them), so this would see only those rows and differ from one device. "
            f"{NORM_FIX if 'normalises with statistics' in found else ''}Combine vertex rows inside a MessagePassing "
            f"layer (propagate), compute the graph-wide value outside the model and pass it in, {EXACT} If it pools "
            f"each graph to one row (a readout such as global_add_pool: a graph-level task on many small graphs), no "
            f"graph needs splitting: train with Lightning's strategy='ddp', each process a share of the graphs.")


def unknown(found: str, cut: str) -> str:
    """An operation on vertex rows neither judged by a rule nor known to work row by row."""
    name = found.split("`")[1]
    return (f"{_opening(found)}. With {cut}, each process runs the forward on part of the vertices at a time, and an "
            f"operation that combines them would see only those rows and differ from one device, silently. If "
            f"`{name}` works row by row (each output row from the same input row only), declare it once, at the top "
            f"level of the training script: pyg_pipe.declare_row_wise('{name}'); otherwise compute it outside the "
            f"model and pass it in, {EXACT}")


def at_edges(found: str, cut: str) -> str:
    """A sum per vertex over the graph's edges, or a read of rows at their ends, in the forward."""
    return (f"{_opening(found)}, outside the MessagePassing layers. With {cut}, each process holds the edges into part "
            f"of the vertices at a time (its halo's vertices numbered after them), so this would count part of the "
            f"edges or read rows it does not hold, and differ from one device. Compute per-vertex values of the graph "
            f"in the data pipeline and pass them to forward (a transform, e.g. T.GCNNorm(), or data.deg = "
            f"degree(data.edge_index[1], data.num_nodes)), compute per-edge values inside a layer (message() reads "
            f"x_j / x_i), {EXACT}")


def built_graph(found: str, cut: str) -> str:
    """A graph (a sparse adjacency) built in the forward from the graph's edges."""
    return (f"{_opening(found)}, outside the MessagePassing layers. With {cut}, each process holds the edges into part "
            f"of the vertices at a time (its halo's vertices numbered after them), so the graph built would be part of "
            f"the whole graph, numbered differently. Build it in the data pipeline and pass it to forward (a "
            f"transform, e.g. T.ToSparseTensor(), or data.adj2 = ...: every graph passed to forward is cut into "
            f"chunks), {EXACT}")


def partial_sums(found: str, cut: str, layer: str) -> str:
    """A layer's per-vertex sum over its edges used where it is partial."""
    return (f"{_opening(found)}. With {cut}, layer '{layer}' holds the edges into part of the vertices at a time, so "
            f"such sums are complete for those vertices only. Compute degree normalisations with PyG's gcn_norm "
            f"(pyg_pipe completes it), or pass the per-vertex value to propagate and read it in message() as value_j "
            f"/ value_i (propagate joins the true rows), {EXACT}")


def neighbour_read(found: str, cut: str, layer: str) -> str:
    """A layer's read of its neighbours' rows outside ``propagate``."""
    return (f"{_opening(found)}, outside propagate. With {cut}, layer '{layer}' runs on part of the vertices at a time "
            f"and their neighbours' rows join them only inside propagate, so this read would miss them. Read neighbour "
            f"rows in message() (its x_j / x_i arguments) or edge_updater(), as PyG's layers do, {EXACT}")


def counted(found: str, cut: str) -> str:
    """The number of vertices read from a size, or positions numbered from it, used as values (:mod:`.counts`)."""
    return (f"{_opening(found)}. With {cut}, each process runs the forward on part of the vertices at a time: "
            f"x.size(0) is the number of rows it holds, edge_index.size(1) the number of edges into them, and "
            f"torch.arange(x.size(0)) numbers them from 0 on every chunk, not by vertex, so this would differ from one "
            f"device. Pass what is per vertex as an input of forward, "
            f"which pyg_pipe cuts like x: the vertices' ids (data.n_id = torch.arange(data.num_nodes); model(x, "
            f"edge_index, n_id); self.emb(n_id)) or the positional encoding itself (e.g. T.AddLaplacianEigenvectorPE), "
            f"and the graph's sizes as numbers (data.num_nodes, data.num_edges); {EXACT}")


def describe(frame, names, name: str, what: str, v: Optional[int], edges: bool = False) -> str:
    """What the forward calls and where: the operation ``name`` and what it does (``what``, ``{rows}`` for the rows),
    the dimension ``v`` with a row per vertex (or edge), and the model's module and line (or the traced step) that
    called it, found by walking up from ``frame`` to the engine's runner of the forward (``names``: module object id
    -> its name in the model)."""
    from ..runtime.program import RUNNER_CODES, STEP_CODE
    where, module = "", None
    while frame is not None and frame.f_code not in RUNNER_CODES:
        obj = frame.f_locals.get("self")
        if module is None and isinstance(obj, torch.nn.Module) and id(obj) in names:
            name_in_model = names[id(obj)]
            module = f"module '{name_in_model}' ({type(obj).__name__})" if name_in_model else \
                f"{type(obj).__name__}.{frame.f_code.co_name}"
        if frame.f_code is STEP_CODE:  # a step of a traced program
            node = frame.f_locals.get("node")
            where = where or (f"traced step '{node.name}'" if node is not None else "")
        elif not where and not frame.f_code.co_filename.startswith("<") and not frame.f_globals.get(
                "__name__", "").startswith(("torch", "lightning", "pyg_pipe.engine")):  # ("<string>": made by pyg_pipe)
            where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    what = what.format(rows=f"the rows of different {'edges' if edges else 'vertices'}")
    dim = f" (dimension {v} has one row per {'edge' if edges else 'vertex'})" if v is not None else ""
    return f"{module or 'the forward'} calls `{name}`, which {what}{dim}{f', at {where}' if where else ''}"


def failed(method: str, exc: BaseException, cut: str) -> str:
    """The distributed method raised on its first pass over part of the graph (an error the row check did not
    explain): what is cut and what is not, and how to tell the model's own error from the cut's."""
    said = f"{type(exc).__name__}{f': {exc}' if str(exc) else ''}"
    return (f"{method} raised {said} on its first pass over part of the graph. With {cut}, each process runs it on "
            f"part of the vertices at a time: its tensors with a row per vertex (or per edge) are cut to those "
            f"vertices, anything else is handed whole, so a tensor with a row per some vertices only (the labels of "
            f"the training vertices, y[train_mask], beside a mask that is cut) no longer matches them. Pass such "
            f"values with a row per vertex (y and the mask, both cut), or run this method on one device. If it "
            f"raises on one device too, the error is the model's own.")
