"""The GNNPipe schedule: which chunk each rank runs at each clock, and which halo reads are fresh.

Ranks form a grid of S stages x W ways (:mod:`.grid`); the C chunks are split into W
equal groups, way ``w`` owning chunks ``w·cpw .. (w+1)·cpw - 1`` (``cpw = C / W``). Every step draws
one permutation ``π`` of ``0 .. cpw-1``, the same on every rank; way ``w`` runs its chunk
``w·cpw + π[k]`` at pipeline position ``k`` ("the clock of the chunk"). Stage ``s`` runs position
``k`` at clock tick ``k + s`` of the fill, so with ``o = order(t)``::

    tick      0      1      2     ...   cpw-1     cpw    ...  cpw+S-2
    stage 0  o[0]   o[1]   o[2]   ...  o[cpw-1]
    stage 1         o[0]   o[1]   ...  o[cpw-2]  o[cpw-1]
    ...
    stage S-1                     ...                        o[cpw-1]      (fill, forward)

then the same in reverse order from stage S-1 down to stage 0 (drain, backward), started by the
gradient of the user's loss. The bubble is S-1 ticks per phase.

**Fresh and stale** (the one definition, used by the history store and the halo exchange): when
chunk ``r`` reads the row of a vertex owned by chunk ``o``, the read is *fresh* iff
``clock(o) <= clock(r)``: the owner already ran this step on its way (``clock(o) < clock(r)``),
or runs at the same clock on another way (``clock(o) == clock(r)``, rows exchanged live).
Otherwise the row is *historical* (stale), written in an earlier step.

**Gradients** follow freshness: the drain visits positions in reverse, so the gradient of every
fresh read reaches its owner before the owner's own backward; stale reads have no producer this step
and their gradient is dropped. With ``unbiased_gradients`` (T3) the kept cross-chunk gradients are
scaled by 2, since on average half of a row's readers run after it; reads of a chunk at the same
position on another way are always fresh, so they keep scale 1.

**T1** (``shuffle``): a new order every step, drawn in pairs (the default, ``shuffle=True``): an even step
``t`` draws ``π_t = torch.randperm(cpw)`` seeded with ``seed·1000003 + t``, the odd step after it runs the
reverse::

    π_t = randperm(seed·1000003 + t)            t even
    π_t = reversed(π_{t-1})                     t odd

so over every two steps each chunk of a way reads each other chunk of its way fresh exactly once, and T3's
doubling of the fresh reads' gradients is exact over the pair, not only in expectation. Drawn independently
every step (``shuffle="independent"``, GNNPipe's T1), two chunks a way are one coin a step, and a run of the
same order keeps one direction of every cross-chunk gradient for several steps: the 32-layer GCNII on 2 chunks
a way lost 2.1 points of accuracy that way, 0.5 with the pairs (docs/convergence.md). Without shuffling ``π``
is the identity.
"""
from __future__ import annotations

from typing import List, Union

import torch
from torch import Tensor

from .grid import check_chunks_per_way

#: the values of ``shuffle_chunks`` (module docstring)
SHUFFLES = (True, False, "independent")


class Schedule:
    """Chunk order and freshness for ``num_chunks`` chunks over ``ways`` ways.

    Args:
        num_chunks: C, a multiple of ``ways``.
        ways: W.
        shuffle: T1, a new order every step: ``True`` drawn in pairs (an order, then its reverse),
            ``"independent"`` drawn alone every step, ``False`` the identity (module docstring).
        seed: seed of the order.
        unbiased: T3, scale kept cross-chunk gradients by 2.
    """

    def __init__(self, num_chunks: int, ways: int, shuffle: Union[bool, str] = True, seed: int = 0,
                 unbiased: bool = True):
        check_chunks_per_way(num_chunks, ways)
        self.num_chunks, self.ways = num_chunks, ways
        self.cpw = num_chunks // ways
        self.shuffle, self.seed, self.unbiased = shuffle, seed, unbiased

    def local_order(self, step: int) -> List[int]:
        """``π``: the permutation of chunk positions within a way at ``step``, the same on all ranks."""
        if not self.shuffle or self.cpw == 1:
            return list(range(self.cpw))
        paired = self.shuffle != "independent"
        drawn = step - step % 2 if paired else step
        pi = torch.randperm(self.cpw, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + drawn)).tolist()
        return pi[::-1] if paired and step % 2 else pi

    def order(self, step: int, way: int) -> List[int]:
        """The chunks way ``way`` runs at ``step``, in clock order."""
        return [way * self.cpw + i for i in self.local_order(step)]

    def clocks(self, step: int) -> Tensor:
        """``[C]`` (CPU): the clock (position) of every chunk at ``step``."""
        pi = self.local_order(step)
        clock = torch.empty(self.cpw, dtype=torch.long)
        clock[torch.tensor(pi, dtype=torch.long)] = torch.arange(self.cpw)
        return clock.repeat(self.ways)

    @staticmethod
    def fresh(clock: Tensor, owner: Tensor, reader: int) -> Tensor:
        """Whether reads of rows owned by chunks ``owner`` by chunk ``reader`` are fresh."""
        return clock[owner] <= clock[reader]

    def gradient_scale(self, owner: Tensor, reader: int) -> Tensor:
        """T3 scale of the gradient of a fresh read of ``owner``'s rows by ``reader`` (float, CPU)."""
        if not self.unbiased or self.cpw == 1:
            return torch.ones(owner.numel())
        same_clock_always = (owner % self.cpw) == (reader % self.cpw)
        return torch.where(same_clock_always, 1.0, 2.0)
