"""The package's import graph: no cycles, one direction of imports, no imports hidden in functions.

Layers, bottom to top (a module imports only from its own layer or below):
  config                      the schema: imports nothing of the package
  algo/                       the algorithm: nothing of the package outside algo/, and of the
                              rest only torch, rapidfuzz (edit alignments) and the standard library
  core                        recipe (a recipe checked against the registries and resolved),
                              data/, embedded, modeling, generation/ (rollouts on the hf and vLLM
                              backends), logprobs, batching, distributed, repair (a step's
                              repairs, run), repair_budget (the repair spending rule as a
                              step applies it), step_parts (what a step changes and what its
                              stages hand each other), step_metrics (a step's logged metrics,
                              collected), sizes (shapes and byte counts, which the planner and
                              the vLLM engine share), quiet (third-party noise filters), catalog
                              (the packaged recipes), trl_config (TRL's GRPOConfig names), rewards/,
                              sandbox/, tools/ (tools rollouts call)
  step                        the RL step
  satellites                  plan/, evaluation/, hub/, run/
  top                         trainer (the run around the step), api (ibpo.train), cli

Satellites do not import each other except where an arrow says so below (the Hub card shows
evaluation rows and checkpoint facts). The graph is read from the source with `ast`, so a
module-level import and one inside a function count alike; an import is allowed inside a
function only for heavy optional dependencies, never for a module of this package, with one
exception (LAZY): the package's `__getattr__` imports the API on first use of `ibpo.train`, so
that `import ibpo` (which every `import ibpo.<module>` runs first) stays light. Outside the
package: nothing in it imports bench/ or scripts/, and each scripts/eval_<benchmark>.py is one
benchmark's docstring and a call of ibpo/evaluation/cli.py.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ibpo"

LAYERS = {
    "config": 0,
    "algo": 1,
    "recipe": 2, "data": 2, "embedded": 2, "modeling": 2, "generation": 2, "logprobs": 2,
    "batching": 2, "distributed": 2, "repair": 2, "rewards": 2, "sandbox": 2, "sizes": 2,
    "quiet": 2, "catalog": 2, "trl_config": 2, "tools": 2,
    "repair_budget": 2, "step_parts": 2, "step_metrics": 2,
    "step": 3,
    "plan": 4, "evaluation": 4, "hub": 4, "run": 4,
    "trainer": 5, "api": 5, "cli": 5,
}  # fmt: skip
# (module, what it may import inside a function): the package's lazy face only
LAZY = {("ibpo", "ibpo.api")}
# What the algorithm may import besides the standard library and its own folder.
ALGO_IMPORTS = {"torch", "rapidfuzz"}
# satellite -> the satellites it may import
SATELLITE_ARROWS = {"hub": {"evaluation", "run"}, "run": set(), "plan": set(), "evaluation": set()}


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(imported ibpo module, inside a function?) for every import in the file."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # type-only imports do not run
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names if a.name.startswith("ibpo")]
                found.extend((name, in_function) for name in names)
            elif isinstance(child, ast.ImportFrom) and (child.module or "").startswith("ibpo"):
                for a in child.names:  # `from ibpo.pkg import module` imports that module
                    sub = f"{child.module}.{a.name}"
                    found.append((sub if sub in known else child.module, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def graph() -> tuple[dict[str, set[str]], list[str]]:
    mods = modules()
    known = set(mods)
    edges, local = {m: set() for m in mods}, []
    for name, path in mods.items():
        for target, in_function in imports(path, known):
            if target != name and target in known:
                edges[name].add(target)
            if in_function and (name, target) not in LAZY:
                local.append(f"{name} imports {target} inside a function")
    return edges, local


def top(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def test_every_module_has_a_layer():
    missing = {top(m) for m in modules()} - set(LAYERS) - {"__init__"}
    assert not missing, f"give these a layer in this test: {sorted(missing)}"


def test_no_import_cycles():
    edges, _ = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(m: str):
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                walk(n)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            walk(m)


def test_imports_go_down_the_layers():
    edges, _ = graph()
    wrong = []
    for m, targets in edges.items():
        for t in targets:
            a, b = top(m), top(t)
            if a == b or "__init__" in (a, b):
                continue
            if LAYERS[b] > LAYERS[a]:
                wrong.append(f"{m} ({a}, layer {LAYERS[a]}) imports {t} (layer {LAYERS[b]})")
            elif LAYERS[a] == LAYERS[b] == 4 and b not in SATELLITE_ARROWS[a]:
                wrong.append(f"{m} imports the satellite {t}")
    assert not wrong, "\n".join(sorted(wrong))


def test_config_imports_nothing_of_the_package():
    edges, _ = graph()
    assert edges["ibpo.config"] == set()


def _outside(path: Path) -> set[str]:
    """The top-level packages a file imports that are neither ibpo nor the standard library."""
    tops = {n.split(".")[0] for n in _imported_names(path)}
    return tops - {"ibpo", "__future__"} - set(sys.stdlib_module_names)


def test_the_algorithm_imports_only_torch_and_its_own_folder():
    edges, _ = graph()
    algo = sorted(m for m in edges if top(m) == "algo")
    assert {"ibpo.algo.objectives", "ibpo.algo.advantages"} <= set(algo)
    for m in algo:
        assert all(t == "ibpo.algo" or t.startswith("ibpo.algo.") for t in edges[m]), (m, edges[m])
        assert _outside(modules()[m]) <= ALGO_IMPORTS, (m, _outside(modules()[m]))


def test_the_third_party_reader_sees_an_import_of_another_library():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.py"
        path.write_text("import os\nimport torch.nn\nfrom transformers import AutoModel\n")
        assert _outside(path) == {"torch", "transformers"}


def test_no_package_import_inside_a_function():
    _, local = graph()
    assert not local, "\n".join(local)


def test_the_graph_reader_sees_what_it_must():
    """The reader itself: a nested import, a submodule through `from pkg import mod`, and a
    TYPE_CHECKING import (ignored) in a made-up module."""
    import tempfile

    src = (
        "from typing import TYPE_CHECKING\nfrom ibpo.run import checkpoint\n"
        "if TYPE_CHECKING:\n    from ibpo.step import StepParts\n"
        "def f():\n    from ibpo.plan.fit import estimate\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.py"
        path.write_text(src)
        found = imports(path, {"ibpo.run.checkpoint", "ibpo.plan.fit", "ibpo.step"})
    assert found == [("ibpo.run.checkpoint", False), ("ibpo.plan.fit", True)]


def test_import_ibpo_stays_light():
    """`import ibpo` loads no torch (the sandbox's child and the config tools import
    ibpo.<module>, which runs the package's __init__ first); `ibpo.train` is there on use."""
    import subprocess
    import sys

    code = (
        "import sys, ibpo; assert 'torch' not in sys.modules, 'torch loaded'; "
        "assert 'ibpo.api' not in sys.modules; f = ibpo.train; "
        "assert 'ibpo.api' in sys.modules and callable(f); print('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent
    )
    assert out.stdout.strip() == "ok", out.stderr


def _imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_package_never_imports_the_measurement_or_script_folders():
    for path in sorted(PACKAGE.rglob("*.py")):
        outside = {n for n in _imported_names(path) if n.split(".")[0] in ("bench", "scripts")}
        assert not outside, f"{path.relative_to(PACKAGE.parent)} imports {sorted(outside)}"


def test_each_eval_script_is_one_benchmark_and_a_call_of_the_evaluation_cli():
    from ibpo.evaluation.benchmarks import BENCHMARKS

    scripts = PACKAGE.parent / "scripts"
    shims = {p.stem.removeprefix("eval_"): p for p in scripts.glob("eval_*.py")}
    assert set(shims) == set(BENCHMARKS)
    for name, path in shims.items():
        tree = ast.parse(path.read_text())
        assert _imported_names(path) == {"sys", "ibpo.evaluation.cli"}, path.name
        assert f'benchmark="{name}"' in path.read_text(), path.name
        code = [n for n in tree.body if not isinstance(n, ast.Expr)]  # all but the docstring
        assert len(code) <= 4, f"{path.name}: a shim holds imports, run() and its __main__ only"
