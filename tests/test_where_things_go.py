"""docs/layout.md's "Where things go", followed end to end: the objective file the doc shows is
written out as it stands there, imported, and trains the tiny model from the doc's recipe, which
sets the objective's own knob (a bad registration is refused with the fix); a new benchmark is
one BENCHMARKS entry that the evaluation command line runs on local rows."""

import dataclasses
import importlib
import json
import math
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from ibpo import recipe
from ibpo.algo.objectives import (
    OBJECTIVES,
    Param,
    clipped_token,
    eps_high,
    eps_low,
    register_objective,
    unregister_objective,
)
from ibpo.config import ConfigError, ObjectiveConfig
from ibpo.recipe import load_config, resolve_params

ROOT = Path(__file__).resolve().parents[1]


def _documented(language: str) -> str:
    """The `language` block of layout.md's "A new objective" (dedented)."""
    text = (ROOT / "docs/layout.md").read_text()
    section = text[text.index("**A new objective**") : text.index("**A new reward**")]
    block = re.search(rf"```{language}\n(.*?)```", section, re.S).group(1)
    return textwrap.dedent(block)


def documented_objective_file() -> str:
    """The python block of layout.md's "A new objective": the one file a user writes."""
    return _documented("python")


@pytest.fixture
def my_objective(tmp_path, monkeypatch):
    """The documented file as my_objective.py on the path, imported (which registers it), and
    removed again afterwards (the registry is the process's)."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "my_objective.py").write_text(documented_objective_file())
    monkeypatch.syspath_prepend(str(folder))
    yield importlib.import_module("my_objective")
    unregister_objective("capped_pg")
    sys.modules.pop("my_objective", None)


def _tiny(model_dir, out, *extra) -> list[str]:
    return [
        f"model.name={model_dir}",
        "model.quantization=none",
        "rollout.group_size=2",
        "rollout.max_new_tokens=4",
        "train.prompts_per_step=2",
        "train.steps=2",
        "data.eval_size=0",
        f"run.output_dir={out}",
        "run.save_every=0",
        *extra,
    ]


def test_the_documented_objective_file_trains(my_objective, tiny_model_dir, tmp_path):
    """The doc's file and the doc's recipe: the objective's new knob (`cap`) set in YAML, resolved
    once, and what the surrogate receives at every call of the run."""
    import ibpo

    spec = OBJECTIVES["capped_pg"]
    assert spec.surrogate is my_objective.capped_pg and list(spec.params) == ["cap"]
    recipe_file = tmp_path / "my_recipe.yaml"
    recipe_file.write_text(_documented("yaml"))
    args = _tiny(tiny_model_dir, tmp_path / "run")
    cfg = load_config(recipe_file, args)
    # resolved once, from its registration: its knob as the recipe set it, its shared defaults,
    # its repairs, no dynamic sampling
    assert cfg.objective.name == "capped_pg" and cfg.objective.params == {"cap": 1.2}
    assert cfg.objective.aggregation == "token_mean" and cfg.objective.scale_rewards is False
    assert cfg.repair.enabled is True and cfg.rollout.dynamic_sampling is False
    assert load_config(None, [*args, "objective.name=capped_pg"]).objective.params == {"cap": 1.5}
    resolved = resolve_params(cfg.objective)
    assert resolved.surrogate is my_objective.capped_pg and resolved.kwargs == {"cap": 1.2}
    assert resolved.is_level == "token" and resolved.counterfactual
    with pytest.raises(ConfigError, match=re.escape("objective.params.cap=0.5 must be >= 1")):
        load_config(recipe_file, [*args, "objective.params.cap=0.5"])
    with pytest.raises(ConfigError) as e:
        load_config(recipe_file, [*args, "objective.params.gate=token"])
    assert "objective.params.gate is not a parameter of objective 'capped_pg' (it takes: cap)" in (
        str(e.value)
    )

    seen = []  # the cap each call of the surrogate received

    def spy(*a, cap, **kw):
        seen.append(cap)
        return my_objective.capped_pg(*a, cap=cap, **kw)

    OBJECTIVES["capped_pg"] = dataclasses.replace(spec, surrogate=spy)
    try:
        result = ibpo.train(recipe_file, overrides=args)  # as the doc says: after the import
    finally:
        OBJECTIVES["capped_pg"] = spec
    assert result.summary["exit_code"] == 0 and result.summary["steps"] == 2
    assert seen and set(seen) == {1.2}
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps)
    # the step called its surrogate: the statistic only it returns is logged, every step
    assert all(0.0 <= r["capped_share"] <= 1.0 for r in steps)
    assert all("repairs" in r for r in steps)  # repairs ran: declared on by default
    saved = yaml.safe_load((tmp_path / "run/config.yaml").read_text())
    assert saved["objective"]["params"] == {"cap": 1.2}  # set by the recipe: kept
    assert recipe.from_dict(saved) == cfg  # the run's config loads back while it is registered


# --- registering: refused with the fix ---------------------------------------------------------


def capped_pg(logp, old_logp, adv, mask, seq_adv, group_size, *, eps_high, rho=None):
    """A toy surrogate: policy gradient with the token ratio capped above at 1 + eps_high."""
    with torch.no_grad():
        coef = (logp - old_logp).exp().clamp(max=1 + eps_high)
    return -coef * adv * logp, coef, {}


def takes_tau(logp, old_logp, adv, mask, seq_adv, group_size, *, tau=0.5, rho=None):
    """A toy surrogate with a knob of its own."""
    return capped_pg(logp, old_logp, adv, mask, seq_adv, group_size, eps_high=tau, rho=rho)


@pytest.fixture
def toy_objective():
    """`capped_pg` registered for one test, removed afterwards."""
    register_objective(
        "capped_pg", capped_pg, level="token", aggregation="token_mean", params={"eps_high": 0.5}
    )
    yield "capped_pg"
    unregister_objective("capped_pg")


def test_an_unregistered_objective_is_one_error_naming_the_choices(toy_objective):
    assert "capped_pg" in OBJECTIVES and OBJECTIVES["capped_pg"].resolve({}) == {"eps_high": 0.5}
    unregister_objective("capped_pg")
    assert "capped_pg" not in OBJECTIVES
    with pytest.raises(ConfigError, match="choose one of: ibpo, dfpo, .*register_objective"):
        load_config(None, ["objective.name=capped_pg"])
    register_objective(  # for the fixture to remove again
        "capped_pg", capped_pg, level="token", aggregation="token_mean", params={"eps_high": 0.5}
    )


def test_a_variant_of_a_shipped_surrogate_is_one_registration():
    register_objective(
        "grpo_wide",
        clipped_token,
        level="token",
        aggregation="seq_mean",
        params={"eps_low": eps_low(0.2), "eps_high": eps_high(0.4)},
    )
    try:
        r = resolve_params(ObjectiveConfig(name="grpo_wide"))
        assert r.surrogate is clipped_token and r.kwargs == {"eps_low": 0.2, "eps_high": 0.4}
        assert not r.counterfactual and r.scale_rewards and r.overlong_buffer == 0.0
        cfg = load_config(None, ["objective.name=grpo_wide"])
        assert cfg.repair.enabled is False and cfg.rollout.dynamic_sampling is False
    finally:
        unregister_objective("grpo_wide")
    assert OBJECTIVES["grpo"].surrogate is clipped_token  # the shipped one is untouched


def test_the_decorator_form_registers_the_function():
    @register_objective("sign_pg", level="sequence", aggregation="seq_mean", dynamic_sampling=True)
    def sign_pg(logp, old_logp, adv, mask, seq_adv, group_size, *, rho=None):
        coef = torch.ones_like(logp)
        return -adv.sign() * logp, coef, {}

    try:
        spec = OBJECTIVES["sign_pg"]
        assert spec.surrogate is sign_pg and spec.level == "sequence" and spec.params == {}
        assert load_config(None, ["objective.name=sign_pg"]).rollout.dynamic_sampling is True
    finally:
        unregister_objective("sign_pg")


def _bad(fn=capped_pg, name="bad_pg", params=None, **kw):
    kw = {"level": "token", "aggregation": "token_mean", **kw}
    register_objective(name, fn, params=params or {"eps_high": 0.5}, **kw)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: _bad(name="grpo"), "'grpo' ships with ibpo; register yours under another name"),
        (lambda: _bad(name="Bad Name"), "lower-case letters, digits and '_'"),
        (lambda: _bad(level="group"), "level='group'; choose one of: token, sequence"),
        (lambda: _bad(aggregation="sum"), "aggregation='sum'; choose one of: token_mean"),
        (lambda: _bad(params={"eps_high": 0.5, "gate": "none"}), "does not take gate"),
        (lambda: _bad(params={"eps_high": eps_high(-1.0)}), "the default of objective.params."),
        (lambda: _bad(params={"eps_high": Param(str, 0.5)}), "eps_high: expected str, got 0.5"),
        (lambda: _bad(params={"rho": 1.0}), "parameter 'rho' must be a keyword name other"),
        (
            lambda: _bad(eps_high=0.5),
            "eps_high is not an argument of register_objective; "
            "declare the surrogate's knobs as params={'eps_high': ...}",
        ),
        (lambda: _bad(fn=lambda logp, old_logp: None), "does not take adv, mask, seq_adv"),
        (lambda: _bad(fn="clipped_token"), "the surrogate must be a function, got 'clipped"),
        (lambda: _bad(fn=3), "the surrogate must be a function"),
    ],
)
def test_a_bad_registration_is_refused_with_the_fix(call, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(")):
        call()
    assert "bad_pg" not in OBJECTIVES  # nothing half-registered


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"overlong_penalty": -1.0}, "default objective.overlong_penalty must be >= 0"),
        ({"scale_rewards": "yes"}, "default objective.scale_rewards: 'yes' is not"),
    ],
)
def test_a_shared_default_outside_the_recipes_rules_is_named_when_a_recipe_selects_it(kw, message):
    """The registration's shared defaults are the recipe's values: the fields' rules check them
    when a recipe names the objective."""
    register_objective(
        "bad_pg", capped_pg, level="token", aggregation="token_mean", params={"eps_high": 0.5},
        **kw,
    )  # fmt: skip
    try:
        with pytest.raises(ConfigError, match=r"objective 'bad_pg' \(its register_objective"):
            load_config(None, ["objective.name=bad_pg"])
        with pytest.raises(ConfigError, match=re.escape(message)):
            resolve_params(ObjectiveConfig(name="bad_pg"))
    finally:
        unregister_objective("bad_pg")
    assert load_config(None, ["objective.name=ibpo"]).objective.name == "ibpo"  # others unharmed


def test_a_knob_of_its_own_is_typed_checked_and_defaulted_from_a_recipe(tmp_path):
    """A plain default declares a knob of its type; objective.params sets it (an int for a
    float, "1e-4" as YAML reads it, null for the default); a value of another type or a knob
    the objective lacks is one error naming it."""
    register_objective("tau_pg", takes_tau, level="token", aggregation="seq_mean",
                       params={"tau": 0.5})  # fmt: skip
    try:
        recipe_file = tmp_path / "r.yaml"
        recipe_file.write_text("objective:\n  name: tau_pg\n  params:\n    tau: 1\n")
        cfg = load_config(recipe_file)
        assert cfg.objective.params == {"tau": 1.0} and isinstance(
            cfg.objective.params["tau"], float
        )
        assert resolve_params(cfg.objective).kwargs == {"tau": 1.0}
        assert load_config(recipe_file, ["objective.params.tau=1e-4"]).objective.params == {
            "tau": 1e-4
        }
        assert load_config(recipe_file, ["objective.params.tau=null"]).objective.params == {
            "tau": 0.5
        }
        with pytest.raises(ConfigError, match="objective.params.tau: expected float, got 'x'"):
            load_config(recipe_file, ["objective.params.tau=x"])
        with pytest.raises(ConfigError, match=r"objective.params.eps_low .*\(it takes: tau\)"):
            load_config(recipe_file, ["objective.params.eps_low=0.1"])
        # its recipe form drops what resolving filled: another objective inherits afresh
        rerun = load_config(load_config(None, ["objective.name=tau_pg"]), ["objective.name=grpo"])
        assert rerun.objective.params == {"eps_low": 0.2, "eps_high": 0.2}
    finally:
        unregister_objective("tau_pg")


def test_registering_a_name_twice_needs_replace(toy_objective):
    with pytest.raises(ValueError, match="already registered; pick another name or pass replace"):
        register_objective(
            "capped_pg", clipped_token, level="token", aggregation="seq_mean",
            params={"eps_high": 0.1},
        )  # fmt: skip
    register_objective(
        "capped_pg", clipped_token, level="token", aggregation="seq_mean",
        params={"eps_high": 0.1}, replace=True,
    )  # fmt: skip
    assert OBJECTIVES["capped_pg"].surrogate is clipped_token
    with pytest.raises(ValueError, match="ships with ibpo and cannot be removed"):
        unregister_objective("ibpo")


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
    assert grade("The answer is \\boxed{2}", "2").score == 1.0 and extract("\\boxed{2}") == "2"

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

    cfg = load_config(None, ["objective.name=grpo", "objective.params.eps_high=0.3"])
    assert resolve_params(cfg.objective).kwargs == {"eps_low": 0.2, "eps_high": 0.3}
    cfg.objective.params["weights"] = "min_replace"  # set by hand after resolving: still refused
    with pytest.raises(ConfigError, match="objective.params.weights is not a parameter of "):
        resolve_params(cfg.objective)
    ibpo = resolve_params(ObjectiveConfig())
    with pytest.raises(ValueError, match="repair.enabled is unresolved .* ibpo.recipe.resolve"):
        repairs_enabled(Config(), ibpo)
    assert repairs_enabled(recipe.resolve(Config()), ibpo) is True
