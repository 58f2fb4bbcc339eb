"""The rank grid: P = S stages x W graph-parallel ways, rank ``s·W + w`` runs stage ``s`` for way ``w``.

==================== ======= ======= =============================================================
mode                  S       W       what travels
==================== ======= ======= =============================================================
GNNPipe              P       1       stage-cut activations and their gradients (:mod:`..runtime.link`)
graph parallel       1       P       halo rows among the ways at every propagate call (:mod:`..runtime.halo`)
hybrid               S       W       both; weight gradients are summed over the ways of a stage
==================== ======= ======= =============================================================
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch.distributed as dist


class RankGrid:
    """This rank's place in the S x W grid, and the process groups it needs.

    Args:
        rank: this process's global rank.
        world_size: P.
        stages: S.
        ways: W (``S · W`` must equal ``P``).

    Creating a grid with ``W > 1`` calls ``dist.new_group`` for every stage, on every rank, in the
    same order (a collective requirement of ``torch.distributed``).
    """

    def __init__(self, rank: int, world_size: int, stages: int, ways: int):
        if stages * ways != world_size:
            raise ValueError(f"stages={stages} x ways={ways} = {stages * ways} ranks, but {world_size} processes "
                             f"run; choose stages and ways whose product is the number of devices.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the {world_size} processes.")
        self.rank, self.world_size = rank, world_size
        self.stages, self.ways = stages, ways
        self.stage, self.way = rank // ways, rank % ways
        self.stage_group = None
        if ways > 1 and dist.is_initialized():
            for s in range(stages):
                group = dist.new_group([s * ways + w for w in range(ways)])
                if s == self.stage:
                    self.stage_group = group

    def rank_of(self, stage: int, way: Optional[int] = None) -> int:
        """Global rank of ``(stage, way)`` (default: this rank's way)."""
        return stage * self.ways + (self.way if way is None else way)

    @property
    def prev(self) -> Optional[int]:
        """Rank of the previous stage on this way, or ``None`` on the first stage."""
        return self.rank_of(self.stage - 1) if self.stage > 0 else None

    @property
    def next(self) -> Optional[int]:
        """Rank of the next stage on this way, or ``None`` on the last stage."""
        return self.rank_of(self.stage + 1) if self.stage + 1 < self.stages else None

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def owner_ranks(self) -> List[int]:
        """The rank holding the authoritative copy of each stage's parameters (its way 0)."""
        return [self.rank_of(s, 0) for s in range(self.stages)]


def grid_shape(world_size: int, stages: Optional[int], ways: Optional[int], min_ways: int = 1) -> Tuple[int, int]:
    """``(S, W)`` for ``world_size`` devices: as given, the other one derived from the one given, or (both
    ``None``) the fewest ways ``>= min_ways`` that divide the devices, one stage per remaining device."""
    P = world_size
    for name, value in (("stages", stages), ("ways", ways)):
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be a positive number of processes (or None to derive it).")
    if stages is None and ways is None:
        if min_ways > P:
            raise ValueError(f"At least {min_ways} graph-parallel ways are needed, but {P} process(es) run; use at "
                             f"least {min_ways} devices, or strategy='gnnpipe' (which needs no ways).")
        ways = next(w for w in range(max(min_ways, 1), P + 1) if P % w == 0)
    if stages is None:
        if P % ways:
            raise ValueError(f"ways={ways} does not divide the {P} processes; choose a divisor of the device count.")
        stages = P // ways
    if ways is None:
        if P % stages:
            raise ValueError(f"stages={stages} does not divide the {P} processes; choose a divisor of the device "
                             f"count.")
        ways = P // stages
    if stages * ways != P:
        raise ValueError(f"stages={stages} x ways={ways} = {stages * ways} ranks, but {P} processes run; choose "
                         f"stages and ways whose product is the number of devices.")
    return stages, ways


def ways_for_layers(world_size: int, layers: int, min_ways: int = 1) -> Tuple[int, int]:
    """``(S, W)`` with the fewest ways ``>= min_ways`` that leave every stage at least one of ``layers``."""
    P = world_size
    ways = next(w for w in range(max(min_ways, 1), P + 1) if P % w == 0 and P // w <= max(layers, 1))
    return P // ways, ways


def check_chunks_per_way(num_chunks: int, ways: int) -> None:
    """Every way owns the same number of chunks: ``num_chunks`` must be a multiple of ``ways``."""
    if num_chunks % ways:
        raise ValueError(f"num_chunks={num_chunks} must be a multiple of the {ways} graph-parallel ways (each way owns "
                         f"the same number of chunks); use e.g. num_chunks={ways * max(1, num_chunks // ways)}.")
