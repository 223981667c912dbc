"""The fused log-probability forward of padded rows under context parallelism (packed_rows) and the
joins of the CP post-training trainers (trl.join_rows, trl.join_pairs).

Ground truth: TRL's own fused LM head (``add_fused_lm_head``) on the padded batch of an eager model
holding the same weights; TRL's own padding (``trl.trainer.utils.pad``) and preference collator
(``DataCollatorForPreference``) on all the rows at once for the joins; for packing, the definition
written out with loops."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from cp_attention.integrations.trainers.packed_rows import pack_rows, unpack_rows  # noqa: E402
from cp_attention.tools.launch import run_ranks  # noqa: E402
from cp_attention.tools.tiny_models import tiny_model  # noqa: E402

pytestmark = [pytest.mark.transformers]
TOL = 1e-5
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _rows():
    """Four padded rows of L = 14 as TRL builds them: left-padded prompts, right-padded completions,
    one row that attends to nothing (a truncated completion masked with its prompt cut away), labels
    on the completion only."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (4, 14), generator=g)
    mask = torch.zeros(4, 14, dtype=torch.long)
    spans = {0: (2, 14), 1: (0, 9), 2: (5, 11), 3: None}
    completion = {0: 8, 1: 4, 2: 9}
    labels = torch.full((4, 14), -100)
    for b, span in spans.items():
        if span is None:
            continue
        mask[b, span[0]:span[1]] = 1
        labels[b, completion[b]:span[1]] = ids[b, completion[b]:span[1]]
    ids[mask == 0] = 0
    return ids, mask, labels


def test_pack_rows_is_the_definition():
    ids, mask, labels = _rows()
    packed = pack_rows(ids, mask, labels)
    want_ids, want_pos, want_targets, want_starts, want_place = [], [], [], [], []
    for b in range(ids.shape[0]):
        cols = [c for c in range(ids.shape[1]) if mask[b, c]]
        for i, c in enumerate(cols):
            want_ids.append(int(ids[b, c]))
            want_pos.append(c)  # the column: the padded call's own position
            want_starts.append(i == 0)
            nxt = cols[i + 1] if i + 1 < len(cols) else None
            want_targets.append(-100 if nxt is None else int(labels[b, nxt]))
            want_place.append((b, c))
    assert packed.input_ids.tolist() == want_ids
    assert packed.position_ids.tolist() == want_pos
    assert packed.targets.tolist() == want_targets
    assert packed.starts.tolist() == want_starts
    assert list(zip(packed.row.tolist(), packed.column.tolist())) == want_place


def test_unpack_rows_puts_each_token_at_its_row_and_column():
    ids, mask, labels = _rows()
    packed = pack_rows(ids, mask, labels)
    N = packed.input_ids.numel()
    values = torch.arange(1, N + 1, dtype=torch.float32)[:, None]
    out = unpack_rows(values, packed)[..., 0]
    assert out.shape == (4, 13)
    want = torch.zeros(4, 13)
    for i, (b, c) in enumerate(zip(packed.row.tolist(), packed.column.tolist())):
        if c < 13:
            want[b, c] = i + 1
    assert torch.equal(out, want)
    # rows 1..2 of a batch, at a narrower width (a rank's own rows of a joined batch)
    assert torch.equal(unpack_rows(values, packed, slice(1, 3), width=10)[..., 0], want[1:3, :9])


@pytest.mark.parametrize("case", ["hole", "label on padding", "label on the first token"])
def test_pack_rows_refuses_rows_it_would_change(case):
    ids, mask, labels = _rows()
    if case == "hole":
        mask[0, 6] = 0
    elif case == "label on padding":
        labels[1, 11] = 7
    else:
        labels[2, 5] = int(ids[2, 5])
    with pytest.raises(NotImplementedError, match="contiguous span"):
        pack_rows(ids, mask, labels)


def _fused(model, outputs=FIELDS):
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, outputs=outputs)
    return model


