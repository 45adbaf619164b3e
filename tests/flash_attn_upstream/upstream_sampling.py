"""Sampling flash-attn's test functions at parametrize time.

flash-attn's test_flash_attn.py stacks up to 13 `@pytest.mark.parametrize` decorators per test
function: 508,777 cases in all, which take minutes just to collect. Sampling after collection
(deselecting items) pays that cost in full, so this module samples before pytest expands the
decorators: it replaces a function's stacked parametrize marks by ONE mark that lists only the
drawn combinations, with the node ids pytest would have given them in the full product (so a
failing id can be rerun against the unsampled file).

    plan = plan_module(functions, total=3000, seed=0, max_seqlen=None)   # {name: n drawn}
    sample_function(func, n, seed, max_seqlen)                           # rewrites func's marks

Draws are seeded per function name (not by Python's salted hash()), so every process, xdist
workers included, draws the same cases, and adding a function does not change the others' draws.
"""

from __future__ import annotations

import math
import random

import pytest
from _pytest.mark.structures import ParameterSet

SAMPLED = "_flashkit_sampled"  # attribute set on a function whose marks were rewritten


class Axis:
    """One parametrize mark: argnames and its rows (one tuple of values per parameter set)."""

    def __init__(self, mark, max_seqlen: int | None):
        if set(mark.kwargs) - {"argnames", "argvalues"} or len(mark.args) > 2:
            raise NotImplementedError(f"sampling supports plain parametrize marks, got {mark}")
        argnames = mark.args[0] if mark.args else mark.kwargs["argnames"]
        argvalues = mark.args[1] if len(mark.args) > 1 else mark.kwargs["argvalues"]
        if isinstance(argnames, str):
            argnames = [name.strip() for name in argnames.split(",") if name.strip()]
        self.argnames = list(argnames)
        single = len(self.argnames) == 1
        rows = []
        for index, entry in enumerate(argvalues):
            if isinstance(entry, ParameterSet):
                raise NotImplementedError(f"sampling supports plain values, got {entry}")
            row = (entry,) if single else tuple(entry)
            named = zip(row, self.argnames, strict=True)
            ids = "-".join(_idval(value, name, index) for value, name in named)
            if _within(row, self.argnames, max_seqlen):
                rows.append((row, ids))
        self.rows = rows


def _idval(value, argname: str, index: int) -> str:
    """The id pytest gives one parameter value (its IdMaker's rules for the types flash-attn's
    tests use); anything else is named by argument and index, e.g. `dtype1`."""
    if isinstance(value, str):
        return value.encode("unicode_escape").decode("ascii")
    if value is None or isinstance(value, float | int | bool | complex):
        return str(value)
    if isinstance(getattr(value, "__name__", None), str):
        return value.__name__
    return f"{argname}{index}"


def _within(row, argnames, max_seqlen) -> bool:
    """False when an integer argument named like a sequence length exceeds max_seqlen."""
    if max_seqlen is None:
        return True
    return all(not ("seqlen" in name and type(value) is int and value > max_seqlen)
               for value, name in zip(row, argnames, strict=True))


def axes(func, max_seqlen: int | None = None) -> list[Axis]:
    """func's parametrize marks in the order pytest applies them (the decorator nearest the
    function first; its values vary slowest in the product and come first in the id)."""
    marks = getattr(func, "pytestmark", [])
    return [Axis(mark, max_seqlen) for mark in marks if mark.name == "parametrize"]


def product_size(func, max_seqlen: int | None = None) -> int:
    """How many cases func has (after the max_seqlen filter); 1 when it is not parametrized."""
    return math.prod(len(axis.rows) for axis in axes(func, max_seqlen))


def plan_module(sizes: dict[str, int], total: int | None) -> dict[str, int]:
    """How many cases each function gets out of `total`: every function the same share, capped
    at its own size, with what small functions leave spread over the larger ones (water
    filling); the remainder of the division goes one each to the largest functions, ties by
    name. total=None keeps every case."""
    if total is None or total >= sum(sizes.values()):
        return dict(sizes)
    if total < len(sizes):
        raise ValueError(f"asked for {total} cases over {len(sizes)} test functions: "
                         "every function needs at least one")
    level = _water_level(sizes.values(), total)
    plan = {name: min(size, level) for name, size in sizes.items()}
    spare = total - sum(plan.values())
    for name in sorted((n for n in sizes if sizes[n] > level), key=lambda n: (-sizes[n], n)):
        if spare == 0:
            break
        plan[name] += 1
        spare -= 1
    return plan


def _water_level(sizes, total: int) -> int:
    """The largest share q with sum(min(size, q)) <= total (binary search)."""
    low, high = 0, max(sizes)
    while low < high:
        mid = (low + high + 1) // 2
        if sum(min(size, mid) for size in sizes) <= total:
            low = mid
        else:
            high = mid - 1
    return low


def draw(name: str, size: int, n: int, seed: int) -> list[int]:
    """n distinct case indices out of size, sorted (product order), seeded by (seed, name)."""
    return sorted(random.Random(f"{seed}:{name}").sample(range(size), n))


def sample_function(func, n: int, seed: int, max_seqlen: int | None = None) -> None:
    """Replace func's parametrize marks by one mark holding n drawn cases of their product.

    The product is indexed as pytest expands it: the first mark's values vary slowest. Other
    marks (skipif, ...) stay as they were."""
    if getattr(func, SAMPLED, False):
        return
    func_axes = axes(func, max_seqlen)
    size = math.prod(len(axis.rows) for axis in func_axes)
    if func_axes:
        argnames = [name for axis in func_axes for name in axis.argnames]
        values, ids = [], []
        for index in draw(func.__name__, size, n, seed):
            row, row_ids = (), []
            for axis in reversed(func_axes):  # the last mark varies fastest
                index, position = divmod(index, len(axis.rows))
                row = axis.rows[position][0] + row
                row_ids.insert(0, axis.rows[position][1])
            values.append(row)
            ids.append("-".join(row_ids))
        others = [mark for mark in func.pytestmark if mark.name != "parametrize"]
        func.pytestmark = others + [pytest.mark.parametrize(argnames, values, ids=ids).mark]
    setattr(func, SAMPLED, True)
