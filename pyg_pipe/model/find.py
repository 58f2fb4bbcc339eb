"""Which part of a user's module pyg_pipe runs: the submodule holding the message-passing layers."""
from __future__ import annotations

from typing import Optional

import torch
from torch_geometric.nn import MessagePassing

from .errors import UnsupportedModelError


def pipelined_module(root: torch.nn.Module, attr: Optional[str] = None) -> torch.nn.Module:
    """The module to run through the engine: ``root.<attr>`` when named, else the smallest submodule of
    ``root`` that holds every ``MessagePassing`` layer (the module around a single layer, and above any
    container such as a ``ModuleList``, which has no forward of its own)."""
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
    if len(names) == 1 and common == parts[0]:
        common = common[:-1]  # a single layer: the module around it
    while common and isinstance(root.get_submodule(".".join(common)), (torch.nn.ModuleList, torch.nn.ModuleDict)):
        common = common[:-1]
    return root.get_submodule(".".join(common)) if common else root


def count_layers(module: torch.nn.Module) -> int:
    """Message-passing layers of a model (those not inside another message-passing layer)."""
    names = [n for n, m in module.named_modules() if isinstance(m, MessagePassing)]
    return sum(1 for n in names if not any(n.startswith(o + ".") for o in names))