def _weights():
    """Fixed weights of the (4, 13) log-probabilities and entropies in the test's loss."""
    w = torch.linspace(-1, 1, 4 * 13).view(4, 13)
    return w, w.flip(1)


def _padded_fields(state):
    """TRL's fused head on the padded batch, eager: every field, and the parameter gradients of
    the weighted sum of the log-probabilities and entropies."""
    model = _fused(tiny_model("gpt_oss", "eager", seed=0, window=4))
    model.load_state_dict(state)
    ids, mask, labels = _rows()
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, output_router_logits=True)
    w, v = _weights()
    ((out.log_probs * w).sum() + (out.entropy * v).sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return {f: getattr(out, f).detach().float() for f in FIELDS}, grads, float(out.aux_loss)


OWN = {0: (slice(0, 2), 14), 1: (slice(2, 4), 11)}
"""rows="own": rank 0 holds rows 0-1, rank 1 rows 2-3 cut to 11 columns (uneven widths and tokens, one
row attending to nothing)."""


def _cp_worker(rank, world_size, state, rows_mode, layout):
    import cp_attention
    from cp_attention.integrations.trainers.packed_rows import packed_fused_forward

    torch.set_num_threads(1)
    model = _fused(tiny_model("gpt_oss", "cp_flash", seed=0, window=4))
    model.load_state_dict(state)
    ids, mask, labels = _rows()
    w, v = _weights()
    if rows_mode == "own":
        rows, width = OWN[rank]
        ids, mask, labels = ids[rows, :width], mask[rows, :width], labels[rows, :width]
        w, v = w[rows, :width - 1], v[rows, :width - 1]
    call = dict(input_ids=ids, attention_mask=mask, labels=labels)
    with cp_attention.context_parallel(layout=layout) as cp:
        if rows_mode == "own":  # a rank's own rows have no share of the group's router loss
            try:
                packed_fused_forward(model.forward, model, cp, dict(call, output_router_logits=True), rows="own")
                raise AssertionError("router logits of each rank's own rows were not refused")
            except NotImplementedError as e:
                assert "joined batch" in str(e), e
        else:
            call["output_router_logits"] = True
        out = packed_fused_forward(model.forward, model, cp, call, rows=rows_mode)
        ((out.log_probs * w).sum() + (out.entropy * v).sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    aux = None if out.aux_loss is None else float(out.aux_loss)
    return {f: getattr(out, f).detach().float().numpy() for f in FIELDS}, grads.numpy(), aux


@pytest.mark.multirank
@pytest.mark.parametrize("rows_mode,layout", [("shared", "zigzag"), ("own", "contiguous")])
def test_packed_fused_forward_equals_the_padded_call(rows_mode, layout):
    """Two gloo ranks, gpt-oss (window 4 with sinks): the fields equal TRL's padded eager call, row
    for row. "shared": every rank holds the four rows, and the mean of the ranks' gradients is one
    device's (each rank's loss of the gathered fields counts whole, as under DDP's mean), and every
    rank returns the batch's router loss; "own": each rank its own rows (:data:`OWN`), the sum of the
    ranks' gradients is one device's, and router logits are refused."""
    state = tiny_model("gpt_oss", "eager", seed=0, window=4).state_dict()
    per_rank = run_ranks(2, _cp_worker, state, rows_mode, layout, timeout=600)
    fields, grads, aux = _padded_fields(state)
    for r in range(2):
        if rows_mode == "shared":  # every rank returns the batch's router loss (one device's value)
            assert abs(per_rank[r][2] - aux) <= TOL * max(1.0, abs(aux)), (r, per_rank[r][2], aux)
        rows, width = OWN[r] if rows_mode == "own" else (slice(0, 4), 14)
        for f in FIELDS:
            got, want = torch.from_numpy(per_rank[r][0][f]), fields[f][rows, :width - 1]
            assert got.shape == want.shape, (r, f, got.shape)
            assert torch.allclose(got, want, atol=TOL, rtol=TOL), (r, f, float((got - want).abs().max()))
    combined = torch.from_numpy(per_rank[0][1] + per_rank[1][1]) / (2 if rows_mode == "shared" else 1)
    assert float((combined - grads).abs().max()) <= TOL * max(1.0, float(grads.abs().max()))


def test_join_rows_equals_padding_every_row_at_once():
    from trl.trainer.utils import pad

    from cp_attention.integrations.trainers.trl import join_rows

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=g) for n in (3, 7, 2, 5, 9)]
    completions = [torch.randint(3, 100, (n,), generator=g) for n in (4, 1, 6, 2, 3)]
    logps = [torch.randn(len(c), generator=g) for c in completions]

    def build(rows, multiple=None):
        return {"prompt_ids": pad([prompts[i] for i in rows], 0, "left", pad_to_multiple_of=multiple),
                "prompt_mask": pad([torch.ones_like(prompts[i]) for i in rows], 0, "left", pad_to_multiple_of=multiple),
                "completion_ids": pad([completions[i] for i in rows], 0, "right", pad_to_multiple_of=multiple),
                "completion_mask": pad([torch.ones_like(completions[i]) for i in rows], 0, "right",
                                       pad_to_multiple_of=multiple),
                "old_per_token_logps": pad([logps[i] for i in rows], 0.0, "right", pad_to_multiple_of=multiple),
                "advantages": torch.tensor([float(i) for i in rows]), "num_items_in_batch": torch.tensor(16)}

    for multiple in (None, 4):
        joined = join_rows([build([0, 1], multiple), build([2, 3, 4], multiple)], 0)
        want = build([0, 1, 2, 3, 4], multiple)
        assert joined.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(joined[k], v), (k, multiple)


