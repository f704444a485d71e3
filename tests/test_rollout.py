import dataclasses

import torch

from ibpo.config import ModelConfig
from ibpo.generation import Rollout, concat_rollouts, generate, set_kv_cache
from ibpo.generation.rollout import completion_mask_from
from ibpo.modeling import load_policy


def test_completion_mask_up_to_first_eos():
    tokens = torch.tensor([[5, 6, 1, 0, 0], [5, 1, 1, 0, 0], [5, 6, 7, 8, 9]])
    mask, truncated = completion_mask_from(tokens, [1])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]


def test_generate_groups_left_padding_and_restores_mode(tiny_model_dir):
    model, tok = load_policy(
        ModelConfig(name=tiny_model_dir, quantization="none"), torch.device("cpu")
    )
    model.train()
    torch.manual_seed(0)
    ro = generate(model, tok, ["a", "What is 12+30?"], 3, 8, batch_size=4)
    assert model.training
    assert ro.num_sequences == 6 and ro.completion_mask.shape[1] <= 8
    assert ro.input_ids.shape[1] == ro.prompt_len + ro.completion_mask.shape[1]
    # the short prompt is left-padded, the long one is not
    assert ro.attention_mask[0, 0] == 0 and ro.attention_mask[3, 0] == 1
    assert (ro.input_ids[0:3, : ro.prompt_len] == ro.input_ids[0, : ro.prompt_len]).all()
    lengths = ro.completion_mask.sum(-1).long().tolist()
    for text, row, n in zip(ro.texts, ro.input_ids[:, ro.prompt_len :], lengths):
        assert text == tok.decode(row[:n], skip_special_tokens=True)


def test_static_kv_cache_generates_what_the_dynamic_one_does(tiny_model_dir):
    """A static cache (set_kv_cache): the same greedy tokens and, with the same seed, the same
    samples (left padding, a batch split in slices, early stop at EOS); set once on the model;
    each call's cache is sized for that call, not for the longest call so far."""
    model, tok = load_policy(
        ModelConfig(name=tiny_model_dir, quantization="none"), torch.device("cpu")
    )
    prompts = ["a", "What is 12+30?", "hello there"]
    found = {}
    for kind in ("dynamic", "static"):
        set_kv_cache(model, kind)
        assert model.generation_config.cache_implementation == (
            None if kind == "dynamic" else "static"
        )
        greedy = generate(model, tok, prompts, 1, 12, batch_size=2, do_sample=False)
        torch.manual_seed(3)
        sampled = generate(model, tok, prompts, 4, 12, batch_size=8)
        found[kind] = (greedy.input_ids, sampled.input_ids, sampled.completion_mask)
    for a, b in zip(found["dynamic"], found["static"]):
        assert torch.equal(a, b)
    assert found["dynamic"][2].sum() < found["dynamic"][2].numel()  # some stopped at EOS
    hf = model.get_base_model()
    generate(model, tok, prompts, 1, 40, batch_size=4, do_sample=False)
    long = hf._previous_max_cache_length  # what transformers allocated for that call
    generate(model, tok, prompts, 1, 4, batch_size=4, do_sample=False)
    assert hf._previous_max_cache_length == long - 36


def test_model_generation_defaults_do_not_reshape_sampling(tiny_model_dir):
    """A model's generation_config may carry repetition penalties, min_p, n-gram bans...: rollouts
    ignore them (they would sample from something other than the policy the update trains)."""
    model, tok = load_policy(
        ModelConfig(name=tiny_model_dir, quantization="none"), torch.device("cpu")
    )
    outs = []
    reshaping = {
        "min_p": 0.999,
        "no_repeat_ngram_size": 1,
        "repetition_penalty": 50.0,
        "num_beams": 3,
    }
    for extra in ({}, reshaping):
        for k, v in extra.items():
            setattr(model.generation_config, k, v)
        torch.manual_seed(0)
        outs.append(generate(model, tok, ["abc", "hello"], 4, 8, batch_size=8))
    assert torch.equal(outs[0].input_ids, outs[1].input_ids)
    assert len(set(outs[1].texts)) > 2  # min_p=0.999 alone would make every sample the same


def _every_field_set(n: int, offset: int) -> Rollout:
    """A rollout (P = 2, T = 3) with every field given a value, distinct per row."""
    rows = torch.arange(n) + offset
    completion = [[int(r) * 10 + j for j in range(3)] for r in rows]
    return Rollout(
        input_ids=torch.cat([torch.stack([rows, rows], 1), torch.tensor(completion)], 1),
        attention_mask=torch.ones(n, 5, dtype=torch.long),
        completion_mask=torch.ones(n, 3),
        prompt_len=2,
        texts=[f"text {int(r)}" for r in rows],
        truncated=rows % 2 == 0,
        tokens=completion,
        prompt_lengths=[2] * n,
        cut_off=[bool(r % 2 == 0) for r in rows],
        logprobs=-rows.float().unsqueeze(1).expand(n, 3).clone(),
        prefill_tokens=7 + offset,
        decode_slots=20 + offset,
        policy_lengths=[2] * n,
        tool_traces=[f"trace {int(r)}" for r in rows],
    )


# The fields that are neither one entry per row (a tensor or a list) nor a list of rows, and
# what select and concat_rollouts must make of them: a new such field fails the test below
# until it is said here (and the two carry it).
SCALARS = {
    "prompt_len": lambda a, b: a,
    "prefill_tokens": lambda a, b: a + b,
    "decode_slots": lambda a, b: a + b,
}


def test_select_and_concat_carry_every_field():
    a, b = _every_field_set(4, 0), _every_field_set(3, 100)
    for f in dataclasses.fields(Rollout):
        assert getattr(a, f.name) is not None, f"the example leaves {f.name} unset"
    rows = [3, 0, 2]
    picked, joined = a.select(rows), concat_rollouts([a, b], pad_id=0)
    for f in dataclasses.fields(Rollout):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        got_picked, got_joined = getattr(picked, f.name), getattr(joined, f.name)
        if isinstance(va, torch.Tensor):
            assert torch.equal(got_picked, va[rows]), f.name
            assert torch.equal(got_joined, torch.cat([va, vb])), f.name
        elif isinstance(va, list):
            assert got_picked == [va[i] for i in rows], f.name
            assert got_joined == va + vb, f.name
        else:
            assert f.name in SCALARS, f"say what select and concat make of {f.name}"
            assert got_picked == va, f.name  # work done by the rollout: a selection keeps it
            assert got_joined == SCALARS[f.name](va, vb), f.name
