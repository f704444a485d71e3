"""Sampling streams: a step draws its completions and its repairs from streams of its own, seeded
by (seed, process, step, phase, round), so what it samples depends on the policy alone."""

import itertools
import random

import pytest
import torch

from ibpo.data import PromptStream, builtin_examples
from ibpo.generation import SamplingStreams, hf_generator
from ibpo.generation.streams import sampling_stream, stream_seed
from ibpo.modeling import load_policy
from ibpo.recipe import load_config, resolve_params
from ibpo.step import collect_batch
from tests.conftest import grader_rewards

# tiny models: one intra-op thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
KEY = (0, 0, 5, "rollout", 0)


def test_stream_seeds_are_stable_and_differ_by_every_part_of_the_key():
    keys = [KEY, (1, 0, 5, "rollout", 0), (0, 1, 5, "rollout", 0), (0, 0, 6, "rollout", 0),
            (0, 0, 5, "repair", 0), (0, 0, 5, "rollout", 1)]  # fmt: skip
    seeds = [stream_seed(*k) for k in keys]
    assert len(set(seeds)) == len(keys) and all(0 <= s < 2**63 for s in seeds)
    # the same in every process and release: a run resumed elsewhere samples the same
    assert stream_seed(0, 0, 3, "rollout", 0) == 4536459807690527133


def test_a_stream_repeats_itself_and_leaves_the_process_streams_alone():
    torch.manual_seed(1)
    state = torch.get_rng_state()
    with sampling_stream(CPU, *KEY):
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), state)
    torch.rand(100)  # anything else drawing random numbers in between
    state = torch.get_rng_state()
    with sampling_stream(CPU, *KEY):
        assert torch.equal(torch.rand(4), a)
    with sampling_stream(CPU, 0, 0, 6, "rollout", 0):
        assert not torch.equal(torch.rand(4), a)
    with sampling_stream(torch.device("meta"), *KEY):  # no generator of its own to fork
        assert torch.equal(torch.rand(4), a)
    assert torch.equal(torch.get_rng_state(), state)


