"""The ring: each rank sends tensors to the next rank and receives the previous rank's, async.

With W ranks, the key/value shard that rank r holds at step t came from rank (r - t) mod W.
Forward, W = 4 (KV_s = rank s's key/value shard; arrows are the sends that overlap each step):

    step      rank 0     rank 1     rank 2     rank 3
     0        KV_0       KV_1       KV_2       KV_3      each rank: attend(own Q, held KV),
     1        KV_3       KV_0       KV_1       KV_2      merged into (out, lse) by log-sum-exp,
     2        KV_2       KV_3       KV_0       KV_1      while sending the held KV to rank + 1
     3        KV_1       KV_2       KV_3       KV_0      and receiving the next from rank - 1

Backward, the held KV travels the same way, and with it the gradient accumulators (dK, dV) of
that shard: at each step a rank adds its block's contribution and passes them on. After W steps
they have visited every rank and the last send brings them home: dK_s arrives at rank s.

`Ring.shift(tensors)` posts the sends and receives of one step and returns at once; `.wait()`
on the result gives the received tensors. With one rank it is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Ring", "Pending"]


class Pending:
    """Tensors being received; wait() blocks until they (and this step's sends) are done."""

    def __init__(self, works: list, received: tuple[torch.Tensor, ...],
                 sent: tuple[torch.Tensor, ...] = ()):
        self._works, self._received = works, received
        self._sent = sent  # kept alive until the sends complete

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self._works:
            work.wait()
        return self._received


class Ring:
    """Point-to-point neighbours of this rank in a process group, as a ring."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def source(self, step: int) -> int:
        """The group rank whose key/value shard this rank holds at `step`."""
        return (self.rank - step) % self.world

    def shift(self, tensors: tuple[torch.Tensor, ...]) -> Pending:
        """Send each tensor to the next rank; receive same-shaped ones from the previous."""
        if self.world == 1:
            return Pending([], tensors)
        sent = tuple(t.contiguous() for t in tensors)
        received = tuple(torch.empty_like(t) for t in sent)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return Pending(dist.batch_isend_irecv(ops), received, sent)
