"""Every private Ray, Prefect or vLLM name the project relies on: one module per upstream
package (`ray_internals`, `prefect_internals`, `vllm_internals`), each use saying what it
relies on and the version it was checked against. Nowhere else may the project name them
(tests/test_compat.py walks the code's AST), and each module's SYMBOLS lists them, so that the
test names the symbol an upgrade removed."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Symbol"]


class Symbol(NamedTuple):
    """A private name in an upstream module: `path` is resolved from `module` attribute by
    attribute; an `instance` attribute (set in `__init__`, not on the class) is found as
    `self.<last part>` in the source of the class the rest of `path` names."""

    module: str
    path: str
    instance: bool = False
