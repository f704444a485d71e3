import random

import pytest
import torch

from ibpo.batching import cut, micro_batches, plan_micro_batches
from ibpo.generation import Rollout
from ibpo.logprobs import completion_logprobs


def _cost(rows, prompt, completion):
    return len(rows) * (max(prompt[i] for i in rows) + max(completion[i] for i in rows))


@pytest.mark.parametrize("seed", range(20))
def test_every_row_once_in_whole_groups_at_most_max_groups(seed):
    r = random.Random(seed)
    G = r.choice([2, 4, 8])
    n = G * r.randint(1, 12)
    prompt = [r.randint(3, 40) for _ in range(n)]
    completion = [r.randint(0, 64) for _ in range(n)]
    max_groups = r.randint(1, 5)
    plan = plan_micro_batches(prompt, completion, G, max_groups)
    rows = [i for mb in plan for i in mb]
    assert sorted(rows) == list(range(n))  # every sequence exactly once
    for mb in plan:
        groups = [mb[k : k + G] for k in range(0, len(mb), G)]
        for g in groups:  # whole groups, members contiguous and in order
            assert g == list(range(g[0], g[0] + G)) and g[0] % G == 0
        assert len(groups) <= max_groups
    assert all(len(mb) == max_groups * G for mb in plan[:-1])  # only the last one is short
    # longest groups first: the micro-batches' longest completions never increase
    longest = [max(completion[i] for i in mb) for mb in plan]
    assert longest == sorted(longest, reverse=True)


def test_sorting_reduces_padding():
    G = 2
    completion = [60, 60, 2, 2, 59, 58, 3, 1]  # long, short, long, short groups
    prompt = [5] * 8
    sorted_plan = plan_micro_batches(prompt, completion, G, max_groups=2)
    assert sorted_plan == [[0, 1, 4, 5], [6, 7, 2, 3]]  # longest (60, 59, 3, 2) first
    padded = sum(_cost(mb, prompt, completion) for mb in sorted_plan)
    positional = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert padded < sum(_cost(mb, prompt, completion) for mb in positional)


def test_bad_input():
    with pytest.raises(ValueError, match="whole groups"):
        plan_micro_batches([1, 2, 3], [1, 2, 3], 2, 1)
    with pytest.raises(ValueError, match="max_groups"):
        plan_micro_batches([1, 2], [1, 2], 2, 0)


def _rollout(tok, prompts, completions):
    """Left-padded prompts + right-padded completions, as generation.generate lays them out."""
    pad = tok.pad_token_id
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    c_ids = [tok(c, add_special_tokens=False)["input_ids"] for c in completions]
    P, T = max(map(len, p_ids)), max(map(len, c_ids))
    ids, att, cmask = [], [], []
    for p, c in zip(p_ids, c_ids):
        ids.append([pad] * (P - len(p)) + p + c + [pad] * (T - len(c)))
        att.append([0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (T - len(c)))
        cmask.append([1.0] * len(c) + [0.0] * (T - len(c)))
    n = len(prompts)
    return Rollout(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(att),
        completion_mask=torch.tensor(cmask),
        prompt_len=P,
        texts=list(completions),
        truncated=torch.zeros(n, dtype=torch.bool),
    )


def test_cut_micro_batches_give_the_same_logprobs():
    from tests.conftest import make_tiny_qwen3, make_tokenizer

    tok = make_tokenizer()
    model = make_tiny_qwen3(len(tok)).eval()
    prompts = ["what is 1+1?", "1+1?", "what is 12*12 then?", "12*12?"]
    completions = ["2", "two is it", "144 it is, yes", "1"]
    ro = _rollout(tok, prompts, completions)
    full, _ = completion_logprobs(
        model, ro.input_ids, ro.attention_mask, ro.prompt_len, ro.completion_mask
    )
    mbs = micro_batches(ro, group_size=2, max_groups=1)
    assert [mb.rows.tolist() for mb in mbs] == [[2, 3], [0, 1]]  # longest completion first
    for mb in mbs:
        assert mb.prompt_len <= ro.prompt_len and mb.width <= ro.completion_mask.shape[1]
        logp, _ = completion_logprobs(
            model, mb.input_ids, mb.attention_mask, mb.prompt_len, mb.completion_mask
        )
        torch.testing.assert_close(logp, mb.take(full), atol=1e-5, rtol=1e-5)
        assert torch.equal(
            mb.completion_ids * mb.completion_mask.long(),
            mb.take(ro.completion_ids) * mb.completion_mask.long(),
        )
    short = cut(ro, [1, 3])  # the short prompts: the left-padding columns all go
    assert short.prompt_len == max(len(tok(p)["input_ids"]) for p in (prompts[1], prompts[3]))
