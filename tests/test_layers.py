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
module-level import, one inside a function and one under `if TYPE_CHECKING:` count alike, and
`from P import name` is an import of P's __init__ (`import ibpo`, `from ibpo import x`: of the
package root's). An import is allowed inside a function only for heavy optional dependencies,
never for a module of this package, with one exception (LAZY): the package's `__getattr__`
imports the API on first use of `ibpo.train`, so that `import ibpo` (which every `import
ibpo.<module>` runs first) stays light. Outside the package: nothing in it imports bench/ or
scripts/, and each scripts/eval_<benchmark>.py is one benchmark's docstring and a call of
ibpo/evaluation/cli.py.
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
    """(imported ibpo module, inside a function?) for every import in the file, wherever it
    is: at module level, inside a function, under `if TYPE_CHECKING:` (a type-only import is
    still a dependency, and a type-only circle is still a circle). `from P import x` imports P
    (its __init__ runs, and its attributes and `__getattr__` are read for x) and, where x is a
    module, P.x too; `import P.x` imports P.x (its parents are already there)."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names if a.name.split(".")[0] == "ibpo"]
                found.extend((name, in_function) for name in names)
            elif isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] == "ibpo":
                found.append((child.module, in_function))
                for a in child.names:  # `from ibpo.pkg import module` imports that module too
                    if f"{child.module}.{a.name}" in known:
                        found.append((f"{child.module}.{a.name}", in_function))
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
    """The reader itself, on a made-up module: a nested import, a submodule through `from pkg
    import mod` (an import of pkg too), a TYPE_CHECKING import, and the package root through
    `import ibpo` and `from ibpo import name`."""
    import tempfile

    src = (
        "from typing import TYPE_CHECKING\nimport ibpo\nfrom ibpo.run import checkpoint\n"
        "if TYPE_CHECKING:\n    from ibpo.step import StepParts\n"
        "def f():\n    from ibpo.plan.fit import estimate\n    from ibpo import __version__\n"
    )
    known = {"ibpo", "ibpo.run", "ibpo.run.checkpoint", "ibpo.plan.fit", "ibpo.step"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.py"
        path.write_text(src)
        found = imports(path, known)
    assert found == [
        ("ibpo", False),
        ("ibpo.run", False),
        ("ibpo.run.checkpoint", False),
        ("ibpo.step", False),
        ("ibpo.plan.fit", True),
        ("ibpo", True),
    ]


def test_the_cycle_check_sees_a_circle_through_the_package_root(monkeypatch):
    """A made-up graph with the circle the package once had (the root's lazy `train` imports
    the API, and a module the API imports reads `from ibpo import config`) fails the check."""
    edges = {"ibpo": {"ibpo.api"}, "ibpo.api": {"ibpo.recipe"}, "ibpo.recipe": {"ibpo"}}
    monkeypatch.setattr(sys.modules[__name__], "graph", lambda: (edges, []))
    try:
        test_no_import_cycles()
    except AssertionError as e:
        assert "ibpo -> ibpo.api -> ibpo.recipe -> ibpo" in str(e)
    else:
        raise AssertionError("the cycle check passed a graph with a cycle")


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
