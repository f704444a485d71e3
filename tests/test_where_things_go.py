"""docs/layout.md's "Where things go", followed end to end: a new objective is registered,
selected by objective.name from a config and trains the tiny model; a new benchmark is one
BENCHMARKS entry that the evaluation command line runs on local rows."""

import json
import math

import pytest
import torch
import yaml

from ibpo import config
from ibpo.algo.objectives import (
    OBJECTIVES,
    SURROGATES,
    clipped_token,
    register_objective,
    unregister_objective,
)
from ibpo.config import ConfigError, ObjectiveConfig
from ibpo.recipe import load_config, resolve_params

CALLS: list[tuple[int, float]] = []


def capped_pg(logp, old_logp, adv, mask, seq_adv, group_size, *, eps_high, rho=None):
    """A toy surrogate: policy gradient with the token ratio capped above at 1 + eps_high."""
    CALLS.append((logp.shape[0], eps_high))
    with torch.no_grad():
        ratio = (logp - old_logp).exp()
        coef = ratio.clamp(max=1 + eps_high)
        if rho is not None:
            coef = coef * rho
        capped = ((ratio > 1 + eps_high).to(mask.dtype) * mask).sum() / mask.sum().clamp_min(1)
    return -coef * adv * logp, coef, {"capped_share": capped.double()}


@pytest.fixture
def toy_objective():
    """`capped_pg` registered for one test, removed afterwards (the registry is the process's)."""
    CALLS.clear()
    register_objective(
        "capped_pg",
        capped_pg,
        level="token",
        aggregation="token_mean",
        scale_rewards=False,
        repairs=True,
        eps_high=0.5,
    )
    yield "capped_pg"
    unregister_objective("capped_pg")


def _tiny(model_dir, out, *extra):
    return load_config(
        None,
        [
            f"model.name={model_dir}",
            "model.quantization=none",
            "rollout.group_size=2",
            "rollout.max_new_tokens=4",
            "train.prompts_per_step=2",
            "train.steps=2",
            "train.eval_before=false",
            "data.eval_size=0",
            f"run.output_dir={out}",
            "run.progress=false",
            "run.plots=false",
            "run.save_every=0",
            *extra,
        ],
    )


def test_a_new_objective_trains_from_a_config(toy_objective, tiny_model_dir, tmp_path):
    from ibpo.trainer import train

    cfg = _tiny(tiny_model_dir, tmp_path / "run", "objective.name=capped_pg")
    # resolved once, from its declaration: its defaults, its repairs, no dynamic sampling
    assert cfg.objective.eps_high == 0.5 and cfg.objective.aggregation == "token_mean"
    assert cfg.objective.scale_rewards is False and cfg.objective.eps_low is None
    assert cfg.repair.enabled is True and cfg.rollout.dynamic_sampling is False
    own = _tiny(
        tiny_model_dir, tmp_path / "own", "objective.name=capped_pg", "objective.eps_high=2"
    )
    resolved = resolve_params(own.objective)
    assert resolved.surrogate is capped_pg and resolved.kwargs == {"eps_high": 2.0}
    assert resolved.is_level == "token" and resolved.counterfactual
    with pytest.raises(ConfigError, match="objective.gate does not apply to 'capped_pg'"):
        load_config(None, ["objective.name=capped_pg", "objective.gate=token"])

    summary = train(cfg)
    assert summary["exit_code"] == 0 and summary["steps"] == 2
    assert CALLS and all(eps == 0.5 for _, eps in CALLS)  # the step called the toy surrogate
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps)
    assert all(0.0 <= r["capped_share"] <= 1.0 for r in steps)  # its own statistic is logged
    assert all("repairs" in r for r in steps)  # repairs ran: declared on by default
    saved = config.from_dict(yaml.safe_load((tmp_path / "run/config.yaml").read_text()))
    assert saved == cfg  # the run's config loads back while the objective is registered


def test_an_unregistered_objective_is_one_error_naming_the_choices(toy_objective):
    assert "capped_pg" in OBJECTIVES and OBJECTIVES["capped_pg"].defaults == {"eps_high": 0.5}
    unregister_objective("capped_pg")
    assert "capped_pg" not in OBJECTIVES and "capped_pg" not in SURROGATES
    with pytest.raises(ConfigError, match="choose one of: ibpo, dfpo, .*register_objective"):
        load_config(None, ["objective.name=capped_pg"])
    register_objective(  # for the fixture to remove again
        "capped_pg", capped_pg, level="token", aggregation="token_mean", eps_high=0.5
    )


def test_a_variant_of_a_shipped_surrogate_is_one_declaration():
    register_objective(
        "grpo_wide",
        "clipped_token",
        level="token",
        aggregation="seq_mean",
        eps_low=0.2,
        eps_high=0.4,
    )
    try:
        r = resolve_params(ObjectiveConfig(name="grpo_wide"))
        assert r.surrogate is clipped_token and r.kwargs == {"eps_low": 0.2, "eps_high": 0.4}
        assert not r.counterfactual and r.scale_rewards and r.overlong_buffer == 0.0
        cfg = load_config(None, ["objective.name=grpo_wide"])
        assert cfg.repair.enabled is False and cfg.rollout.dynamic_sampling is False
    finally:
        unregister_objective("grpo_wide")
    assert "clipped_token" in SURROGATES  # a shipped surrogate stays


