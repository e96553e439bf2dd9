"""Shared by the flow tests: which of a flow's parameters, and of the settings models they
use, the Prefect UI would render without a description."""

from __future__ import annotations

__all__ = ["undescribed"]


def undescribed(flow) -> list[str]:
    """'name' for each top-level parameter and 'Model.field' for each field of a model in
    the flow's parameter schema that has no description."""
    schema = flow.parameters.model_dump()
    missing = [name for name, prop in schema["properties"].items() if not prop.get("description")]
    missing += [
        f"{model}.{name}"
        for model, definition in schema["definitions"].items()
        for name, prop in definition.get("properties", {}).items()
        if not prop.get("description")
    ]
    return missing