def test_an_accelerator_without_current_device_forks_its_one_generator(monkeypatch):
    calls = []

    class Module:  # the shape of torch.mps: one device, no current_device()
        get_rng_state = staticmethod(lambda device: calls.append(("get", device)) or "state")
        set_rng_state = staticmethod(lambda state, device: calls.append(("set", state, device)))
        manual_seed = staticmethod(lambda seed: calls.append(("seed", seed)))

    real = torch.get_device_module
    monkeypatch.setattr(torch, "get_device_module", lambda t: Module if t == "mps" else real(t))
    # torch 2.11's fork_rng (the GPU image's) looks the module up as torch.<device type>
    monkeypatch.setattr(torch, "mps", Module)
    with sampling_stream(torch.device("mps"), *KEY):
        assert calls == [("get", 0), ("seed", stream_seed(*KEY))]
    assert calls[-1] == ("set", "state", 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_stream_forks_the_cuda_generator_of_its_device():
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.manual_seed(1)
    state = torch.cuda.get_rng_state(dev)
    with sampling_stream(dev, *KEY):
        a = torch.rand(4, device=dev)
    assert torch.equal(torch.cuda.get_rng_state(dev), state)
    torch.rand(100, device=dev)
    with sampling_stream(dev, *KEY):
        assert torch.equal(torch.rand(4, device=dev), a)


def _two_steps(model_dir, objective: str, streams: bool) -> tuple[list[list[str]], float]:
    """Two steps' rollouts of one unchanged policy (the completions of each step), and how many
    repairs the first step ran."""
    cfg = load_config(
        None,
        [f"model.name={model_dir}", "rollout.max_new_tokens=8", "rollout.group_size=4",
         "train.prompts_per_step=2", f"objective.name={objective}"],
    )  # fmt: skip
    torch.manual_seed(0)
    model, tok = load_policy(cfg.model, CPU)
    # the same two prompts at both steps: only the step's key tells their samples apart
    stream = PromptStream(builtin_examples("arithmetic", "train")[:2] * 2, seed=0, shuffle=False)
    calls = itertools.count()
    reward = lambda text, answer: float(next(calls) % 2)  # noqa: E731  half of each group right
    texts, repairs, rewards = [], 0.0, grader_rewards(reward)
    state = torch.get_rng_state()
    for step in range(2):
        batch = collect_batch(
            hf_generator(model), tok, stream, cfg, resolve_params(cfg.objective), rewards,
            random.Random(0), SamplingStreams(CPU, cfg.train.seed, 0, step) if streams else None,
        )  # fmt: skip
        texts.append(batch.rollout.texts)
        repairs = repairs or batch.stats.get("repairs", 0.0)
    # rollouts and repairs drew from the step's streams only
    assert torch.equal(torch.get_rng_state(), state) == streams
    return texts, repairs


def test_repairs_do_not_shift_what_later_steps_sample(tiny_model_dir):
    ibpo, repairs = _two_steps(tiny_model_dir, "ibpo", streams=True)
    dfpo, none = _two_steps(tiny_model_dir, "dfpo", streams=False)
    assert repairs > 0 and none == 0  # ibpo's first step generated repairs, dfpo's did not
    # on the process's own stream the repairs' draws shift the second step's samples...
    shifted, _ = _two_steps(tiny_model_dir, "ibpo", streams=False)
    assert shifted[0] == dfpo[0] and shifted[1] != dfpo[1]
    # ...on the step's streams both methods sample the same completions at every step
    with_streams, _ = _two_steps(tiny_model_dir, "dfpo", streams=True)
    assert ibpo == with_streams and ibpo[0] != ibpo[1]


def test_the_trainer_keys_each_step_by_the_steps_done_before_it(
    tiny_model_dir, tmp_path, monkeypatch
):
    import ibpo.trainer as trainer_mod

    seen, real = [], trainer_mod.rl_step

    def spy(*args, step, **kwargs):
        seen.append(step)
        return real(*args, step=step, **kwargs)

    monkeypatch.setattr(trainer_mod, "rl_step", spy)
    args = [f"model.name={tiny_model_dir}", "model.quantization=none", "train.prompts_per_step=1",
            "rollout.group_size=2", "rollout.max_new_tokens=4", "data.eval_size=0",
            f"run.output_dir={tmp_path / 'run'}"]  # fmt: skip
    trainer_mod.run_recipe(load_config(None, [*args, "train.steps=2"]))
    trainer_mod.run_recipe(load_config(None, [*args, "train.steps=3", "run.resume_from=latest"]))
    assert seen == [0, 1, 2]  # a resumed run goes on with the next step's streams


def test_a_later_slice_samples_the_same_however_long_the_first_decoded(tiny_model_dir, monkeypatch):
    from ibpo.config import ModelConfig
    from ibpo.generation import hf

    model, tok = load_policy(ModelConfig(name=tiny_model_dir, quantization="none"), CPU)
    stop = tok.convert_tokens_to_ids("z")

    def end_marked_rows(input_ids, scores):  # rows whose prompt holds "z" end at once
        marked = (input_ids == stop).any(-1, keepdim=True)
        eos_only = torch.full_like(scores, float("-inf"))
        eos_only[:, tok.eos_token_id] = 0.0
        return torch.where(marked, eos_only, scores)

    def samples(first: str) -> tuple[list[int], list[list[int]]]:
        torch.manual_seed(7)  # the same generators at the call's start
        ro = hf.generate(model, tok, [first, "bbbb"], 2, 8, batch_size=2,
                         logits_processor=[end_marked_rows])  # fmt: skip
        return ro.lengths[:2], ro.tokens[2:]  # the first slice's lengths, the second's tokens

    (short, a), (long, b) = samples("zzzz"), samples("aaaa")
    assert short == [1, 1] and min(long) > 1  # the first slices decoded 1 and several positions
    assert a == b  # the second slice drew from its own stream
    monkeypatch.setattr(hf, "stream_position", lambda device: None)  # one stream per call
    assert samples("zzzz")[1] != samples("aaaa")[1]
