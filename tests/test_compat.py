"""Private Ray and Prefect names live in prefect_ray_lifecycle/compat only, and each one still
exists in the installed versions.

The walk reads the code's AST: imports of a private module or name of ray, prefect or
prefect_ray; attribute chains rooted at such an import; private attributes the project itself
never defines (they can only be upstream's, e.g. a Serve client's `_controller`); and, in a
class built on an upstream class, `self._x` where `_x` is that upstream class's own."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefect_ray_lifecycle.compat import Symbol, prefect_internals, ray_internals, vllm_internals

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "prefect_ray_lifecycle"
COMPAT = PACKAGE / "compat"
WALKED = [PACKAGE, ROOT / "deployments", ROOT / "benchmarks"]
UPSTREAM = ("ray", "prefect", "prefect_ray", "vllm")


def ast_retried(call):
    """call(), tried again on CPython 3.11.7's SystemError "AST constructor recursion depth
    mismatch": the converter's depth counter is shared by threads (gh-106905, fixed in later
    releases), and a thread an earlier module left in this worker building ASTs at the same
    moment failed the whole check once in a full run. inspect.getsource parses too."""
    for attempt in range(8):
        try:
            return call()
        except SystemError as error:
            if "recursion depth mismatch" not in str(error):
                raise
            failure = error
            time.sleep(0.1 * (attempt + 1))
    raise failure


def parse(source: str) -> ast.Module:
    return ast_retried(lambda: ast.parse(source))


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def upstream(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in UPSTREAM


def sources() -> list[Path]:
    return [
        path
        for folder in WALKED
        for path in sorted(folder.rglob("*.py"))
        if COMPAT not in path.parents and "__pycache__" not in path.parts
    ]


def own_private_names() -> set[str]:
    """Every private name the project's own code defines (functions, classes, attributes
    assigned on self or an object, module globals, parameters)."""
    names: set[str] = set()
    for path in [*sources(), *COMPAT.rglob("*.py")]:
        for node in ast.walk(parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr":
                if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                    names.add(str(node.args[1].value))
    return {name for name in names if private(name)}


def upstream_bindings(tree: ast.AST) -> dict[str, str]:
    """Local names bound to an upstream module or object: imports, lazy_import("ray"),
    sys.modules.get("prefect...")."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if upstream(alias.name):
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and upstream(node.module):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            name = ast.unparse(call.func)
            argument = call.args[0] if call.args else None
            if (
                name in ("lazy_import", "sys.modules.get", "importlib.import_module")
                and isinstance(argument, ast.Constant)
                and upstream(str(argument.value))
            ):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        bound[target.id] = str(argument.value)
    return bound


def chain_root(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def findings(path: Path, own: set[str], root: Path = ROOT) -> list[str]:
    tree = parse(path.read_text())
    bound = upstream_bindings(tree)
    where = path.relative_to(root)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if upstream(alias.name) and any(map(private, alias.name.split("."))):
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and upstream(node.module):
            for alias in node.names:
                if any(map(private, node.module.split("."))) or private(alias.name):
                    found.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute) and private(node.attr):
            root = chain_root(node.value)
            if isinstance(root, ast.Name) and root.id in ("self", "cls"):
                continue
            rooted = isinstance(root, ast.Name) and root.id in bound
            if rooted or node.attr not in own:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda hit: int(hit.split(":")[1]))


def inherited_findings(path: Path) -> list[str]:
    """`self._x` in a class of ours whose upstream bases define `_x` themselves."""
    relative = path.relative_to(ROOT).with_suffix("")
    if relative.parts[0] != PACKAGE.name or path.name == "__init__.py":
        return []
    module = importlib.import_module(".".join(relative.parts))
    found = []
    for node in ast.walk(parse(path.read_text())):
        if not isinstance(node, ast.ClassDef) or not hasattr(module, node.name):
            continue
        cls = getattr(module, node.name)
        cls = getattr(cls, "func_or_class", cls)  # a Serve deployment's own class
        if not inspect.isclass(cls):
            continue
        upstream_names: set[str] = set()
        for base in inspect.getmro(cls)[1:]:
            if base.__module__.split(".")[0] not in UPSTREAM:
                continue
            upstream_names |= set(vars(base))
            try:
                tree = parse(ast_retried(functools.partial(inspect.getsource, base)).strip() + "\n")
            except (OSError, TypeError, SyntaxError, IndentationError):
                continue
            upstream_names |= {
                a.attr
                for a in ast.walk(tree)
                if isinstance(a, ast.Attribute) and ast.unparse(a.value) == "self"
            }
        for inner in ast.walk(node):
            if (
                isinstance(inner, ast.Attribute)
                and isinstance(inner.value, ast.Name)
                and inner.value.id == "self"
                and private(inner.attr)
                and inner.attr in upstream_names
            ):
                found.append(f"{path.relative_to(ROOT)}:{inner.lineno}: self.{inner.attr}")
    return found


