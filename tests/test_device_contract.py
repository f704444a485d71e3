"""Device contract of the stages between rollout and loss, checked without a GPU.

A CPU-only suite cannot see a tensor left on the CPU while its partners live on CUDA (the repair
path once returned its edit mask on the CPU when a step planned no repair: the first all-correct
step of a run crashed). Here the rollout lives on a stand-in accelerator, PyTorch's `meta`
device: like CUDA it refuses an op that mixes its tensors with (non-scalar) CPU tensors, and it
has no values, so any read of a device value (`.item()`, `.tolist()`, `.cpu()`) fails too. The
stages then run as the trainer runs them: scoring (rewards, repairs, dynamic sampling, shaped
rewards, advantages, edit masks, joining rounds), micro-batch cutting and the normaliser, each
objective's inputs and outputs, the cancellation diagnostic and the step's metrics.

Why `meta` and not FakeTensorMode's fake `cuda` tensors: on this CPU-only torch (2.13) a fake
cuda tensor cannot be sliced or indexed ("PyTorch is not linked with support for cuda devices"),
and every stage here slices. Meta tensors slice, index with host index tensors as CUDA does, and
raise on mixing; the one FakeTensorMode test below checks the objectives against fake cuda too.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from ibpo.algo.objectives import KL_ESTIMATORS, OBJECTIVES, aggregate, token_weights
from ibpo.generation import Rollout
from ibpo.recipe import load_config, resolve_params
from tests.conftest import grader_rewards

DEVICE = torch.device("meta")
G, P, EOS = 4, 3, 1


def device_rollout(rows: list[list[int]], texts: list[str], width: int | None = None) -> Rollout:
    """A rollout whose tensors are on the stand-in device and whose host copies are real, as
    generation.rollout.assemble leaves them (prompts of P tokens, completions right-padded)."""
    n, T = len(rows), width or max(len(r) for r in rows)
    return Rollout(
        input_ids=torch.zeros(n, P + T, dtype=torch.long, device=DEVICE),
        attention_mask=torch.ones(n, P + T, dtype=torch.long, device=DEVICE),
        completion_mask=torch.ones(n, T, device=DEVICE),
        prompt_len=P,
        texts=texts,
        truncated=torch.zeros(n, dtype=torch.bool, device=DEVICE),
        tokens=[list(r) for r in rows],
        prompt_lengths=[P] * n,
        cut_off=[len(r) == T and r[-1] != EOS for r in rows],
        # behaviour log-probs, as a sampling backend reports
        logprobs=torch.zeros(n, T, device=DEVICE),
    )


class Tok:
    pad_token_id = 0
    chat_template = None


class Stream:
    def __init__(self):
        self.n = 0

    def take(self, k):
        from ibpo.data import Example

        out = [Example(f"q{self.n + i}", "7") for i in range(k)]
        self.n += k
        return out


def scripted(verdicts: list[list[str]], repair_text: str = "7"):
    """A Generator: rollout rounds answer as scripted ('7' right, anything else wrong); repair
    calls (prompts holding an attempt) answer `repair_text`."""
    rounds = iter(verdicts)

    def generate(tok, prompts, n, max_new, bs, **kw):
        if "Here is an attempt" in prompts[0]:
            texts = [repair_text] * len(prompts)
        else:
            texts = [t for group in next(rounds)[: len(prompts)] for t in group]
        rows = [[5 + (len(t) + j) % 7 for j in range(len(t))] + [EOS] for t in texts]
        return device_rollout(rows, texts, width=6)

    return generate


def reward(text: str, answer: str) -> float:
    return float(text.strip() == answer)


RIGHT, WRONG = ["7"] * G, ["3", "45", "9", "123"]
MIXED = ["7", "3", "7", "45"]
CASES = {
    "all_correct": [[RIGHT, RIGHT]],  # no repair planned: the mask must still reach the device
    "all_failed": [[WRONG, WRONG]],  # repairs with no correct reference (correct_first: others)
    "mixed": [[MIXED, WRONG]],
}


def collect(rounds, objective="ibpo", extra=()):
    from ibpo.step import collect_batch

    cfg = load_config(
        None,
        [
            f"rollout.group_size={G}",
            "train.prompts_per_step=2",
            f"objective.name={objective}",
            *extra,
        ],
    )
    obj = resolve_params(cfg.objective)
    batch = collect_batch(
        scripted(rounds), Tok(), Stream(), cfg, obj, grader_rewards(reward), random.Random(0)
    )
    return cfg, obj, batch


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic_sampling"])
def test_scoring_keeps_every_tensor_on_the_rollout_device(case, dynamic):
    rounds = CASES[case] * 4  # dynamic sampling may ask for more rounds
    extra = ["rollout.dynamic_sampling=true"] if dynamic else []  # at most 3 more rounds
    cfg, obj, batch = collect(rounds, extra=extra)
    assert batch.adv.device == DEVICE and batch.seq_adv.device == DEVICE
    assert batch.rollout.completion_mask.device == DEVICE
    assert batch.rewards.device.type == "cpu"  # the grader's verdicts stay on the host
    assert batch.adv.shape == batch.rollout.completion_mask.shape
    if case == "mixed" and not dynamic:
        assert batch.stats["repairs"] > 0
    assert 0.0 <= batch.stats["lifted_blame_fraction"] <= 1.0  # counted on the host


def test_repairs_and_overlong_penalty_join_rounds_on_the_device():
    """Dynamic sampling joins a round with repairs into the batch of another (both with edit
    masks) and DAPO's length penalty adds a host term before centring."""
    rounds = [[MIXED, RIGHT], [RIGHT, MIXED], [MIXED, MIXED]]
    extra = ["rollout.dynamic_sampling=true", "repair.enabled=true", "rollout.max_new_tokens=6"]
    _, _, batch = collect(rounds, objective="dapo", extra=extra)
    assert batch.rollout.num_sequences == 2 * G and batch.adv.device == DEVICE
    assert batch.stats["resample_rounds"] == 2.0 and batch.stats["dropped_groups"] == 2.0


