"""Packaged recipes: a wheel holds them, `ibpo recipes` lists and copies them, and `ibpo train`,
`config` and `plan` take a packaged name where a file path goes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from ibpo import catalog
from ibpo.cli import main

ROOT = Path(__file__).resolve().parents[1]
NAME = "qwen3_1.7b/gsm8k_ibpo_1gpu"


def test_every_recipe_file_has_a_packaged_name():
    names = catalog.packaged()
    files = sorted(ROOT.glob("recipes/*/*.yaml"))
    assert len(names) == len(files) > 5
    assert names[NAME] == ROOT / "recipes" / f"{NAME}.yaml"
    assert names["accelerate/single_gpu"].name == "single_gpu.yaml"
    # .yaml and a leading recipes/ are accepted, as a clone's path would be typed
    assert catalog.find(f"recipes/{NAME}.yaml") == names[NAME]


def test_config_resolves_a_packaged_name(capsys):
    assert main(["config", NAME, "train.steps=3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["name"] == "Qwen/Qwen3-1.7B" and printed["train"]["steps"] == 3


def test_a_file_wins_over_a_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen3_1.7b").mkdir()
    (tmp_path / "qwen3_1.7b" / "gsm8k_ibpo_1gpu").write_text("train:\n  steps: 7\n")
    assert catalog.resolve_recipe(NAME) == NAME  # the local file, not the packaged one
    assert catalog.resolve_recipe(f"{NAME}.yaml").startswith(str(catalog.recipes_root()))


def test_an_unknown_name_is_one_error_naming_the_list(capsys):
    assert main(["train", "qwen3_1.7b/nope"]) == 2
    err = capsys.readouterr().err
    assert "recipe 'qwen3_1.7b/nope' not found" in err and "`ibpo recipes`" in err
    assert "Traceback" not in err


def test_recipes_lists_names_and_hardware(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in catalog.packaged():
        assert f"  {name} " in out
    assert "one 24 GB GPU" in out and "accelerate/ddp_2gpu" in out
    assert main(["recipes", "list"]) == 0 and capsys.readouterr().out == out


def test_copy_never_overwrites_without_force(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    src = catalog.packaged()[NAME]
    assert main(["recipes", "copy", NAME]) == 0
    here = tmp_path / "gsm8k_ibpo_1gpu.yaml"
    assert here.read_text() == src.read_text()
    assert f"ibpo train {here.name}" in capsys.readouterr().out
    here.write_text("# mine\n")
    assert main(["recipes", "copy", NAME]) == 2
    assert "exists; nothing was copied. Fix: --force" in capsys.readouterr().err
    assert here.read_text() == "# mine\n"
    assert main(["recipes", "copy", NAME, "--force"]) == 0
    assert here.read_text() == src.read_text()
    # into a folder, existing or named with a trailing slash; to a file name
    assert main(["recipes", "copy", NAME, "new/"]) == 0
    assert (tmp_path / "new" / "gsm8k_ibpo_1gpu.yaml").is_file()
    assert main(["recipes", "copy", NAME, "new"]) == 2  # new/gsm8k_ibpo_1gpu.yaml exists
    assert main(["recipes", "copy", "accelerate/cpu", "acc.yaml"]) == 0
    assert "--config_file acc.yaml -m ibpo.cli train" in capsys.readouterr().out
    assert main(["recipes", "copy", "nope"]) == 2
    assert "not found" in capsys.readouterr().err


def test_pyproject_lists_every_package_and_recipe_folder():
    """setuptools' explicit package list: a new subpackage or recipe folder must be added."""
    block = re.search(r"\npackages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S)
    listed = set(re.findall(r'"([\w.]+)"', block.group(1)))
    want = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ibpo").rglob("__init__.py")
    }
    want |= {"ibpo.recipes"} | {
        f"ibpo.recipes.{p.name}"
        for p in (ROOT / "recipes").iterdir()
        if p.is_dir() and p.name.isidentifier()
    }
    assert listed == want


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A non-editable wheel built from a copy of the source (the build writes into its tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__")
    for name in ("ibpo", "recipes"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*cmd, "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True)
    (found,) = (tmp / "dist").glob("ibpo-*.whl")
    return found


def test_the_wheel_holds_every_recipe_once(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n for n in names if n.endswith(".yaml"))
    want = sorted(f"ibpo/{p.relative_to(ROOT).as_posix()}" for p in ROOT.glob("recipes/*/*.yaml"))
    assert shipped == want
    assert "ibpo/recipes/train.py" in names and "ibpo/catalog.py" in names
    assert not [n for n in names if n.startswith("recipes/")]  # no second copy at the top


def test_an_installed_wheel_resolves_packaged_names(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = (
        "from ibpo import catalog, recipe; import ibpo; "
        f"print(ibpo.__file__); print(catalog.recipes_root()); "
        f"print(recipe.load_config(catalog.resolve_recipe('{NAME}')).model.name)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    module, root, model = out.stdout.split()
    assert module.startswith(str(site)) and root == str(site / "ibpo" / "recipes")
    assert model == "Qwen/Qwen3-1.7B"
