"""Counts Python makes plain floats, found in the code that read them (for the row check, :mod:`.rows`).

A number of vertices or edges read from a size during the checked pass is a :class:`~.counts.Count`, followed
through integer arithmetic, and refused where an operation uses it as a value. Python never asks it in three
places: a float on the left of the arithmetic (``1.0 / x.size(0)``: ``float`` answers first, since a count is an
``int``), ``float(n)``, and functions of ``math`` or numpy (``math.sqrt(n)``). What comes out is a plain ``float``,
so ``x * (1.0 / x.size(0))`` ran silently wrong with the graph cut (measured 2026-11-28: off by 0.015 in graph
parallelism, 0.046 with 2 stages x 4 chunks).

So the check notes the lines of the user's code where it handed out a count (and the dimension read), and after the
pass reads the functions holding them: a size read on such a line along that dimension, or a name bound to one (and
to integer arithmetic of it), used in one of those three places, is refused as the count used as a value. The code
is read, not guessed: only sizes the check saw read from vertex (or edge) dimensions count, so ``math.sqrt(x.size(1))``
(the features) runs. Not read: code with no source (a notebook cell without one, compiled code).
"""
from __future__ import annotations

import ast
import linecache
import os
from typing import Dict, Iterable, Optional, Set, Tuple

#: modules whose functions make a float of an int
_FLOATING = ("math", "np", "numpy", "cmath")
#: builtins that keep an integer an integer
_INTEGRAL = ("int", "abs", "max", "min", "round")


def float_use(read_at: Dict) -> Optional[str]:
    """What the check says of the first count made a plain float in the user's code (``read_at``: code object ->
    the ``(line, dimension)`` pairs where it read a count), else ``None``."""
    for code, seen in read_at.items():
        try:
            hit = first_float_use(code, seen)
        except Exception:  # noqa: BLE001 - code this reader cannot follow is not read (never a crash of the run)
            hit = None
        if hit is not None:
            return made_float(f"{os.path.basename(code.co_filename)}:{hit[0]} in {code.co_name}", hit[1])
    return None


def made_float(where: str, text: str = "") -> str:
    return (f"the forward makes a plain Python number of a size it read{f' (`{text}`)' if text else ''} and uses it "
            f"as a value, at {where}")


def first_float_use(code, seen: Set[Tuple[int, int]]) -> Optional[Tuple[int, str]]:
    """The first line of function ``code`` (a code object) where a count it read is made a plain float, and the
    expression doing it; ``seen``: ``(line, dimension)`` pairs where the check handed out a count. ``None`` if there
    is none (or no source to read)."""
    found = [n for n in _functions(code.co_filename) if n.lineno == code.co_firstlineno or (
        getattr(n, "decorator_list", None) and n.decorator_list[0].lineno == code.co_firstlineno)]
    reader = _Reader(seen)
    for tree in found:  # (several lambdas on one line: read them all)
        reader.bind(tree)
    uses = [n for tree in found for n in reader.uses(tree)]
    if not uses:
        return None
    node = min(uses, key=lambda n: (n.lineno, n.col_offset))
    text = ast.get_source_segment(_PARSED[code.co_filename][0], node) or linecache.getline(code.co_filename,
                                                                                            node.lineno).strip()
    return node.lineno, " ".join(text.split())


