"""How the repository's modules import one another: one way, with no circle (an import inside a function counts, and
so would one under TYPE_CHECKING, for annotations only: none is needed), and through public names only. And the
configuration machinery stands on its own: marsgpt/config.py and the registry it names the optimizers from load no
torch, model.py or mars.py, so --help and `python -m marsgpt.config` answer without them."""

import ast
import os
import subprocess
import sys

from train_helpers import ROOT, subprocess_env

PACKAGES = ("marsgpt", "vision", "scripts", "bench", "data", "config")


def repository_modules():
    """{dotted name: path} of the top-level files and the packages' modules (tests aside)."""
    found = {name[:-3]: os.path.join(ROOT, name) for name in os.listdir(ROOT) if name.endswith(".py")}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    dotted = os.path.relpath(os.path.join(folder, name[:-3]), ROOT).replace(os.sep, ".")
                    found[dotted.removesuffix(".__init__")] = os.path.join(folder, name)
    return found


MODULES = repository_modules()


def repository_module(name):
    """The repository module `name` names, itself or the longest dotted prefix of it that is one; else None."""
    parts = name.split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in MODULES), None)


def imports(path):
    """(module imported, the names taken from it) for every import statement of the file: at module level, inside a
    function, or under `if TYPE_CHECKING:` (an import kept for annotations is still a dependency)."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module, tuple(alias.name for alias in node.names)


def import_graph():
    """{module: the repository modules it imports}."""
    graph = {}
    for module, path in MODULES.items():
        targets = set()
        for imported, names in imports(path):
            targets.update(repository_module(f"{imported}.{name}") for name in names)
            targets.add(repository_module(imported))
        graph[module] = targets - {None, module}
    return graph


def circles(graph):
    """Every import circle, as the list of modules around it (depth-first: each found once from where it closes)."""
    found, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                found.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_no_module_imports_itself_through_others():
    assert circles(import_graph()) == []


def test_no_module_hides_an_import_behind_type_checking():
    """An import under `if TYPE_CHECKING:` is a module that needs its neighbour and holds two ideas (STYLE.md)."""
    hiding = [name for name, path in MODULES.items() if "TYPE_CHECKING" in open(path).read()]
    assert hiding == []


def test_the_circle_finder_finds_a_circle_through_an_import_inside_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c", "a"]]


def test_no_module_imports_a_private_name_of_another():
    """`from marsgpt.x import _name` and `x._name` on a repository module x: what one module keeps to itself no
    other reaches into (tests and benches aside: they may look inside, as bench/bench_mars.py stubs the kernel's
    launches to time what the host does around them)."""
    reached = []
    for module, path in MODULES.items():
        if module.startswith("bench."):
            continue
        imported_modules = {}  # local name -> repository module
        for imported, names in imports(path):
            for name in names:
                if name.startswith("_") and repository_module(imported) not in (None, module):
                    reached.append(f"{module}: from {imported} import {name}")
                if repository_module(f"{imported}.{name}") == f"{imported}.{name}":
                    imported_modules[name] = f"{imported}.{name}"
            if not names and repository_module(imported) == imported:
                imported_modules[imported.split(".")[0]] = imported.split(".")[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                owner = imported_modules.get(node.value.id)
                if owner and owner != module and node.attr.startswith("_") and not node.attr.startswith("__"):
                    reached.append(f"{module}: {node.value.id}.{node.attr}")
    assert reached == []


def test_the_configuration_loads_no_torch_model_or_mars():
    """Reading, checking and printing a configuration (the quickstart's file and an override, --help) imports
    none of torch, model.py and mars.py: the optimizer registry imports them where it builds an optimizer."""
    code = (
        "import sys\n"
        "from marsgpt.config import load_config, print_help\n"
        "load_config(['config/quickstart.py', '--optimizer_name=muon'])\n"
        "print_help(file=open('/dev/null', 'w'))\n"
        "print(sorted(m for m in ('torch', 'model', 'mars') if m in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
