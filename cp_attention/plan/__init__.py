"""Planning: pure functions from the documents of a batch and one mask to each rank's plan (the kernel
calls and the K/V moves), the plan's verification and the cache of plans.

* :mod:`.types`: :class:`RankPlan`, its rounds, steps and kernel calls, :class:`PlanStats`;
* :mod:`.build`: :func:`build_plan` (one rank of a context), :func:`build_local_plan` (one device);
* :mod:`.verify`: every call checked against the mask, token by token (:func:`verify_plan`);
* :mod:`.cache`: :class:`PlanCache`, the LRU cache keyed by the documents' content.
"""

from .build import build_local_plan, build_plan, verify_plan
from .cache import PlanCache
from .types import KernelCall, PlanStats, RankPlan, Round, Step

__all__ = ["KernelCall", "Step", "Round", "PlanStats", "RankPlan", "build_plan", "build_local_plan", "verify_plan",
           "PlanCache"]
