"""Cutting a traced program into consecutive pipeline stages, and who owns which parameter.

A program (:mod:`pyg_pipe.model.trace`) has one *unit* per layer (a module holding a
``MessagePassing`` layer). :func:`layer_groups` groups the steps into one group per unit, and
:func:`split` gives each stage a run of consecutive groups (balanced by cost with :func:`balance`),
or cuts where the user marked ``pipe_split()``.

What crosses a cut is every value defined before it and used after it, except values any stage can
compute from the inputs itself (parameter-free and not random: ``data.x``, ``x.size(0)``,
``edge_index.flip(0)``), which each stage recomputes. Values crossing a cut travel per chunk
(:mod:`pyg_pipe.engine.runtime.link`), whatever their shape: node tensors, edge tensors (an edge encoder's
output), tuples of them. A parameter used by several stages (a module reused at two depths) is
*shared*: its gradient is summed over the stages that use it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

from .trace import Program, SplitPoint, pipe_split


@dataclass
class Stage:
    """The part of a program one pipeline stage runs.

    Attributes:
        index: stage number s (0 = first).
        steps: the fx nodes it runs, in order (its own, and the recomputable ones it needs).
        inputs: values received from stage s-1, in a fixed order.
        outputs: values sent to stage s+1; for the last stage, the program's output.
        activation: the received value feeding its first unit (stage activation / gradient traffic;
            every other received value is *carried*).
        modules: targets of the modules it calls and of the attributes it reads.
    """

    index: int
    steps: List[fx.Node]
    inputs: List[str]
    outputs: List[str]
    activation: Optional[str]
    modules: Set[str] = field(default_factory=set)


def layer_groups(program: Program) -> List[List[fx.Node]]:
    """Groups the steps into one group per unit, cut where the fewest computed values are live.

    Steps before the first unit join the first group, steps after the last join the last. Between two
    units the boundary is put where the fewest values are live (defined before, used after), since
    those are what a cut there would send: after a residual addition rather than before the next
    layer. Ties go to the latest position.
    """
    steps = program.steps
    index = {n.name: i for i, n in enumerate(steps)}
    last_use: Dict[str, int] = {}
    memo: Dict[str, bool] = {}
    for i, n in enumerate(steps):
        for a in n.all_input_nodes:
            if a.name in index:
                last_use[a.name] = i
    for a in program.output.all_input_nodes:
        if a.name in index:
            last_use[a.name] = len(steps)
    units = [index[u.name] for u in program.units]

    def live(b: int) -> int:
        return sum(1 for n in steps[:b] if last_use.get(n.name, -1) >= b and not program.recomputable(n, memo))

    starts = [0]
    for a, b in zip(units[:-1], units[1:]):
        starts.append(min(range(a + 1, b + 1), key=lambda k: (live(k), -k)))
    bounds = starts + [len(steps)]
    return [list(steps[bounds[k]:bounds[k + 1]]) for k in range(len(units))]


def marked_segments(program: Program) -> List[List[fx.Node]]:
    """The steps between the user's ``pipe_split()`` marks."""
    segments: List[List[fx.Node]] = [[]]
    for n in program.steps:
        if n in program.splits:
            segments.append([])
        else:
            segments[-1].append(n)
    return segments


def stage_groups(program: Program,
                 split_points: Optional[Dict[str, SplitPoint]] = None) -> Tuple[List[List[fx.Node]], bool]:
    """``(groups, forced)``: the layer groups (:func:`layer_groups`), or the user's marked segments
    (``forced``): ``pipe_split()`` calls in the forward, or ``split_points={"name": SplitPoint.BEGINNING
    | END}``, which cut before / after that module's call."""
    if split_points:
        _mark(program, split_points)
    if program.splits:
        return marked_segments(program), True
    return layer_groups(program), False


def _mark(program: Program, split_points: Dict[str, SplitPoint]) -> None:
    """Inserts a ``pipe_split`` node before / after the first / last call of each named module."""
    for name, point in split_points.items():
        calls = [n for n in program.graph.nodes if n.op == "call_module"
                 and (n.target == name or n.target.startswith(name + "."))]
        if not calls:
            raise ValueError(f"split_points names '{name}', but the traced forward calls no module of that name; "
                             f"use the qualified name of a submodule (e.g. 'convs.4').")
        anchor = calls[0] if point == SplitPoint.BEGINNING else calls[-1]
        where = program.graph.inserting_before(anchor) if point == SplitPoint.BEGINNING else \
            program.graph.inserting_after(anchor)
        with where:
            node = program.graph.call_function(pipe_split, ())
        program.splits.append(node)
    order = {n: i for i, n in enumerate(program.graph.nodes)}
    program.splits.sort(key=order.__getitem__)


