"""The call sites a stage meets, recorded on the first pass of each kind of call and checked after.

Every chunk of a pass must make the same layer calls (the ways exchange halo rows at each of them,
and the history is kept per call site), and every way of a stage the same calls as the others. The
first pass of each kind of call (training or inference, and which arguments are given) records its
sites; the ways agree on them; a resumed run checks them against the checkpoint's.
"""
from __future__ import annotations

import zlib
from typing import Dict, List, Optional, Sequence

import torch

from ...model.errors import UnsupportedModelError
from ..context import Site


def site_keys(sites: Sequence[Site]) -> List[str]:
    """One string per site: its key, the source arguments exchanged there, and whether they were clean."""
    return [f"{s.key}:{','.join(s.sources)}:{int(s.clean)}" for s in sites]


def same_as_first_chunk(keys: List[str], reference: List[str]) -> None:
    """Refuses a chunk whose layer calls differ from the pass's first chunk's (data-dependent control flow)."""
    if keys == reference:
        return
    first = next((i for i, (a, b) in enumerate(zip(reference, keys)) if a != b), min(len(reference), len(keys)))
    raise UnsupportedModelError(
        f"The forward made different propagate calls for different chunks (call {first}: "
        f"{reference[first] if first < len(reference) else 'none'} for one chunk, "
        f"{keys[first] if first < len(keys) else 'none'} for another): its control flow depends on the "
        f"data. pyg_pipe needs the same layer calls for every chunk of a step.")


class CallSites:
    """The sites of this stage per kind of call (``kind``: a string naming the mode and argument kinds).

    Args:
        comm: the transport (the ways of a stage agree through it).
        group: the process group of the ways of this stage (``None``: one way).
    """

    def __init__(self, comm, group=None):
        self.comm, self.group = comm, group
        self.table: Dict[str, List[str]] = {}
        self.saved: Dict[str, List[str]] = {}

    def record(self, kind: str, keys: List[str]) -> None:
        """The first pass of ``kind`` met ``keys``: checked against a checkpoint's and among the ways."""
        if kind in self.table:
            return
        saved = self.saved.pop(kind, None)
        if saved is not None and saved != keys:
            raise UnsupportedModelError(
                "The model makes other layer calls than when the checkpoint was saved (the model or its "
                "arguments changed); resume with the same model, or start a new run without ckpt_path.")
        self.table[kind] = keys
        if self.group is not None:
            digest = zlib.crc32("\n".join(keys).encode())
            both = torch.tensor([digest, -digest], dtype=torch.float64, device=self.comm.device)
            self.comm.all_reduce(both, self.group, "agreeing on the layer calls", op="min")
            if float(both[0]) != -float(both[1]):
                raise UnsupportedModelError(
                    "The ways of a pipeline stage made different propagate calls in the same forward (their "
                    "control flow depends on their part of the graph); pyg_pipe needs the same calls on every way.")

    def state_dict(self) -> dict:
        return dict(self.table)

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Sites of a checkpoint: each kind's first pass is checked against them."""
        self.saved = dict(state or {})


def kind_of(training: bool, signature: tuple) -> str:
    """The kind of a call: its mode and a digest of its argument kinds (stable across runs)."""
    return f"{'train' if training else 'eval'}:{zlib.crc32(repr(signature).encode()):08x}"
