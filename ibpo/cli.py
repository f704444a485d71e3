"""Command line: `ibpo train [RECIPE] [k=v ...]`, `ibpo config`, `ibpo plan`, `ibpo eval`,
`ibpo report`, `ibpo push`, `ibpo recipes`.

RECIPE is a YAML file or the name of a packaged recipe (`qwen3_1.7b/gsm8k_ibpo_1gpu`, which
`ibpo recipes` lists and `ibpo recipes copy NAME [DEST]` copies; ibpo/catalog.py).

`ibpo train` runs through ibpo.train (ibpo/api.py), the Python API. With no arguments it runs
the embedded CPU demo (SmolLM2-135M-Instruct, 4-bit QLoRA, built-in arithmetic) and prints a
one-line summary. Configuration errors print one message that names the fix and exit with
status 2, never a traceback. `ibpo train` exits with how the run ended (summary.json's `status`
and `exit_code`): 0 completed, 1 failed (a full disk while saving), 2 bad input (configuration,
data, output_dir), 3 out_of_memory, 4 nonfinite, 5 mismatch (rollouts not from the trained
policy), 6 reward_failed (a reward function raised or returned a bad value; the steps before
it are saved), 130 interrupted by SIGINT (Ctrl-C, also before training started) and 143 by
SIGTERM; an interrupted run resumes with run.resume_from=latest.
`ibpo plan ... [--gpus N] [--gpu-memory-gb M] [--sharding ddp|fsdp] [--model-config
PATH_OR_HUB_ID]` prints the estimated
peak GPU memory of the recipe per phase (ibpo/plan/) and settings that fit when it does not.
`ibpo eval BENCHMARK [options]` is the same as `python scripts/eval_<BENCHMARK>.py [options]`
(ibpo/evaluation/cli.py).
`ibpo report OUTPUT_DIR` prints a run's summary and writes its plots (ibpo/run/report.py).
`ibpo push OUTPUT_DIR --repo-id USER/NAME [--public] [--eval-dir DIR ...] [--dry-run]` uploads a
run's adapter, tokenizer, recipe, metrics and a model card to the Hugging Face Hub (ibpo/hub/).
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from ibpo.api import run_loaded
from ibpo.catalog import main as recipes_main
from ibpo.catalog import resolve_recipe
from ibpo.config import ConfigError
from ibpo.distributed import leave_if_ended_together
from ibpo.evaluation.benchmarks import BENCHMARKS
from ibpo.evaluation.cli import main as eval_main
from ibpo.hub.push import main as push_main
from ibpo.plan.fit import estimate, format_plan
from ibpo.quiet import quiet_third_party
from ibpo.recipe import load_config
from ibpo.rewards.functions import RewardError
from ibpo.run.failures import EXIT_CODES, StoppedEarly, exit_code
from ibpo.run.report import main as report_main


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    recipe = None
    overrides = []
    for item in items:
        if "=" in item:
            overrides.append(item)
        elif recipe is None:
            recipe = item
        else:
            raise ConfigError(f"unexpected argument '{item}': give one recipe and key=value pairs")
    return recipe, overrides


def summary_line(s: dict) -> str:
    def acc(e):
        return f"{e['accuracy']:.3f}" if e and "accuracy" in e else "n/a"

    n = (s.get("eval_after") or s.get("eval_before") or {}).get("n", 0)
    return (
        f"ibpo: {s['objective']} on {s['model']} ({s['quantization']}), {s['steps']} steps, "
        f"held-out accuracy {acc(s['eval_before'])} -> {acc(s['eval_after'])} (n={n}), "
        f"{s['wall_seconds']:.0f} s [{s['status']}] adapter: {s['adapter']}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quiet_third_party()  # known harmless third-party noise (ibpo/quiet.py); -W shows it
    if argv[:1] in (["eval"], ["report"], ["push"], ["recipes"]):
        return _delegated(argv)
    parser = _parser()
    # parse_known_args: overrides may follow options (`ibpo plan r.yaml --gpus 2 train.steps=5`)
    ns, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    ns.args = [*ns.args, *extra]
    return _run(ns)


def _delegated(argv: list[str]) -> int:
    """The commands with a command line of their own: eval, report, push, recipes."""
    if argv[:1] == ["eval"]:  # `ibpo eval BENCHMARK [options]` = scripts/eval_<BENCHMARK>.py
        if len(argv) < 2 or argv[1] not in BENCHMARKS:
            print(f"usage: ibpo eval {{{','.join(sorted(BENCHMARKS))}}} [options]", file=sys.stderr)
            return 2
        return eval_main(argv[2:], benchmark=argv[1])
    if argv[:1] == ["report"]:  # `ibpo report OUTPUT_DIR`: summary table + plots of a run
        return report_main(argv[1:])
    if argv[:1] == ["push"]:  # `ibpo push OUTPUT_DIR --repo-id USER/NAME` = scripts/push_adapter.py
        return push_main(argv[1:])
    return recipes_main(argv[1:])  # `ibpo recipes [list | copy NAME [DEST]]`: the packaged recipes


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ibpo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="run a recipe (default: the embedded CPU demo)")
    p_train.add_argument("args", nargs="*", help="[RECIPE] [section.key=value ...]")
    p_cfg = sub.add_parser("config", help="print the resolved configuration as YAML")
    p_cfg.add_argument("args", nargs="*", help="[RECIPE] [section.key=value ...]")
    sub.add_parser("eval", help="evaluate a model/adapter on a benchmark: ibpo eval NAME --help")
    sub.add_parser("report", help="summary table and plots of a run: ibpo report OUTPUT_DIR")
    sub.add_parser("push", help="upload an adapter + model card to the Hub: ibpo push --help")
    sub.add_parser("recipes", help="list the packaged recipes, or copy one: ibpo recipes --help")
    p_plan = sub.add_parser("plan", help="estimate peak GPU memory; suggest settings that fit")
    p_plan.add_argument("args", nargs="*", help="[RECIPE] [section.key=value ...]")
    p_plan.add_argument("--gpus", type=int, default=1, help="GPUs sharing the run")
    p_plan.add_argument(
        "--sharding",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="ddp: each GPU a full replica | fsdp: full shard",
    )
    p_plan.add_argument("--gpu-memory-gb", type=float, default=24.0, help="GiB per GPU")
    p_plan.add_argument(
        "--model-config", help="config.json, model folder or Hub id (default: model.name)"
    )
    return parser


def _run(ns: argparse.Namespace) -> int:
    """train, config or plan on the recipe and overrides given -> the exit status."""
    try:
        recipe, overrides = _split_args(ns.args)
        cfg = load_config(resolve_recipe(recipe), overrides)
        if ns.command == "config":
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
            return 0
        if ns.command == "plan":
            plan = estimate(ns.model_config, cfg, ns.gpus, ns.gpu_memory_gb, ns.sharding)
            print(format_plan(plan))
            return 0
        summary = run_loaded(cfg).summary
    except StoppedEarly as e:  # Ctrl-C before the loop: nothing trained
        print(f"ibpo: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C where no handler says more (imports, the final evaluation)
        print("ibpo: interrupted", file=sys.stderr)
        return EXIT_CODES["interrupted"]
    except ConfigError as e:
        print(f"ibpo: error: {e}", file=sys.stderr)
        return 2
    except RewardError as e:  # in the held-out evaluation before training: nothing trained
        print(f"ibpo: error: {e}", file=sys.stderr)
        return EXIT_CODES["reward_failed"]
    except RuntimeError as e:
        if "embedded default model" not in str(e):
            raise
        print(f"ibpo: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:  # several processes: the summary once
        print(summary_line(summary))  # the whole summary is <output_dir>/summary.json
    # schedulers and scripts tell the endings apart (an interrupted run is resumable, not done)
    code = summary.get("exit_code", exit_code(summary["status"]))
    leave_if_ended_together(code)  # several processes: without the C++ teardown (distributed.py)
    return code


if __name__ == "__main__":
    sys.exit(main())
