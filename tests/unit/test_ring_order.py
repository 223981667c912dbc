"""Message order of the real ring, recorded with a fake comm: between any two ranks the sender posts
its messages in exactly the order (and sizes) the receiver posts its receives. NCCL matches
point-to-point messages by order only, so this must hold without tags."""

from __future__ import annotations

import random

import torch

from cp_attention.backends import BACKENDS
from cp_attention.comm import Comm, Pending
from cp_attention.masks import MaskSpec, SequenceMeta, doc_starts_from_position_ids
from cp_attention.plan import build_plan
from cp_attention.strategies.ring import ring_attention


class RecordingComm:
    """Stands in for Comm in one process: records posted operations, delivers nothing."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.log: list[tuple[str, int, tuple, torch.dtype]] = []
        self._queued = []

    def send(self, tensor, dst, tag=0):
        self._queued.append(("send", dst, tuple(tensor.shape), tensor.dtype))

    def recv(self, tensor, src, tag=0):
        tensor.zero_()
        self._queued.append(("recv", src, tuple(tensor.shape), tensor.dtype))

    def commit(self, what=""):
        self.log.extend(self._queued)
        self._queued = []
        return Pending(self, [], [])

    def report_failure(self, where, exc):
        pass

    reporting = Comm.reporting  # the failure wrapper, over this comm's report_failure


def _docs(rng, L):
    out = []
    while sum(out) < L:
        out.append(min(rng.randint(1, rng.choice([3, L // 4 + 1, L])), L - sum(out)))
    return out


def test_send_and_receive_orders_match_between_every_pair():
    rng = random.Random(1)
    H, K, D = 2, 1, 4
    for trial in range(60):
        P = rng.randint(3, 6)
        L = rng.randint(2 * P, 90)
        lay = rng.choice(["zigzag", "contiguous"])
        docs = _docs(rng, L) if rng.random() < 0.7 else None
        ds = doc_starts_from_position_ids(torch.tensor([[p for n in docs for p in range(n)]])) if docs else None
        spec = MaskSpec(causal=rng.random() < 0.5, window=rng.choice([None, rng.randint(1, L)]))
        meta = SequenceMeta(batch=1, seq_len=L, doc_start=ds)
        logs = []
        for r in range(P):
            plan = build_plan(meta, spec, world_size=P, layout=lay, rank=r, head_kv=K, head_dim=D, itemsize=4)
            comm = RecordingComm(r, P)
            n = plan.local_len
            q = torch.randn(1, n, H, D, requires_grad=True)
            k = torch.randn(1, n, K, D, requires_grad=True)
            v = torch.randn(1, n, K, D, requires_grad=True)
            out = ring_attention(q, k, v, None, plan, comm, BACKENDS["reference"], scale=0.5, softcap=None)
            out.sum().backward()
            logs.append(comm.log)
        for a in range(P):
            for b in range(P):
                if a == b:
                    continue
                sends = [(shape, dt) for kind, peer, shape, dt in logs[a] if kind == "send" and peer == b]
                recvs = [(shape, dt) for kind, peer, shape, dt in logs[b] if kind == "recv" and peer == a]
                assert sends == recvs, (trial, P, L, lay, spec, docs, a, b, sends, recvs)
