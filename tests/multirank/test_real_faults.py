"""Real process faults (tests/support/fault_workers.py): a rank SIGKILLed or hung forever in every phase.

Every survivor must raise :class:`~cp_attention.comm.RankFailedError` naming the victim (its
``rank``), within :data:`DEATH_BOUND` of a death and at the timeout for a hang, then leave its
``context_parallel`` block, destroy the process group and exit with code 0 within
:data:`EXIT_BOUND` (no SIGABRT, no wait for the process group's 120 s timeout). A failure in one
group never reaches a new block on another group, which runs at once and exactly.

A stalled rank (3 s, below the timeout) is no failure: every rank completes and the stalled step's
gradients equal the next step's bit for bit.

The default run (CI) takes a subset that covers each fixed failure once; ``-m faults`` runs the
whole matrix (P = 2 and 3, every phase, kill and hang; model, two-group, exit and stall cases).
"""

from __future__ import annotations

import pytest

from fault_workers import PHASES, Fault, run_fault

pytestmark = pytest.mark.transformers  # builds transformers models

DEATH_BOUND = 5.0   # seconds from a death to every survivor's error (measured: 0.02-0.05 s)
HANG_SLACK = 5.0    # ... from a hang's timeout to the error (measured: 0.02 s)
EXIT_BOUND = 10.0   # seconds from leaving the block to the process's exit (measured: 0.7-3.5 s)
HANG_TIMEOUT = 3.0  # context_parallel(timeout=...) of the hang cases


def _kill(world, phase, **kw):
    return Fault(world, phase, "kill", **kw)


def _hang(world, phase, **kw):
    return Fault(world, phase, "hang", timeout=HANG_TIMEOUT, **kw)


FAST = [
    _kill(3, "backward"),                      # was gloo's raw error, and the wrong rank blamed
    _hang(2, "agreement"),                     # was blocked in destroy_process_group for the PG timeout
    _hang(3, "outside"),                       # ... a hang outside attention, at the start of a step
    _kill(3, "recompute", api="model"),        # a cp_flash model with gradient checkpointing
    Fault(3, "forward", "raise", two_groups=True),  # a new group was blocked behind the failed one
    Fault(3, "backward", "stall"),             # a slow rank (3 s, timeout 10 s) is no failure
]

FULL = (
    [make(world, phase) for world in (2, 3) for phase in PHASES for make in (_kill, _hang)]
    + [
        _kill(3, "backward", victim=0),        # the victim is rank 0
        _kill(3, "agreement", victim=2, at=2),
        _kill(3, "backward", at=3),            # a later exchange of the backward
        _hang(4, "forward", victim=2),         # a chain: survivors wait on survivors waiting on the victim
        _kill(4, "backward", victim=3),
        _kill(2, "forward", api="model"),
        _kill(3, "backward", api="model"),
        _hang(3, "recompute", api="model"),
        _hang(3, "outside", api="model"),
        _kill(3, "forward", two_groups=True),
        _hang(3, "forward", two_groups=True),
        # survivors that exit by raising, without destroying the group, while a peer's connection
        # closes: the process must not abort (SIGABRT) in the interpreter's teardown
        _hang(3, "forward", two_groups=True, teardown=False, second_timeout=HANG_TIMEOUT),
        _kill(3, "backward", teardown=False),
        Fault(2, "agreement", "stall"),
        Fault(3, "recompute", "stall", victim=2),
    ]
)


