"""The recipes that ship with the package: find them, resolve a packaged name, list and copy them.

A recipe is named by its path under recipes/ without `.yaml`: `qwen3_1.7b/gsm8k_ibpo_1gpu`, and
the Accelerate configs `accelerate/single_gpu`. In a clone they are the files under recipes/; in an
installed wheel the same files are `ibpo/recipes/` (pyproject.toml maps recipes/ to the package
`ibpo.recipes`, so there is one copy of each). `ibpo train NAME` runs a packaged recipe when NAME is
not a file; `ibpo recipes` lists them and `ibpo recipes copy NAME [DEST]` copies one to edit.

Not here: what a recipe means (config.py) or checking that a recipe fits its hardware (plan/).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

from ibpo.config import ConfigError

_PACKAGE = Path(__file__).resolve().parent


def recipes_root() -> Path:
    """ibpo/recipes/ in an installed wheel, else the recipes/ of the checkout this package is in."""
    for root in (_PACKAGE / "recipes", _PACKAGE.parent / "recipes"):
        if any(root.glob("*/*.yaml")):
            return root
    raise ConfigError(
        f"no packaged recipes next to {_PACKAGE}. Fix: reinstall ibpo (`pip install ibpo`), or "
        "give a recipe file's path"
    )


def packaged() -> dict[str, Path]:
    """Every packaged recipe and Accelerate config: name -> file, sorted by name."""
    root = recipes_root()
    files = sorted(root.glob("*/*.yaml"))
    return {p.relative_to(root).with_suffix("").as_posix(): p for p in files}


def header(path: Path) -> dict[str, str]:
    """'Key' -> the text after '# Key:' on the first line of each key in the leading comments."""
    keys: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        key, sep, rest = line[1:].partition(":")
        if sep and " " not in key.strip() and key.strip() not in keys:
            keys[key.strip()] = rest.strip()
    return keys


def find(name: str) -> Path:
    """The packaged recipe NAME (`model/recipe`, `.yaml` optional); ConfigError naming the list."""
    recipes = packaged()
    key = name[: -len(".yaml")] if name.endswith(".yaml") else name
    key = key.removeprefix("recipes/")
    if key in recipes:
        return recipes[key]
    raise ConfigError(
        f"recipe '{name}' not found: neither a file nor a packaged recipe. Fix: a recipe file's "
        "path, or a name that `ibpo recipes` lists"
    )


def resolve_recipe(recipe: str | None) -> str | None:
    """A file path stays as it is; otherwise a packaged name becomes its file's path."""
    if recipe is None or Path(recipe).is_file():
        return recipe
    return str(find(recipe))


def list_text() -> str:
    """The listing `ibpo recipes` prints: name and hardware, then the Accelerate configs."""
    recipes = packaged()
    models = {k: p for k, p in recipes.items() if not k.startswith("accelerate/")}
    width = max(map(len, recipes))
    lines = ["Recipes (ibpo train NAME [k=v ...]; ibpo recipes copy NAME [DEST] to edit one):"]
    lines += [f"  {k:<{width}}  {header(p).get('Hardware', '')}" for k, p in models.items()]
    lines.append("Accelerate configs (accelerate launch --config_file FILE ...):")
    for k, p in recipes.items():
        if k.startswith("accelerate/"):
            first = next((ln[1:].strip() for ln in p.read_text().splitlines()), "")
            lines.append(f"  {k:<{width}}  {re.split(r'[:;.]( |$)', first)[0]}")
    lines.append(f"({recipes_root()})")
    return "\n".join(lines)


def copy(name: str, dest: str | None = None, force: bool = False) -> Path:
    """Copy a packaged recipe to DEST (a file, or a folder to put it in; default: here, under its
    own file name); an existing file is replaced only with force."""
    src = find(name)
    target = Path(dest) if dest else Path(src.name)
    if target.is_dir() or (dest or "").endswith(("/", "\\")):
        target = target / src.name
    if target.exists() and not force:
        raise ConfigError(f"'{target}' exists; nothing was copied. Fix: --force, or another DEST")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, target)
    return target


def main(argv: list[str] | None = None) -> int:
    """`ibpo recipes [list]` | `ibpo recipes copy NAME [DEST] [--force]`."""
    p = argparse.ArgumentParser(
        prog="ibpo recipes", description="List the packaged recipes, or copy one to edit."
    )
    sub = p.add_subparsers(dest="action")
    sub.add_parser("list", help="name and hardware of each packaged recipe (the default)")
    p_copy = sub.add_parser("copy", help="copy a packaged recipe: ibpo recipes copy NAME [DEST]")
    p_copy.add_argument("name", help="a name `ibpo recipes` lists, e.g. qwen3_1.7b/gsm8k_ibpo_1gpu")
    p_copy.add_argument("dest", nargs="?", help="file or folder (default: ./<recipe>.yaml)")
    p_copy.add_argument("--force", action="store_true", help="replace an existing file")
    args = p.parse_args(argv)
    try:
        if args.action == "copy":
            target = copy(args.name, args.dest, args.force)
            use = f"ibpo train {target}"
            if args.name.startswith("accelerate/"):
                use = f"accelerate launch --config_file {target} -m ibpo.cli train RECIPE"
            print(f"copied {args.name} to {target}; use it with: {use}")
        else:
            print(list_text())
    except ConfigError as e:
        print(f"ibpo recipes: error: {e}", file=sys.stderr)
        return 2
    return 0
