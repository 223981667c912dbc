"""The strategies that run a plan across ranks, every one exact (they differ in what moves):

* :mod:`.ring`: K/V spans between the token shards (with :mod:`.merge`, the fp32 merge of partial results);
* :mod:`.ulysses`: all-to-all head parallelism, alone or as the 2-D split ``usp`` (a ring across head groups);
* :mod:`.choice`: the per-layer choice and its cost model (``strategy="auto"``) and :data:`EXECUTORS`,
  the one table from the type of a plan to what runs it;
* :mod:`.scan`: the sequence mixers' exchanges (a convolution's halo, a recurrence's state scan), planned and run
  over :mod:`.mixer_exchange` (a batch's geometry and pieces, the plan records, the differentiable exchange).
"""

from .choice import EXECUTORS, Candidate, CostModel, Executor, choose, executor_of, fixed_candidate, rank_plans

__all__ = ["CostModel", "Candidate", "choose", "fixed_candidate", "rank_plans", "Executor", "EXECUTORS",
           "executor_of"]