def test_private_ray_and_prefect_names_appear_only_in_the_compat_modules():
    own = own_private_names()
    found = [hit for path in sources() for hit in findings(path, own)]
    found += [hit for path in sources() for hit in inherited_findings(path)]
    assert not found, "private upstream names outside compat/:\n" + "\n".join(found)


def test_the_walk_finds_what_it_is_meant_to_find(tmp_path):
    """The checks above can fail: each kind of private use is caught in a sample."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import ray\n"
        "from ray._private import worker\n"
        "from ray.serve.context import _connect\n"
        "from prefect.utilities.importtools import lazy_import\n"
        "lazy = lazy_import('ray')\n"
        "ray._private.worker.global_worker\n"
        "lazy._private\n"
        "client = _connect()\n"
        "client._controller\n"
        "client._mine\n"
    )
    hits = findings(sample, own={"_mine"}, root=tmp_path)
    assert [hit.split(":")[1] for hit in hits] == ["2", "3", "6", "7", "9"], hits


# Resolves each (module, path, instance) given as JSON in argv[1]; prints {"module:path":
# None, or the error}. An instance attribute must be set as `self.<name>` somewhere in its
# class or a base class.
RESOLVE = """
import importlib, inspect, json, sys
found = {}
for module, path, instance in json.loads(sys.argv[1]):
    try:
        obj = importlib.import_module(module)
        parts = path.split(".")
        last = parts.pop() if instance else None
        for part in parts:
            obj = getattr(obj, part)
        if last is not None:
            source = "".join(inspect.getsource(c) for c in inspect.getmro(obj) if c is not object)
            if f"self.{last}" not in source:
                raise AttributeError(f"{obj.__name__} sets no self.{last}")
        found[f"{module}:{path}"] = None
    except Exception as error:
        found[f"{module}:{path}"] = repr(error)
print(json.dumps(found))
"""


def resolve_in(python: str, symbols: list[Symbol]) -> dict[str, str | None]:
    """Each symbol resolved by a fresh interpreter `python`: None, or why it is gone."""
    done = subprocess.run(
        [python, "-c", RESOLVE, json.dumps([list(s) for s in symbols])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def resolved() -> dict[str, str | None]:
    """Resolved in a fresh interpreter, not in this worker: inspect.getsource parses with
    ast, whose recursion depth counter CPython 3.11.7 shares between threads (gh-106905), and
    threads that earlier modules left in a pytest worker made it fail at random ("AST
    constructor recursion depth mismatch", twice in full runs, the second time inside
    inspect, past parse()'s retry)."""
    return resolve_in(sys.executable, [*ray_internals.SYMBOLS, *prefect_internals.SYMBOLS])


@pytest.mark.parametrize(
    "symbol",
    [*ray_internals.SYMBOLS, *prefect_internals.SYMBOLS],
    ids=lambda s: f"{s.module}:{s.path}",
)
def test_every_private_name_the_compat_modules_rely_on_still_exists(symbol, resolved):
    error = resolved[f"{symbol.module}:{symbol.path}"]
    if error is not None:
        pytest.fail(
            f"{symbol.module}:{symbol.path} is gone in the installed version ({error}): "
            f"update prefect_ray_lifecycle/compat for it"
        )


def test_the_compat_modules_name_every_private_name_they_use():
    """Each private upstream name a compat module uses is listed in its SYMBOLS, so the
    test above checks it."""
    for module, symbols in (
        (ray_internals, ray_internals.SYMBOLS),
        (vllm_internals, vllm_internals.SYMBOLS),
    ):
        listed = {part for s in symbols for part in (*s.module.split("."), *s.path.split("."))}
        tree = parse(Path(module.__file__).read_text())
        used = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and private(node.attr)
        }
        used -= {"_prl_wraps_submit"}
        assert used <= listed, sorted(used - listed)


def test_a_placement_groups_id_ends_with_its_jobs_id():
    """What ray_internals.job_placement_groups relies on to tell the connected job's groups
    from other jobs' (Ray's placement group table names no creator)."""
    import ray

    for job in (ray.JobID.from_int(1), ray.JobID.from_int(0x0A0B0C)):
        group = ray.PlacementGroupID.of(job)
        assert group.hex().endswith(job.hex()) and group.hex() != job.hex()


@pytest.mark.llm
def test_every_private_vllm_name_still_exists_in_the_llm_venv():
    """vLLM is only in the LLM venv: its private names are resolved there."""
    from prefect_ray_lifecycle.workloads.constants import llm_python

    found = resolve_in(llm_python(), vllm_internals.SYMBOLS)
    missing = {name: error for name, error in found.items() if error is not None}
    assert missing == {}, "update compat/vllm_internals.py"
