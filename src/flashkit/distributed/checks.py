"""Checks that need the whole group: the process group itself, and that every rank agrees.

A collective call with inputs that differ across ranks either hangs or computes nonsense, so the
entry points all-gather a small signature of each rank's call (shapes, dtype, mask, layout,
and whether the rank's own checks passed) and compare. Every rank then raises the same error,
naming the argument; none is left waiting in a collective the others skipped.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

__all__ = ["resolve_group", "agree"]


def resolve_group(group):
    """The process group to use (None = the default group); raises if it cannot be used."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first")
    if group is None:
        return dist.group.WORLD
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("group: this process is not a member of the group (new_group gave "
                         "it GroupMember.NON_GROUP_MEMBER); call only on the group's ranks")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup or None, got "
                        f"{type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member "
                         "of the group")
    return group


def as_int(x) -> int:
    """An int, bool or float as an int64 value (floats bit for bit) for the signature."""
    if isinstance(x, float):
        return struct.unpack("<q", struct.pack("<d", x))[0]
    return int(x)


def agree(group, device: torch.device, fields: list[tuple[str, object]],
          error: Exception | None) -> None:
    """A collective: raise unless every rank passed its own checks and has the same fields.

    fields: (description, value) pairs, values ints, bools or floats (None is -1); error: the
    exception this rank's own checks raised, or None. The same number of fields on every rank.
    """
    values = [1 if error is not None else 0] + [as_int(-1 if v is None else v)
                                                  for _, v in fields]
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    table = [row.tolist() for row in gathered]
    if error is not None:
        raise error
    failed = [rank for rank, row in enumerate(table) if row[0]]
    if failed:
        raise ValueError(f"rank(s) {failed} of the group rejected their inputs (see the error "
                         "raised there); every rank must call with valid inputs")
    for n, (name, value) in enumerate(fields, start=1):
        column = [row[n] for row in table]
        if any(c != column[0] for c in column):
            shown = column if not isinstance(value, float) else [
                struct.unpack("<d", struct.pack("<q", c))[0] for c in column]
            raise ValueError(f"{name} differs across the ranks of the group: {shown} (by rank); "
                             "every rank must make the same call on an equal shard")
