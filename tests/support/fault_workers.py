"""Real process faults on gloo ranks (tests/multirank/test_real_faults.py).

One rank (the victim) is SIGKILLed, or hangs forever, at a chosen point of a training step; the
other ranks (the survivors) must raise :class:`~cp_attention.comm.RankFailedError` naming the
victim, leave their ``context_parallel`` block, destroy the process group and exit with code 0.

Every case spawns fresh processes (a killed rank ends its group). The parent process hosts the
rendezvous store, as torchrun's agent does, so a rank's death never takes the store with it; the
ranks' process-group timeout is 120 s, so a survivor that exits within seconds did not wait for it.

Fault points (``Fault.phase``), counted on the victim's own exchanges:

* ``forward``: its ``at``-th K/V exchange of a ring forward (before posting it);
* ``backward``: its ``at``-th exchange (K/V or dK/dV) of a ring backward;
* ``recompute``: its ``at``-th K/V exchange of a forward recomputed by checkpointing (in backward);
* ``agreement``: its ``at``-th agreement exchange (the all-gather of the header);
* ``outside``: outside attention, at the start of the second step.

Times are wall-clock (``time.time()``), compared across processes of one machine.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

import cp_attention
from cp_attention.comm import Comm
from cp_attention.tools.launch import free_port
from oracle import oracle_attention, oracle_mask

PHASES = ("forward", "backward", "recompute", "agreement", "outside")
L, H, K, D = 48, 4, 2, 8
PG_TIMEOUT = 120.0  # the process group's own timeout: far above every bound asserted
STALL_SECONDS = 3.0  # a "stall": the victim pauses this long (its peers' waits publish their links)


@dataclass(frozen=True)
class Fault:
    """One case: ``action`` ("kill", "hang", "raise" or "stall") on rank ``victim`` at ``phase``."""

    world: int
    phase: str
    action: str
    victim: int = 1
    at: int = 1
    api: str = "bare"            # "bare": cp_attention.attention; "model": a tiny cp_flash model
    timeout: float = 10.0        # context_parallel(timeout=...)
    two_groups: bool = False     # fail in group {0, victim}, then run group {0, other} (world 3)
    teardown: bool = True        # survivors destroy the process group; False: they exit by raising
    second_timeout: float | None = None  # the second group's timeout (None: timeout + 20 s)
    name: str = field(default="", compare=False)

    def label(self) -> str:
        extra = ",two-groups" if self.two_groups else ""
        return f"P{self.world}-{self.api}-{self.action}-{self.phase}@{self.at}-victim{self.victim}{extra}"


# -- the victim --------------------------------------------------------------------------------


def _phase_of_post(what: str) -> str | None:
    """The phase of an exchange being posted, from its description and the Python stack."""
    if what.startswith("the agreement exchange"):
        return "agreement"
    names = set()
    frame = sys._getframe(2)
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    if "ring_backward" in names:
        return "backward"
    if "ring_forward" in names:
        return "recompute" if "_engine_run_backward" in names else "forward"
    return None


def _strike(fault: Fault, store) -> None:
    """Do the fault now (after noting its time in the store)."""
    store.set("fault_at", repr(time.time()))
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.action == "hang":
        while True:
            time.sleep(3600)
    if fault.action == "stall":  # a slow rank, below the timeout: everyone must complete, exactly
        time.sleep(STALL_SECONDS)
        return
    raise RuntimeError(f"injected failure in {fault.phase}")


def _arm(fault: Fault, store) -> None:
    """Make this process (the victim) strike at the fault's ``at``-th exchange of its phase."""
    original = Comm._post
    seen = [0]

    def post(self, ops, what):
        if ops and _phase_of_post(what) == fault.phase:
            seen[0] += 1
            if seen[0] == fault.at:
                _strike(fault, store)
        return original(self, ops, what)

    Comm._post = post


# -- one rank ----------------------------------------------------------------------------------


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, L, n, D, generator=gen) for n in (H, K, K))


