"""The project's code as Ray and MLflow receive it: real folders named `prefect_ray_lifecycle`,
each holding a part of the package, for runtime_env `py_modules` and MLflow `code_paths`.

Two parts, so that what runs inside Ray keeps its code version when only flow-side code
changes (a Serve app whose runtime_env changes is redeployed, not reconfigured in place):
- RAY_SIDE: what Serve replicas, the router, Ray Data and Tune workers and a registered policy
  import (`workloads`, and `compat` for Ray's private names);
- DRIVER_SIDE: what the task runner's task runs import on a Ray worker.
The package's `__init__` extends its `__path__` over every folder of that name on sys.path,
so a Ray worker that received both parts imports from both.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import shutil
import tempfile
from pathlib import Path

__all__ = ["DRIVER_SIDE", "PACKAGE", "RAY_SIDE", "package_part", "source_folder"]

PACKAGE = "prefect_ray_lifecycle"
RAY_SIDE = ("compat", "workloads")
DRIVER_SIDE = ("blocks", "control", "flows", "ray_runner", "tasks")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")

_staged: dict[tuple[tuple[str, ...], str], Path] = {}


def source_folder(part: str) -> Path:
    """Where this process imports the subpackage `part` from (in a Ray worker: its copy)."""
    spec = importlib.util.find_spec(f"{PACKAGE}.{part}")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{PACKAGE}.{part} is not importable here")
    return Path(list(spec.submodule_search_locations)[0])


def _fingerprint(folders: list[Path]) -> str:
    """Paths, sizes and modification times of every file: a stat walk, no reads."""
    digest = hashlib.sha1()
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            stat = path.stat()
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def package_part(parts: tuple[str, ...]) -> Path:
    """A folder `.../prefect_ray_lifecycle` holding the package's `__init__` and `parts`,
    copied from where this process imports them; made again only when a file changed."""
    sources = [source_folder(part) for part in parts]
    init = sources[0].parent / "__init__.py"
    key = (parts, _fingerprint([*sources, init]))
    staged = _staged.get(key)
    if staged is not None and staged.is_dir():
        return staged
    root = Path(tempfile.mkdtemp(prefix="prl-package-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    target = root / PACKAGE
    target.mkdir()
    shutil.copy2(init, target / "__init__.py")
    for part, source in zip(parts, sources, strict=True):
        shutil.copytree(source, target / part, ignore=IGNORED)
    _staged[key] = target
    return target