def test_join_pairs_equals_the_collator_on_every_pair():
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    g = torch.Generator().manual_seed(1)

    def example():
        return {k: torch.randint(3, 100, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
                for k in ("prompt_ids", "chosen_ids", "rejected_ids")}

    examples = [example() for _ in range(5)]
    collate = DataCollatorForPreference(pad_token_id=0)
    from cp_attention.integrations.trainers.trl import join_pairs

    joined = join_pairs([collate(examples[:2]), collate(examples[2:])], 0)
    want = collate(examples)
    assert joined.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(joined[k], v), k


class _Gathering:
    """The two accelerate calls GRPO's entropy mask makes, over the context's ranks."""

    def __init__(self, comm):
        self.comm = comm

    def pad_across_processes(self, t, dim=0, pad_index=0):
        longest = max(int(n) for n in self.comm.all_gather(torch.tensor([t.shape[0]])))
        return torch.cat([t, t.new_full((longest - t.shape[0],), pad_index)])

    def gather(self, t):
        return torch.cat(self.comm.all_gather(t))


def _quantile_worker(rank, world_size, entropies, mask, threshold):
    import types

    import cp_attention
    from cp_attention.integrations.trainers.trl import CPRLTrainerMixin

    with cp_attention.context_parallel() as cp:
        trainer = types.SimpleNamespace(accelerator=_Gathering(cp.comm))
        return CPRLTrainerMixin.get_high_entropy_mask(trainer, entropies, mask, threshold).numpy()


@pytest.mark.multirank
def test_entropy_quantile_counts_the_joined_batch_once():
    """GRPO's top_entropy_quantile mask on 2 ranks holding the same joined batch: the quantile of its
    scored tokens' entropies (torch.quantile, as one process takes it), not of every rank's copy (with
    two copies of {1, 2} the 0.25 quantile would be 1, keeping both tokens)."""
    entropies = torch.tensor([[1.0, 2.0, 7.0], [3.0, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    for threshold in (0.25, 0.6):
        cut = torch.quantile(entropies[mask.bool()], threshold)
        want = ((entropies * mask) >= cut) & mask.bool()
        for got in run_ranks(2, _quantile_worker, entropies, mask, threshold, timeout=300):
            assert torch.equal(torch.from_numpy(got), want), (threshold, got)