def _bare_steps(cp, fault: Fault, store, steps: int = 2) -> list[list[bytes]]:
    """Two training steps of two attention layers (the second checkpointed) on this rank's shard;
    returns each step's q, k, v gradients as bytes (the same inputs every step)."""
    q, k, v = (cp.shard(t).requires_grad_() for t in _inputs())
    grads = []
    for step in range(steps):
        if fault.phase == "outside" and step == 1 and cp.rank == fault.victim:
            _strike(fault, store)
        x = cp_attention.attention(q, k, v, window=20)
        y = checkpoint(lambda a: cp_attention.attention(a, k, v), x, use_reentrant=False)
        y.square().sum().backward()
        grads.append([t.grad.numpy().tobytes() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    return grads


def _model_steps(cp, fault: Fault, store, model, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (1, L), generator=gen)
    pos = torch.cat([torch.arange(20), torch.arange(L - 20)])[None]
    batch = cp.shard_batch(input_ids=ids, position_ids=pos, labels=ids.clone())
    for step in range(steps):
        if fault.phase == "outside" and step == 1 and cp.rank == fault.victim:
            _strike(fault, store)
        model(**batch, use_cache=False).loss.backward()


def _survive(result: dict, body) -> None:
    """Run ``body``; note what it raised and when, then when the block was left."""
    try:
        body()
        result["error"] = None
    except BaseException as exc:  # noqa: BLE001 - the test inspects whatever was raised
        result.update(error=type(exc).__name__, message=str(exc), blamed=getattr(exc, "rank", None))
    result["t_left"] = time.time()


def _group_case(rank: int, fault: Fault, store, groups) -> dict:
    """World 3: rank ``victim`` fails in group {0, victim}; then ranks 0 and the other one run a
    step on their own group, which must be exact."""
    first, second = groups
    other = 3 - fault.victim
    result: dict = {}
    if rank in (0, fault.victim):
        def failing():
            with cp_attention.context_parallel(first, timeout=fault.timeout) as cp:
                _bare_steps(cp, fault, store, steps=1)
        _survive(result, failing)
        if rank == fault.victim:  # a victim that raised stays alive while the others go on
            time.sleep(10)
            return result
    if rank in (0, other) and "error" in result and result["error"] != "RankFailedError":
        return result  # the first group's failure was not the expected one: the test reports it
    if rank in (0, other):
        q, k, v = (t.double() for t in _inputs(seed=1))
        start = time.time()
        # the other rank's wait includes rank 0's time to fail in the first group (its timeout)
        limit = fault.timeout + 20 if fault.second_timeout is None else fault.second_timeout
        try:
            with cp_attention.context_parallel(second, timeout=limit) as cp:
                leaves = [cp.shard(t).requires_grad_() for t in (q, k, v)]
                out = cp_attention.attention(*leaves, window=20)
                out.square().sum().backward()
                got = [cp.gather(t) for t in (out, *(x.grad for x in leaves))]
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result.update(second_failed=f"{type(exc).__name__}: {exc}", t_second_failed=time.time())
            return result
        result["second_seconds"] = time.time() - start
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want = oracle_attention(*full, oracle_mask(1, L, window=20))  # float64 dense oracle
        want.square().sum().backward()
        result["second_error"] = max(float((a - b).abs().max()) for a, b in
                                     zip(got, [want.detach(), *(x.grad for x in full)]))
    return result


def _rank_main(rank: int, fault: Fault, port: int, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, fault.world, is_master=False,
                          timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=fault.world,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    if rank == fault.victim and fault.phase != "outside":
        _arm(fault, store)
    model = None
    if fault.api == "model":
        from cp_attention.tools.tiny_models import tiny_model

        torch.manual_seed(0)
        model = tiny_model("qwen3", "cp_flash", layers=2, window=8).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    if fault.two_groups:
        groups = (dist.new_group([0, fault.victim]), dist.new_group([0, 3 - fault.victim]))
        result = _group_case(rank, fault, store, groups)
    else:
        result = {}

        def steps():
            with cp_attention.context_parallel(timeout=fault.timeout) as cp:
                if model is None:
                    grads = _bare_steps(cp, fault, store)
                    result["steps_identical"] = all(g == grads[0] for g in grads)
                else:
                    _model_steps(cp, fault, store, model)
        _survive(result, steps)
    if fault.teardown:
        start = time.time()
        dist.destroy_process_group()
        result["destroy_seconds"] = time.time() - start
    queue.put((rank, result))
    queue.close()
    queue.join_thread()
    if not fault.teardown and (result.get("error") or result.get("second_failed")):
        raise SystemExit(f"exiting on {result.get('error') or result['second_failed']}")  # no teardown: the interpreter's own exit


# -- the parent --------------------------------------------------------------------------------


def run_fault(fault: Fault, deadline: float = 150.0) -> dict:
    """Run one case; returns ``{"fault_at": time or None, "ranks": {rank: {...}}}`` where each
    survivor's entry holds its result (``error``, ``blamed``, ``message``, ``t_left``, ...), its
    ``exitcode`` and ``t_exit`` (None if still running at the deadline: then it is killed). The
    victim is killed at the end whatever it does."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, fault.world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    procs = {r: ctx.Process(target=_rank_main, args=(r, fault, port, queue), daemon=True)
             for r in range(fault.world)}
    for p in procs.values():
        p.start()
    ranks: dict[int, dict] = {r: {} for r in procs}
    end = time.time() + deadline
    try:
        while time.time() < end:
            for r, p in procs.items():
                if "t_exit" not in ranks[r] and p.exitcode is not None:
                    ranks[r].update(exitcode=p.exitcode, t_exit=time.time())
            while not queue.empty():
                r, result = queue.get()
                ranks[r].update(result)
            survivors = [r for r in procs if r != fault.victim or fault.action in ("raise", "stall")]
            if all("t_exit" in ranks[r] for r in survivors):
                break
            time.sleep(0.02)
        while not queue.empty():
            r, result = queue.get()
            ranks[r].update(result)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join()
    fault_at = float(store.get("fault_at")) if store.check(["fault_at"]) else None
    return {"fault_at": fault_at, "ranks": ranks}
