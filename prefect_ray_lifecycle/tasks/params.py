"""Flow parameter types for what people type: in the Prefect UI's run form a text field sends a
string, but `prefect deployment run ... --param version=2` reads its value as JSON and sends
the number 2. Model versions are numbers to people, so these accept either and keep MLflow's
spelling (text); the schema the UI renders stays a plain text field."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator

__all__ = ["ModelVersion", "Text", "model_version"]


def _number_as_text(value: Any) -> Any:
    """A whole number typed where text is expected, as its text (2 -> "2"); anything else is
    left for the field's own check."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


def model_version(value: Any) -> str:
    """A registered model's version as MLflow spells it: 3 or "3" -> "3"."""
    text = _number_as_text(value)
    if not isinstance(text, str) or not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"a model version is a whole number from 1 (like 3), not {value!r}")
    return str(int(text))


Text = Annotated[str, BeforeValidator(_number_as_text)]
ModelVersion = Annotated[str, BeforeValidator(model_version)]
