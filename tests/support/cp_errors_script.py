"""Run under torchrun by tests/integrations/test_training.py: errors raised on every rank leave the group usable,
a real rank failure is named, and every process exits normally (exit code 0, no abort).

Prints one line ``RESULT <json>`` per rank."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import cp_attention  # noqa: E402
from training_workers import _doc_logits, documents, flattened, models  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    found = {}
    model, ref = models("mistral")
    model.eval()
    docs = documents(0)
    batch = flattened(docs)
    truth = _doc_logits(ref, docs)

    def logits_error(cp, local):
        return float((cp.gather(model(**local, use_cache=False).logits) - truth).abs().max())

    with torch.no_grad():
        # 1. the same mistake on every rank (no shard_batch): every rank raises, in the block
        try:
            with cp_attention.context_parallel() as cp:
                model(input_ids=cp.shard(batch["input_ids"]), use_cache=False)
        except ValueError as exc:
            found["forgot"] = str(exc)
        # 2. the next correct call in a fresh context works
        with cp_attention.context_parallel() as cp:
            found["fresh"] = logits_error(cp, cp.shard_batch(**batch))
        # 3. ... and in the same context, after the error was caught inside it
        with cp_attention.context_parallel() as cp:
            try:
                model(input_ids=cp.shard(batch["input_ids"]), use_cache=False)
            except ValueError:
                pass
            found["same"] = logits_error(cp, cp.shard_batch(**batch))
        # 4. a real failure: rank 1 raises alone; rank 0 waits in attention and must name it
        try:
            with cp_attention.context_parallel(timeout=60) as cp:
                local = cp.shard_batch(**batch)
                if rank == 1:
                    raise RuntimeError("injected failure on rank 1")
                model(**local, use_cache=False)
        except cp_attention.RankFailedError as exc:
            found["failure"] = f"RankFailedError rank={exc.rank}: {exc}"
        except RuntimeError as exc:
            found["failure"] = f"own: {exc}"
    print("RESULT " + json.dumps(dict(rank=rank, **found)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