@pytest.mark.parametrize("case", sorted(CASES))
def test_update_stages_read_no_device_value(case):
    """Micro-batches, the step normaliser, each objective with the reference KL, the
    cancellation diagnostic, the statistics stack and the step's metrics, on the device batch."""
    from ibpo.algo.cancellation import cancellation_residual
    from ibpo.algo.mismatch import mismatch_stats
    from ibpo.batching import micro_batches
    from ibpo.step import behaviour_policy, global_normaliser
    from ibpo.step_metrics import stack_stats, step_metrics
    from ibpo.step_parts import UpdateResult

    CORRECTIONS = [("rollout", "none"), ("trainer", "truncate"), ("trainer", "mask")]

    class OneProcess:
        num_processes = 1

    cfg, _, batch = collect(CASES[case])
    mbs = micro_batches(batch.rollout, G, max_groups=1)
    assert [mb.rows.device for mb in mbs] == [DEVICE] * 2
    for name in OBJECTIVES:
        obj = resolve_params(load_config(None, [f"objective.name={name}"]).objective)
        lengths = batch.rollout.host_policy_lengths()
        norm = global_normaliser(OneProcess(), obj, lengths, cfg.rollout.max_new_tokens)
        stats, cancel = {}, {}
        for mb in mbs:
            mask = mb.completion_mask
            logp = torch.randn(mask.shape, device=DEVICE, requires_grad=True)
            ref = torch.randn(mask.shape, device=DEVICE)
            a, seq_adv = mb.take(batch.adv), mb.take(batch.seq_adv)
            behaviour = mb.take(batch.rollout.logprobs)
            for policy, weights in CORRECTIONS:  # each correction on the device too
                corrected = dataclasses.replace(
                    obj, behavior_policy=policy, importance_sampling=weights
                )
                old, rho, is_info = behaviour_policy(logp.detach(), behaviour, mask, corrected)
                out = obj.surrogate(logp, old, a, mask, seq_adv, G, rho=rho, **obj.kwargs)
                assert {t.device for t in [*out[:2], *is_info.values()]} == {DEVICE}
            per_token, coef, info = obj.surrogate(
                logp, logp.detach(), a, mask, seq_adv, G, **obj.kwargs
            )
            info.update(mismatch_stats(logp.detach(), behaviour, mask))
            for kl in KL_ESTIMATORS.values():
                per_token = per_token + 0.1 * kl(logp, ref, logp.detach())
            loss = aggregate(per_token, mask, obj.aggregation, norm)
            assert loss.device == DEVICE and coef.device == DEVICE
            c = coef * token_weights(mask, obj.aggregation)
            for key, v in cancellation_residual(c, a, mb.tokens, G).items():
                assert v.device == DEVICE
                cancel[key] = cancel[key] + v if key in cancel else v
            info["loss"] = loss.detach()
            for key, v in info.items():
                stats.setdefault(key, []).append(v)
        assert stack_stats(stats, cancel).device == DEVICE  # one tensor, read once
    # the metrics assembly reads host values only (the update's numbers already read)
    upd = UpdateResult(
        {
            "loss": [0.5, 0.25],
            "entropy": [1.0, 2.0],
            "trained_tokens": [3.0, 1.0],
            "groups": [1.0, 1.0],
        },
        {"residual_num": 0.0, "residual_den": 1.0, "shared_tokens": 3.0, "tokens": 9.0},
        1.0,
        1,
        False,
        0.0,
    )
    m = step_metrics(batch, upd, 1e-4)
    assert m["completion_length"] == sum(batch.rollout.lengths) / (2 * G)
    assert m["entropy"] == (3.0 * 1.0 + 1.0 * 2.0) / 4.0  # weighted by trained tokens


