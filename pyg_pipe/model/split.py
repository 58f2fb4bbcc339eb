"""Cutting a traced program into consecutive pipeline stages, balanced by measured cost."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set

import torch
import torch.fx as fx

from .program import NODE, Program, UnsupportedModelError


@dataclass
class Stage:
    """The part of a program that one pipeline stage runs.

    Attributes:
        index: stage number s (0 = first).
        steps: the fx nodes this stage runs, in order.
        mp_steps: its message-passing steps.
        inputs: values that cross the cut into this stage (received from stage s-1), in a fixed order.
        outputs: values that cross the cut out of it (sent to stage s+1); for the last stage, the
            program output.
        activation: the received value that feeds the stage's first layer (counted as stage
            activation / gradient traffic); every other received value is a *carried* tensor (GCNII's x0).
        modules: qualified names of the sub-modules this stage calls.
    """

    index: int
    steps: List[fx.Node]
    mp_steps: List[fx.Node]
    inputs: List[str]
    outputs: List[str]
    activation: Optional[str]
    modules: Set[str] = field(default_factory=set)


def layer_groups(program: Program) -> List[List[fx.Node]]:
    """Groups steps into one group per message-passing layer, cut where the fewest values are live.

    A group holds its message-passing step and the row-wise steps around it; steps before the first
    layer join the first group, steps after the last join the last. Between two layers the boundary
    is put where the fewest computed values are live (defined before, used after), since those are
    what a pipeline cut there would send: after a residual addition (``x + conv(relu(norm(x)))``)
    rather than before the next convolution, where both ``x`` and the convolution's input are live.
    Ties go to the latest position (right before the next layer).
    """
    steps = program.steps
    index = {n.name: i for i, n in enumerate(steps)}
    last_use: Dict[str, int] = {}
    for i, n in enumerate(steps):
        for a in n.all_input_nodes:
            if a.name in index:
                last_use[a.name] = i
    for a in program.output.all_input_nodes:
        if a.name in index:
            last_use[a.name] = len(steps)
    mp = [i for i, n in enumerate(steps) if program.is_mp(n)]
    if not mp:
        return []

    def live(b: int) -> int:  # values defined before step b and used at or after it
        return sum(1 for n in steps[:b] if last_use.get(n.name, -1) >= b)

    starts = [0]
    for a, b in zip(mp[:-1], mp[1:]):
        best = min(range(a + 1, b + 1), key=lambda k: (live(k), -k))
        starts.append(best)
    bounds = starts + [len(steps)]
    return [list(steps[bounds[k]:bounds[k + 1]]) for k in range(len(mp))]


def balance(costs: Sequence[float], num_stages: int) -> List[int]:
    """Splits consecutive layer costs into ``num_stages`` contiguous blocks minimising the largest block.

    Returns the number of layers in each block (every block gets at least one layer).
    Dynamic programme over (layers, stages), O(S·L²).
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


def split(program: Program, layers_per_stage: Sequence[int]) -> List[Stage]:
    """Cuts ``program`` so that stage s holds ``layers_per_stage[s]`` consecutive layer groups.

    Computes each stage's received and sent values (everything defined before a cut and used
    after it), and refuses cuts that would carry anything but per-vertex tensors, or a module
    with parameters used on both sides of a cut.
    """
    groups = layer_groups(program)
    if sum(layers_per_stage) != len(groups) or min(layers_per_stage) < 1:
        raise ValueError(f"layers_per_stage={list(layers_per_stage)} must be positive and sum to {len(groups)}")
    stage_of: Dict[str, int] = {}
    stage_steps: List[List[fx.Node]] = []
    g = 0
    for s, count in enumerate(layers_per_stage):
        steps = [n for grp in groups[g:g + count] for n in grp]
        g += count
        stage_steps.append(steps)
        for n in steps:
            stage_of[n.name] = s
    num_stages = len(layers_per_stage)
    out_node = program.output.args[0]

    # last stage (by index) that uses each value; the program output counts as used after the end
    last_use: Dict[str, int] = {}
    for n in program.steps:
        for a in n.all_input_nodes:
            last_use[a.name] = max(last_use.get(a.name, -1), stage_of[n.name])
    last_use[out_node.name] = num_stages

    crossing: List[List[str]] = [[] for _ in range(num_stages + 1)]  # crossing[s]: values entering stage s
    for n in program.steps:
        s0, s1 = stage_of[n.name], last_use.get(n.name, -1)
        for s in range(s0 + 1, min(s1, num_stages) + 1):
            if s == num_stages:
                continue
            if program.kinds[n.name] != NODE:
                raise UnsupportedModelError(
                    f"Value '{n.name}' ({program.kinds[n.name]}) is computed in stage {s0} and used in stage {s}; "
                    f"only per-vertex tensors can cross a pipeline cut. Compute it inside the layer that uses it.")
            crossing[s].append(n.name)

    owner: Dict[str, int] = {}
    stages = []
    for s in range(num_stages):
        steps = stage_steps[s]
        mods = {n.target for n in steps if n.op in ("call_module", "get_attr")}
        for m in mods:
            if m in owner and owner[m] != s and _has_state(program.root, m):
                raise UnsupportedModelError(
                    f"Module '{m}' is used in pipeline stages {owner[m]} and {s}; a parameter can live in only one "
                    f"stage. Give each layer its own module (no weight sharing across distant layers), or use "
                    f"fewer devices.")
            owner.setdefault(m, s)
        mp_steps = [n for n in steps if program.is_mp(n)]
        inputs = crossing[s] if s > 0 else []
        outputs = crossing[s + 1] if s + 1 < num_stages else [out_node.name]
        activation = None
        if inputs:
            first = [a.name for a in mp_steps[0].all_input_nodes if program.kinds[a.name] == NODE]
            activation = next((a for a in first if a in inputs), inputs[0])
        stages.append(Stage(s, steps, mp_steps, inputs, outputs, activation, mods))
    return stages


def _has_state(root: torch.nn.Module, target: str) -> bool:
    try:
        obj = root.get_submodule(target)
    except AttributeError:
        return True  # a parameter fetched with get_attr
    return any(True for _ in obj.parameters()) or any(True for _ in obj.buffers())


def parameter_owner(root: torch.nn.Module, stages: List[Stage]) -> Dict[str, int]:
    """Maps every parameter and buffer name of ``root`` to the stage that updates it.

    Parameters no stage calls (unused modules) are given to stage 0.
    """
    owners: Dict[str, int] = {}
    prefixes = sorted(((m, st.index) for st in stages for m in st.modules), key=lambda x: -len(x[0]))
    for name, _ in list(root.named_parameters()) + list(root.named_buffers()):
        owners[name] = 0
        for prefix, s in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                owners[name] = s
                break
    return owners