def _functions(filename: str) -> list:
    """The functions and lambdas of a source file (parsed once per file and version)."""
    source = "".join(linecache.getlines(filename))
    hit = _PARSED.get(filename)
    if hit is None or hit[0] != source:
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            tree = None
        nodes = [] if tree is None else [n for n in ast.walk(tree)
                                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
        hit = _PARSED[filename] = (source, nodes)
    return hit[1]


_PARSED: Dict[str, tuple] = {}


class _Reader:
    """Which expressions of one function hold a count (:meth:`counts`), and where one is made a float."""

    def __init__(self, seen: Iterable[Tuple[int, int]]):
        self.dims: Dict[int, Set[int]] = {}
        for line, dim in seen:
            self.dims.setdefault(line, set()).add(dim)
        self.names: Set[str] = set()   # bound to counts
        self.floats: Set[str] = set()  # bound to floats (``alpha = 0.5``)

    def _read_here(self, node: ast.AST, dim: Optional[int]) -> bool:
        dims = self.dims.get(getattr(node, "lineno", -1))
        return dims is not None and (dim is None or dim in dims)

    def _size(self, node: ast.AST) -> bool:
        """A size read along a dimension the check handed a count out for, on its line."""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("numel", "nelement"):
                return self._read_here(node, None)
            if node.func.attr == "size" and len(node.args) == 1 and isinstance(node.args[0], ast.Constant) and \
                    isinstance(node.args[0].value, int):
                return self._read_here(node, node.args[0].value)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and \
                isinstance(node.slice.value, int) and _whole_size(node.value):
            return self._read_here(node, node.slice.value)
        return False

    def counts(self, node: ast.AST) -> bool:
        """Whether ``node`` is a count: a size read, a name bound to one, integer arithmetic of counts."""
        if self._size(node):
            return True
        if isinstance(node, ast.Name):
            return node.id in self.names
        if isinstance(node, ast.BinOp):
            return (self.counts(node.left) or self.counts(node.right)) and not self.floaty(node.left)
        if isinstance(node, ast.UnaryOp):
            return self.counts(node.operand)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _INTEGRAL:
            return any(self.counts(a) for a in node.args)
        return False

    def bind(self, tree: ast.AST) -> None:
        """The names bound to counts (``n = x.size(0)``, ``n, d = x.size()``, ``m = n - 1``), to a fixed point."""
        while True:
            before = len(self.names) + len(self.floats)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        if isinstance(target, ast.Name) and self.counts(node.value):
                            self.names.add(target.id)
                        elif isinstance(target, ast.Name) and self.floaty(node.value):
                            self.floats.add(target.id)
                        elif isinstance(target, ast.Tuple) and _whole_size(node.value):
                            self.names.update(e.id for i, e in enumerate(target.elts) if isinstance(e, ast.Name)
                                              and self._read_here(node.value, i))
            if len(self.names) + len(self.floats) == before:
                return

    def floaty(self, node: ast.AST) -> bool:
        """An expression Python evaluates to a float before it meets the right operand (a float literal, ``float(..)``,
        a ``math`` function, a name bound to one of those, arithmetic starting with one)."""
        if isinstance(node, ast.Constant):
            return isinstance(node.value, float)
        if isinstance(node, ast.Name):
            return node.id in self.floats
        if isinstance(node, ast.Call):
            f = node.func
            return (isinstance(f, ast.Name) and f.id == "float") or (
                isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in _FLOATING)
        if isinstance(node, ast.BinOp):  # (a count or a tensor on the left answers itself)
            return self.floaty(node.left) or (isinstance(node.left, ast.Constant) and self.floaty(node.right))
        if isinstance(node, ast.UnaryOp):
            return self.floaty(node.operand)
        return False

    def uses(self, tree: ast.AST) -> list:
        """The expressions of ``tree`` that make a count a plain float."""
        found = []
        for node in ast.walk(tree):
            made = False
            if isinstance(node, ast.Call):
                f = node.func
                floating = (isinstance(f, ast.Name) and f.id == "float") or (
                    isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in _FLOATING)
                made = floating and any(self.counts(a) for a in node.args)
            elif isinstance(node, ast.BinOp):
                made = self.floaty(node.left) and self.counts(node.right)
            if made:
                found.append(node)
        return found


def _whole_size(node: ast.AST) -> bool:
    """``x.size()`` or ``x.shape``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size"
            and not node.args) or (isinstance(node, ast.Attribute) and node.attr == "shape")