def check(fault: Fault, report: dict) -> list[str]:
    """Every problem of one case (empty: it passed)."""
    problems = []
    ranks, fault_at = report["ranks"], report["fault_at"]
    if fault_at is None:
        return [f"the victim never reached its fault point ({fault.phase} #{fault.at})"]
    if fault.action == "stall":  # slow, not failed: every rank completes, the stalled step exactly
        for r, got in sorted(ranks.items()):
            if got.get("error") is not None or got.get("exitcode") != 0:
                problems.append(f"rank {r}: {got.get('error')} ({str(got.get('message'))[:300]}), exit code "
                                f"{got.get('exitcode')}")
            elif not got.get("steps_identical"):
                problems.append(f"rank {r}: the stalled step's gradients differ from the next step's")
        return problems
    survivors = [r for r in ranks if r != fault.victim]
    if fault.two_groups:
        survivors = [0]  # the victim's partner in the failing group; the other rank checked below
    for r in survivors:
        got = ranks[r]
        where = f"rank {r}"
        if got.get("error") != "RankFailedError" or got.get("blamed") != fault.victim:
            problems.append(f"{where}: {got.get('error')} blaming {got.get('blamed')} (want RankFailedError "
                            f"naming rank {fault.victim}): {str(got.get('message'))[:300]}")
            continue
        took = got["t_left"] - fault_at
        if fault.action == "hang":
            # a survivor's deadline runs from its own wait, which may start before the victim hangs
            if not 0.5 * fault.timeout <= took <= fault.timeout + HANG_SLACK:
                problems.append(f"{where}: raised {took:.2f} s after the hang (timeout {fault.timeout:g} s)")
        elif took > DEATH_BOUND:
            problems.append(f"{where}: raised {took:.2f} s after the {fault.action} (bound {DEATH_BOUND:g} s)")
    for r in (r for r in ranks if r != fault.victim or fault.action == "raise"):
        got = ranks[r]
        want_code = 0 if fault.teardown or not (got.get("error") or got.get("second_failed")) else 1
        if got.get("exitcode") != want_code:
            problems.append(f"rank {r}: exit code {got.get('exitcode')} (want {want_code}; -6 is SIGABRT)")
            continue
        if r != fault.victim and "t_left" in got and got["t_exit"] - got["t_left"] > EXIT_BOUND:  # (a raising
            # victim stays alive on purpose)
            problems.append(f"rank {r}: exited {got['t_exit'] - got['t_left']:.1f} s after leaving its block")
        if got.get("destroy_seconds", 0.0) > 5.0:
            problems.append(f"rank {r}: destroy_process_group took {got['destroy_seconds']:.1f} s")
    if fault.two_groups and fault.teardown:
        for r in (0, 3 - fault.victim):
            got = ranks[r]
            if "second_error" not in got:
                problems.append(f"rank {r}: the second group failed: {got.get('second_failed')}")
            elif got["second_error"] > 1e-12:
                problems.append(f"rank {r}: the second group is off by {got['second_error']:.2e} (float64)")
        if ranks[0].get("second_seconds", 99.0) > 5.0:  # rank 0 enters it last: no wait is legitimate
            problems.append(f"rank 0: the second group took {ranks[0].get('second_seconds')} s")
    return problems


def _run(fault: Fault) -> None:
    problems = check(fault, run_fault(fault))
    assert not problems, f"{fault.label()}:\n" + "\n".join(problems)


@pytest.mark.parametrize("fault", FAST, ids=Fault.label)
def test_real_fault(fault):
    _run(fault)


@pytest.mark.faults
@pytest.mark.parametrize("fault", [f for f in FULL if f not in FAST], ids=Fault.label)
def test_real_fault_matrix(fault):
    _run(fault)


def test_check_flags_each_kind_of_problem():
    """The checker itself: wrong blame, a late error, a slow or aborted exit, a failed second group."""
    fault = _kill(3, "backward")
    good = dict(error="RankFailedError", blamed=1, t_left=100.1, exitcode=0, t_exit=101.0, destroy_seconds=0.0)
    report = {"fault_at": 100.0, "ranks": {0: dict(good), 1: {}, 2: dict(good)}}
    assert check(fault, report) == []
    for change, fragment in [(dict(blamed=2), "blaming 2"), (dict(error="RuntimeError"), "RuntimeError"),
                             (dict(t_left=110.0, t_exit=111.0), "raised 10.00 s"),
                             (dict(exitcode=-6), "exit code -6"), (dict(t_exit=115.0), "exited 14.9 s"),
                             (dict(destroy_seconds=30.0), "destroy_process_group took")]:
        bad = {"fault_at": 100.0, "ranks": {0: dict(good), 1: {}, 2: dict(good, **change)}}
        assert any(fragment in p for p in check(fault, bad)), (change, check(fault, bad))
    assert "never reached" in check(fault, {"fault_at": None, "ranks": {}})[0]
    stall = Fault(3, "backward", "stall")
    fine = dict(error=None, exitcode=0, steps_identical=True)
    assert check(stall, {"fault_at": 1.0, "ranks": {r: dict(fine) for r in range(3)}}) == []
    for change in (dict(error="RankFailedError"), dict(steps_identical=False), dict(exitcode=1)):
        assert check(stall, {"fault_at": 1.0, "ranks": {0: dict(fine), 1: dict(fine), 2: dict(fine, **change)}})
    hang = _hang(2, "agreement")
    early = {"fault_at": 100.0, "ranks": {0: dict(good, t_left=101.0), 1: {}}}
    assert any("after the hang" in p for p in check(hang, early))
    groups = Fault(3, "forward", "raise", two_groups=True)
    second = dict(good, second_error=0.0, second_seconds=0.1)
    ok = {"fault_at": 100.0, "ranks": {0: dict(second), 1: dict(good, error="RuntimeError"), 2: dict(second)}}
    assert check(groups, ok) == []
    off = {"fault_at": 100.0, "ranks": {0: dict(second, second_seconds=6.0), 1: {},
                                        2: dict(good, second_failed="RankFailedError: timed out")}}
    found = check(groups, off)
    assert any("second group took" in p for p in found) and any("timed out" in p for p in found), found
