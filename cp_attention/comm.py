"""All torch.distributed calls of the library go through :class:`Comm`.

Point-to-point traffic is queued with :meth:`Comm.send` / :meth:`Comm.recv`, posted together by
:meth:`Comm.commit` (asynchronously) and completed by :meth:`Pending.wait`, so the ring can post the
next exchange before it computes the current block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Comm", "Pending"]


class Pending:
    """In-flight point-to-point operations; keeps their tensors alive until :meth:`wait`."""

    def __init__(self, works: list, tensors: list[torch.Tensor]):
        self._works = works
        self._tensors = tensors

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works, self._tensors = [], []


class Comm:
    """The process group of one context-parallel job: rank, size, collectives and p2p.

    ``group=None`` means the default (WORLD) group when torch.distributed is initialised, and a
    single-process "group" of size 1 otherwise; ``single=True`` is always that size-1 group.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, single: bool = False):
        self.group = group
        self.distributed = not single and dist.is_available() and dist.is_initialized()
        if group is not None and single:
            raise ValueError("Comm(group, single=True): a single-device comm takes no group")
        if group is not None and not self.distributed:
            raise ValueError("a process group was given but torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group first or pass group=None")
        if self.distributed:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend = dist.get_backend(group)
        else:
            self.rank, self.world_size, self.backend = 0, 1, None
        self._ops: list[tuple[str, torch.Tensor, int, int]] = []

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, world_size={self.world_size}, backend={self.backend})"

    def _global(self, rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return rank
        return dist.get_global_rank(self.group, rank)

    @property
    def device(self) -> torch.device:
        """Where collective buffers live: the current CUDA device for NCCL, else CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- collectives -----------------------------------------------------------------------------

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere), in rank order, on ``tensor``'s device."""
        if self.world_size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor.contiguous(), group=self.group)
        return out

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_object(self, obj) -> list:
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    # -- point to point --------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Queue sending ``tensor`` (contiguous) to group rank ``dst``."""
        self._ops.append(("send", tensor, dst, tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        """Queue receiving into ``tensor`` (contiguous) from group rank ``src``."""
        self._ops.append(("recv", tensor, src, tag))

    def commit(self) -> Pending:
        """Post every queued operation asynchronously."""
        ops, self._ops = self._ops, []
        if not ops:
            return Pending([], [])
        if self.backend == "nccl":
            p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, self._global(peer),
                              group=self.group, tag=tag) for kind, t, peer, tag in ops]
            works = dist.batch_isend_irecv(p2p)
        else:
            works = [(dist.isend if kind == "send" else dist.irecv)(t, self._global(peer), group=self.group,
                                                                    tag=tag)
                     for kind, t, peer, tag in ops]
        return Pending(works, [t for _, t, _, _ in ops])