def test_the_decorator_form_registers_the_function():
    @register_objective("sign_pg", level="sequence", aggregation="seq_mean", dynamic_sampling=True)
    def sign_pg(logp, old_logp, adv, mask, seq_adv, group_size, *, rho=None):
        coef = torch.ones_like(logp)
        return -adv.sign() * logp, coef, {}

    try:
        assert SURROGATES["sign_pg"] is sign_pg and OBJECTIVES["sign_pg"].is_level == "sequence"
        assert load_config(None, ["objective.name=sign_pg"]).rollout.dynamic_sampling is True
    finally:
        unregister_objective("sign_pg")


def _bad(fn=capped_pg, name="bad_pg", **kw):
    kw = {"level": "token", "aggregation": "token_mean", "eps_high": 0.5, **kw}
    register_objective(name, fn, **kw)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: _bad(name="grpo"), "'grpo' ships with ibpo; register yours under another name"),
        (lambda: _bad(name="Bad Name"), "lower-case letters, digits and '_'"),
        (lambda: _bad(level="group"), "level='group'; choose one of: token, sequence"),
        (lambda: _bad(aggregation="sum"), "objective.aggregation='sum'; choose one of"),
        (lambda: _bad(eps_high=-1.0), "default objective.eps_high must be >= 0"),
        (lambda: _bad(scale_rewards="yes"), "default objective.scale_rewards: 'yes' is not"),
        (lambda: _bad(clip=0.2), "not an objective parameter: clip"),
        (lambda: _bad(gate="none"), "does not take gate"),
        (lambda: _bad(fn=lambda logp, old_logp: None), "does not take adv, mask, seq_adv"),
        (lambda: _bad(fn="clipped"), "surrogate 'clipped'; choose one of: exchangeable"),
        (lambda: _bad(fn=3), "the surrogate must be a function"),
    ],
)
def test_a_bad_declaration_is_refused_with_the_fix(call, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        call()
    assert "bad_pg" not in OBJECTIVES and "bad_pg" not in SURROGATES  # nothing half-registered


def test_registering_a_name_twice_needs_replace(toy_objective):
    with pytest.raises(ConfigError, match="already declared; pick another name or pass replace"):
        register_objective(
            "capped_pg", "clipped_token", level="token", aggregation="seq_mean", eps_high=0.1
        )
    with pytest.raises(ConfigError, match="ships with ibpo and cannot be removed"):
        unregister_objective("ibpo")


def test_every_declaration_names_a_surrogate_that_takes_its_parameters():
    import inspect

    for name, spec in config.OBJECTIVE_SPECS.items():
        params = inspect.signature(SURROGATES[spec.surrogate]).parameters
        assert "rho" in params and all(k in params for k in spec.takes), name
        assert OBJECTIVES[name].surrogate is SURROGATES[spec.surrogate]


# --- a new benchmark ---------------------------------------------------------------------------


def test_a_new_benchmark_is_one_entry_the_eval_command_runs(tiny_model_dir, tmp_path, monkeypatch):
    from ibpo.evaluation import benchmarks
    from ibpo.evaluation.cli import main

    def to_problem(row: dict, fallback: str) -> benchmarks.Problem:
        return benchmarks.Problem(str(row.get("id", fallback)), f"{row['q']} =", str(row["a"]))

    bench = benchmarks.Benchmark("sums", "math", "example/sums", "test", ("q", "a"), to_problem)
    monkeypatch.setitem(benchmarks.BENCHMARKS, "sums", bench)
    rows = tmp_path / "sums.jsonl"
    rows.write_text("".join(json.dumps({"id": f"s{i}", "q": f"{i}+1", "a": i + 1}) + "\n"
                            for i in range(3)))  # fmt: skip
    problems = benchmarks.load_problems(bench, data=str(rows), limit=2)
    assert [(p.id, p.gold) for p in problems] == [("s0", "1"), ("s1", "2")]
    grade, extract = benchmarks.grader(bench)
    assert grade("The answer is \\boxed{2}", "2") == 1.0 and extract("\\boxed{2}") == "2"

    out = tmp_path / "eval"
    argv = ["--model", str(tiny_model_dir), "--data", str(rows), "--limit", "2", "--n", "1",
            "--max-new-tokens", "4", "--output-dir", str(out), "--no-progress"]  # fmt: skip
    assert main(argv, benchmark="sums") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmark"] == "sums" and summary["problems"] == 2 and summary["n"] == 1
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(s["problem_id"] for s in samples) == ["s0", "s1"]


def test_a_run_section_is_checked_not_refilled_and_the_step_reads_repairs_as_resolved():
    from ibpo.config import Config
    from ibpo.step import repairs_enabled

    cfg = load_config(None, ["objective.name=grpo", "objective.eps_high=0.3"])
    assert resolve_params(cfg.objective).kwargs == {"eps_low": 0.2, "eps_high": 0.3}
    cfg.objective.weights = "min_replace"  # set by hand after resolving: still refused
    with pytest.raises(ConfigError, match="objective.weights does not apply to 'grpo'"):
        resolve_params(cfg.objective)
    with pytest.raises(ValueError, match="repair.enabled is unresolved .* ibpo.config.resolve"):
        repairs_enabled(Config(), OBJECTIVES["ibpo"])
    assert repairs_enabled(config.resolve(Config()), OBJECTIVES["ibpo"]) is True
