"""The pure-torch partitioner of ``partition="greedy"`` (and ``"auto"`` without pymetis): recursive
bisection by size-constrained label propagation, then k-way label-propagation refinement, vectorised over
the edges (:func:`greedy_partition`; :mod:`.partition` calls it)."""
from __future__ import annotations

import math

import torch
from torch import Tensor


# Dense [N, k] neighbour-count matrices are used up to this many entries, sparse counting above.
_DENSE_LIMIT = 1 << 24


# Label propagation stops (or moves on to its next phase) when fewer than this fraction of the
# vertices moved in a round.
_CONVERGED = 0.002


def _keep_best(cand: Tensor, bucket: Tensor, gain: Tensor, room: Tensor, num_buckets: int,
               gen: torch.Generator) -> Tensor:
    """Per bucket, keep the ``room[bucket]`` candidates of highest gain (random tie-break).

    Args:
        cand: LongTensor [c], candidate vertices.
        bucket: LongTensor [N], bucket of every vertex (only ``bucket[cand]`` is read).
        gain: Tensor [N], gain of every vertex's move.
        room: LongTensor [num_buckets], how many candidates each bucket may keep.

    Returns:
        LongTensor [c'] with c' <= c, the kept candidates.
    """
    if cand.numel() == 0:
        return cand
    b = bucket[cand]
    key = -gain[cand].to(torch.float64) + 0.5 * torch.rand(cand.numel(), generator=gen, dtype=torch.float64)
    order = torch.argsort(key)
    order = order[torch.argsort(b[order], stable=True)]      # by bucket, then by decreasing gain
    cand, b = cand[order], b[order]
    count = torch.bincount(b, minlength=num_buckets)
    first = torch.cumsum(count, 0) - count
    rank = torch.arange(cand.numel()) - first[b]
    return cand[rank < room[b]]


def _bisection_gain(row: Tensor, col: Tensor, side: Tensor, num_nodes: int) -> Tensor:
    """For each vertex: (#neighbours on the other side) - (#neighbours on its side): FloatTensor [N]."""
    counts = torch.zeros(num_nodes * 2).index_add_(0, row * 2 + side[col], torch.ones(row.numel()))
    counts = counts.view(num_nodes, 2)
    diff = counts[:, 1] - counts[:, 0]
    return torch.where(side == 0, diff, -diff)