def test_objectives_under_fake_cuda_tensors():
    """The objectives with FakeTensorMode's fake `cuda` tensors: every output stays on cuda,
    and a CPU advantage tensor among cuda inputs is caught as a device mismatch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    n, T = 2 * G, 5
    with FakeTensorMode():
        mask = torch.ones(n, T, device="cuda")
        logp = torch.randn(n, T, device="cuda")  # no autograd: it aborts on fake cuda here
        seq_adv = torch.randn(n, device="cuda")
        adv = seq_adv.unsqueeze(-1) * mask
        for name, obj in OBJECTIVES.items():
            per_token, coef, info = obj.surrogate(
                logp, logp.detach(), adv, mask, seq_adv, G, **obj.resolve({})
            )
            loss = aggregate(per_token, mask, obj.aggregation, 10.0)
            assert loss.device.type == "cuda" and coef.device.type == "cuda", name
            assert all(v.device.type == "cuda" for v in info.values()), name
        # a RuntimeError either way: FakeTensorDeviceMismatchError in torch 2.13 ("found at least
        # two devices"), a plain one in torch 2.11, the GPU image's ("two different devices")
        with pytest.raises(RuntimeError, match=r"two (different )?devices"):
            OBJECTIVES["ibpo"].surrogate(
                logp,
                logp.detach(),
                torch.randn(n, T),
                mask,
                seq_adv,
                G,
                **OBJECTIVES["ibpo"].resolve({}),
            )


def test_the_stand_in_device_catches_a_cpu_mask():
    """The check itself: a CPU edit mask meeting device advantages fails, as on CUDA."""
    from ibpo.algo.advantages import token_advantages

    seq_adv = torch.zeros(G, device=DEVICE)
    mask = torch.ones(G, 3, device=DEVICE)
    with pytest.raises(RuntimeError, match="device"):
        token_advantages(seq_adv, mask, torch.ones(G, 3, dtype=torch.bool), 0.0)
