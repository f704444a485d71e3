"""Command-line routing that needs no model: `ibpo eval` and `ibpo plan` argument handling."""

from ibpo.cli import main


def test_eval_needs_a_known_benchmark(capsys):
    assert main(["eval"]) == 2
    assert main(["eval", "mmlu"]) == 2
    err = capsys.readouterr().err
    assert "math500" in err and "humaneval" in err


def test_plan_accepts_overrides_after_options_and_rejects_stray_words(tmp_path, capsys):
    import json

    import pytest

    cfg = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--model-config", str(path), "rollout.max_new_tokens=64"]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(["plan", "--model-config", str(path), "missing.yaml"]) == 2
    assert "recipe 'missing.yaml' not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--model-config", str(path), "--bogus", "1"])


def test_a_reward_failing_before_training_is_no_config_error(monkeypatch, capsys):
    """A reward function that fails in the held-out evaluation before training: one line and
    the reward_failed exit code (6), not the bad-input one (2) of a configuration error."""
    from ibpo import cli
    from ibpo.config import ConfigError
    from ibpo.rewards.functions import RewardError

    assert not issubclass(RewardError, ConfigError)

    def fails(cfg):
        raise RewardError("reward function 'f' raised on sample 2: ValueError: no")

    monkeypatch.setattr(cli, "run_loaded", fails)
    assert main(["train", "train.steps=1"]) == 6
    assert capsys.readouterr().err == (
        "ibpo: error: reward function 'f' raised on sample 2: ValueError: no\n"
    )