def _recursive_bisection(row: Tensor, col: Tensor, num_nodes: int, num_parts: int, gen: torch.Generator,
                         *, loose_eps: float = 0.25, eps: float = 0.03, loose_rounds: int = 20,
                         tight_rounds: int = 10) -> Tensor:
    """k-way partition by recursive bisection, all groups of one level bisected at once.

    A group that must end up as ``k_g`` parts is split into sides of ``k_g // 2`` and
    ``k_g - k_g // 2`` parts, with target sizes proportional to that. Each bisection starts from a
    random balanced split and runs label propagation restricted to edges inside the group: a vertex
    switches side when more of its neighbours are on the other side, half of the vertices (at random)
    are allowed to move per round to avoid oscillation, and moves are capped per side so that sizes
    stay within ``target * (1 ± eps)``. The first ``loose_rounds`` rounds use the looser
    ``loose_eps`` to let communities form, then over-full sides are trimmed (lowest-loss vertices
    leave first) and ``tight_rounds`` more rounds run under ``eps``.

    Returns:
        LongTensor [N] of part ids in ``[0, num_parts)``.
    """
    group = torch.zeros(num_nodes, dtype=torch.long)
    parts_of_group = torch.tensor([num_parts])
    while bool((parts_of_group > 1).any()):
        num_groups = parts_of_group.numel()
        left = parts_of_group // 2
        share = left.to(torch.float64) / parts_of_group.to(torch.float64)  # target share of side 0
        size_g = torch.bincount(group, minlength=num_groups)

        # random split of every group with exactly the target share on side 0
        order = torch.argsort(torch.rand(num_nodes, generator=gen, dtype=torch.float64))
        order = order[torch.argsort(group[order], stable=True)]
        first = torch.cumsum(size_g, 0) - size_g
        rank = torch.empty(num_nodes, dtype=torch.long)
        rank[order] = torch.arange(num_nodes) - first[group[order]]
        side = (rank >= torch.round(size_g.to(torch.float64) * share).long()[group]).long()

        target = torch.stack([size_g * share, size_g * (1.0 - share)], 1).view(-1)
        splitting = parts_of_group[group] > 1
        inside = (group[row] == group[col]) & splitting[row]
        row_g, col_g = row[inside], col[inside]

        num_splitting = int(splitting.sum())
        it = 0
        while it < loose_rounds + tight_rounds:
            e = loose_eps if it < loose_rounds else eps
            cap = torch.ceil(target * (1.0 + e)).long()
            low = torch.floor(target * (1.0 - e)).long()
            bucket = group * 2 + side
            size = torch.bincount(bucket, minlength=2 * num_groups)
            gain = _bisection_gain(row_g, col_g, side, num_nodes)
            if it == loose_rounds:                              # trim over-full sides to the tight cap
                over = (size - cap).clamp(min=0)
                if bool(over.any()):
                    cand = (splitting & (over[bucket] > 0)).nonzero().view(-1)
                    cand = _keep_best(cand, bucket, gain, over, 2 * num_groups, gen)
                    side = side.clone()
                    side[cand] = 1 - side[cand]
                    bucket = group * 2 + side
                    size = torch.bincount(bucket, minlength=2 * num_groups)
                    gain = _bisection_gain(row_g, col_g, side, num_nodes)
            active = torch.rand(num_nodes, generator=gen) < 0.5
            cand = ((gain > 0) & active & splitting).nonzero().view(-1)
            cand = _keep_best(cand, bucket, gain, (size - low).clamp(min=0), 2 * num_groups, gen)
            cand = _keep_best(cand, group * 2 + 1 - side, gain, (cap - size).clamp(min=0),
                              2 * num_groups, gen)
            if cand.numel():
                side = side.clone()
                side[cand] = 1 - side[cand]
            it += 1
            if cand.numel() <= _CONVERGED * num_splitting:     # settled: tighten, or stop
                if it > loose_rounds:
                    break
                it = loose_rounds

        child_parts = torch.stack([left, parts_of_group - left], 1).view(-1)
        alive = child_parts > 0
        new_id = torch.cumsum(alive.long(), 0) - 1
        group = new_id[group * 2 + side]
        parts_of_group = child_parts[alive]
    return group


