"""A module's ``forward`` routed elsewhere while the engine is installed, without wrapping the module.

The engine routes the user's model through itself (:mod:`.engine`) and graph-wide modules through the
statistics (:mod:`.runtime.statistics`) by setting an instance attribute ``forward``, removed at uninstall, so
the model object, its class and its ``state_dict`` stay the user's.
"""
from __future__ import annotations

import types
from typing import Callable

import torch


class Rerouted:
    """A module's ``forward`` while the engine is installed: calls ``route(*args)`` instead.

    Set as an instance attribute and removed at uninstall. A deep copy of the module (taken while
    installed) gets the module's own forward back, bound to the copy, so copies are plain modules.
    """

    def __init__(self, module: torch.nn.Module, route: Callable, plain: Callable):
        self.module, self.route, self.plain = module, route, plain

    @torch._dynamo.disable  # inside a model given to torch.compile, the engine runs eagerly (its per-chunk Python)
    def __call__(self, *args, **kwargs):
        return self.route(*args, **kwargs)

    def __deepcopy__(self, memo):
        copy = memo.get(id(self.module))
        return types.MethodType(self.plain, copy) if copy is not None else self.plain


def caller(module: torch.nn.Module) -> str:
    """The innermost method of ``module`` or one of its submodules on the stack now (else of any module), other
    than the layers' own calls, for a message."""
    import inspect
    owners = {id(m) for m in module.modules()}
    frame, other = inspect.currentframe(), None
    while frame is not None:
        self_ = frame.f_locals.get("self")
        if isinstance(self_, torch.nn.Module) and frame.f_code.co_name not in CALLS:
            name = f"{type(self_).__name__}.{frame.f_code.co_name}"
            if id(self_) in owners:
                return name
            other = other or name
        frame = frame.f_back
    return other or "another method"


CALLS = ("_call_impl", "_wrapped_call_impl", "inner", "forward", "propagate")