def balance(costs: Sequence[float], num_stages: int) -> List[int]:
    """Splits consecutive costs into ``num_stages`` contiguous blocks minimising the largest block.

    Returns the number of items in each block (every block gets at least one). Dynamic programme
    over (items, stages), O(S·L²).
    """
    n = len(costs)
    if num_stages > n:
        raise ValueError(f"cannot split {n} layers into {num_stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i] - 1e-12:
                    best[s][i], cut[s][i] = v, j
    sizes, i = [], n
    for s in range(num_stages, 0, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def split(program: Program, groups: List[List[fx.Node]], sizes: Sequence[int]) -> List[Stage]:
    """Stage ``s`` runs ``sizes[s]`` consecutive ``groups``; returns every stage's steps and what
    crosses its cuts."""
    if sum(sizes) != len(groups) or min(sizes) < 1:
        raise ValueError(f"stage sizes {list(sizes)} must be positive and sum to {len(groups)}")
    stage_of: Dict[str, int] = {}
    own: List[List[fx.Node]] = []
    g = 0
    for s, count in enumerate(sizes):
        steps = [n for grp in groups[g:g + count] for n in grp]
        g += count
        own.append(steps)
        for n in steps:
            stage_of[n.name] = s
    S = len(sizes)
    order = {n.name: i for i, n in enumerate(program.graph.nodes)}
    memo: Dict[str, bool] = {}
    out_nodes = program.output.all_input_nodes  # what the forward returns (a tensor, or a tuple / dict of them)

    # every stage runs its own steps and recomputes the recomputable values it needs
    stage_steps: List[List[fx.Node]] = []
    for s in range(S):
        need: Dict[str, fx.Node] = {n.name: n for n in own[s]}
        frontier = list(own[s])
        while frontier:
            n = frontier.pop()
            for a in n.all_input_nodes:
                if a.op != "placeholder" and a.name not in need and stage_of.get(a.name) != s \
                        and program.recomputable(a, memo):
                    need[a.name] = a
                    frontier.append(a)
        stage_steps.append(sorted(need.values(), key=lambda n: order[n.name]))

    # values crossing cut s (entering stage s): defined earlier, used at or after s, not recomputable
    last_use: Dict[str, int] = {}
    for s in range(S):
        for n in stage_steps[s]:
            for a in n.all_input_nodes:
                last_use[a.name] = max(last_use.get(a.name, -1), s)
    for out_node in out_nodes:
        last_use[out_node.name] = S
    crossing: List[List[str]] = [[] for _ in range(S)]
    for n in program.steps:
        if n.name not in stage_of or program.recomputable(n, memo):
            continue
        for s in range(stage_of[n.name] + 1, min(last_use.get(n.name, -1), S - 1) + 1):
            crossing[s].append(n.name)
    for out_node in out_nodes:
        if stage_of.get(out_node.name, S - 1) != S - 1 and not program.recomputable(out_node, memo):
            for s in range(stage_of[out_node.name] + 1, S):
                if out_node.name not in crossing[s]:
                    crossing[s].append(out_node.name)

    stages = []
    for s in range(S):
        steps = stage_steps[s]
        units = [n for n in steps if n in program.units and stage_of.get(n.name) == s]
        inputs = crossing[s] if s > 0 else []
        outputs = crossing[s + 1] if s + 1 < S else [n.name for n in out_nodes]
        activation = None
        if inputs:
            first = [a.name for a in units[0].all_input_nodes] if units else []
            activation = next((a for a in first if a in inputs), inputs[0])
        mods = {n.target for n in steps if n.op in ("call_module", "get_attr")}
        stages.append(Stage(s, steps, inputs, outputs, activation, mods))
    return stages


def parameter_stages(root: torch.nn.Module, stages: List[Stage]) -> Dict[str, Set[int]]:
    """Every parameter and buffer name of ``root`` -> the stages that use it (empty: unused)."""
    out: Dict[str, Set[int]] = {}
    targets = [(m, st.index) for st in stages for m in st.modules]
    for name, _ in list(root.named_parameters()) + list(root.named_buffers()):
        out[name] = {s for prefix, s in targets if name == prefix or name.startswith(prefix + ".")}
    return out