def _best_other_part(row: Tensor, col: Tensor, part: Tensor, num_nodes: int, num_parts: int,
                     gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """For each vertex: neighbours in its own part, and the other part holding most neighbours.

    Returns:
        ``(own, best, best_count)``: FloatTensor [N] neighbour count in the vertex's own part,
        LongTensor [N] the other part with most neighbours (random tie-break; when the vertex has
        no neighbour outside its part this is some part with count 0, or its own part on the sparse
        path) and FloatTensor [N] that part's count.
    """
    if num_nodes * num_parts <= _DENSE_LIMIT:
        counts = torch.zeros(num_nodes * num_parts).index_add_(
            0, row * num_parts + part[col], torch.ones(row.numel())).view(num_nodes, num_parts)
        own = counts.gather(1, part[:, None]).squeeze(1)
        noisy = counts + 0.5 * torch.rand(num_nodes, num_parts, generator=gen)
        noisy.scatter_(1, part[:, None], -1.0)
        best = noisy.argmax(1)
        return own, best, counts.gather(1, best[:, None]).squeeze(1)

    key, count = torch.unique(row * num_parts + part[col], return_counts=True)
    vertex, target = key // num_parts, key % num_parts
    is_own = target == part[vertex]
    own = torch.zeros(num_nodes)
    own[vertex[is_own]] = count[is_own].float()
    vertex, target, count = vertex[~is_own], target[~is_own], count[~is_own]
    # unique score per entry: count first, then a random rank
    score = count * count.numel() + torch.randperm(count.numel(), generator=gen)
    top = torch.full((num_nodes,), -1, dtype=torch.long).scatter_reduce_(0, vertex, score, "amax")
    chosen = score == top[vertex]
    best = part.clone()
    best_count = torch.zeros(num_nodes)
    best[vertex[chosen]] = target[chosen]
    best_count[vertex[chosen]] = count[chosen].float()
    return own, best, best_count


def _rebalance(row: Tensor, col: Tensor, part: Tensor, num_parts: int, cap: int,
               gen: torch.Generator) -> Tensor:
    """Move vertices out of parts larger than ``cap`` until no part is.

    Leaving vertices are those that lose fewest internal edges; they go to the other part holding
    most of their neighbours when it has room, and otherwise (last resort) to any part with room.
    Needs ``num_parts * cap >= N``.

    Returns:
        LongTensor [N], part ids with every part size <= ``cap``.
    """
    num_nodes = part.numel()
    for attempt in range(4):
        size = torch.bincount(part, minlength=num_parts)
        over = (size - cap).clamp(min=0)
        if not bool(over.any()):
            return part
        own, best, best_count = _best_other_part(row, col, part, num_nodes, num_parts, gen)
        gain = best_count - own
        cand = (over[part] > 0).nonzero().view(-1)
        cand = _keep_best(cand, part, gain, over, num_parts, gen)          # who leaves
        if attempt < 3:
            cand = _keep_best(cand, best, gain, (cap - size).clamp(min=0), num_parts, gen)
            dest = best[cand]
        else:                                                               # fill rooms in part order
            room = (cap - size).clamp(min=0)
            dest = torch.repeat_interleave(torch.arange(num_parts), room)[:cand.numel()]
        part = part.clone()
        part[cand] = dest
    return part


def _refine_kway(row: Tensor, col: Tensor, part: Tensor, num_parts: int, gen: torch.Generator,
                 *, imbalance: float = 1.1, rounds: int = 20) -> Tensor:
    """Size-constrained k-way label propagation: move vertices to the part holding most neighbours.

    First parts larger than ``cap = ceil(avg * imbalance)`` are trimmed to ``cap``
    (:func:`_rebalance`). Then, per round, a random half of the vertices may move to their best other
    part when that strictly reduces their cut edges; moves are capped so that no part grows beyond
    ``cap`` or shrinks below ``max(1, floor(avg / imbalance))``.

    Returns:
        LongTensor [N], the refined part ids, every part at most ``cap`` vertices.
    """
    num_nodes = part.numel()
    avg = num_nodes / num_parts
    cap = math.ceil(avg * imbalance)
    low = max(1, math.floor(avg / imbalance))
    part = _rebalance(row, col, part, num_parts, cap, gen)
    for _ in range(rounds):
        own, best, best_count = _best_other_part(row, col, part, num_nodes, num_parts, gen)
        gain = best_count - own
        wanted = gain > 0
        if not bool(wanted.any()):
            break
        cand = (wanted & (torch.rand(num_nodes, generator=gen) < 0.5)).nonzero().view(-1)
        size = torch.bincount(part, minlength=num_parts)
        cand = _keep_best(cand, part, gain, (size - low).clamp(min=0), num_parts, gen)
        cand = _keep_best(cand, best, gain, (cap - size).clamp(min=0), num_parts, gen)
        if cand.numel():
            part = part.clone()
            part[cand] = best[cand]
        if cand.numel() <= _CONVERGED * num_nodes:
            break
    return part


def greedy_partition(row: Tensor, col: Tensor, num_nodes: int, num_parts: int,
                      gen: torch.Generator) -> Tensor:
    part = _recursive_bisection(row, col, num_nodes, num_parts, gen)
    return _refine_kway(row, col, part, num_parts, gen)
