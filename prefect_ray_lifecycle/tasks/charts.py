"""Charts where people look: drawn with matplotlib (Agg, no pyplot state) in the task that owns
the data, logged as a PNG on an MLflow run, and shown on the Prefect flow run as an image
artifact pointing at the MLflow server's artifact URL (a browser opens it as it is).

A chart that fails to draw or to publish is logged as a warning; it never fails the flow.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from prefect.artifacts import create_image_artifact
from prefect.logging import get_run_logger

from prefect_ray_lifecycle.blocks import MLflowServer

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["artifact_key", "artifact_url", "new_figure", "publish", "publish_file", "save_png"]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DPI = 110


def new_figure(width: float = 10.0, height: float = 6.0) -> Figure:
    """A figure bound to the Agg canvas: no pyplot, no GUI, no global state, thread-safe."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def save_png(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=DPI)
    return path


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key from free text: lowercase letters, digits and dashes only."""
    text = "-".join(part for part in parts if part)
    return re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")[:200]


def artifact_url(server: MLflowServer, run_id: str, path: str) -> str:
    """The URL at which the MLflow server hands out one of a run's artifacts."""
    return f"{server.tracking_uri}/get-artifact?{urlencode({'path': path, 'run_uuid': run_id})}"


def publish(
    draw: Callable[[], Figure],
    *,
    server: MLflowServer,
    run_id: str,
    artifact_path: str,
    key: str,
    description: str,
    data: dict[str, Any] | None = None,
) -> str | None:
    """Draw the chart, log it on the MLflow run at `artifact_path` (a file path inside the
    run's artifacts, ending .png) and create the image artifact `key` on this flow run. With
    `data`, what the chart was drawn from is logged beside it as JSON (same name, .json).
    Returns the chart's URL, or None (logged) when drawing or publishing failed."""
    logger = get_run_logger()
    try:
        figure = draw()
        folder, _, name = artifact_path.rpartition("/")
        with tempfile.TemporaryDirectory() as scratch:
            files = [save_png(figure, Path(scratch) / name)]
            if data is not None:
                files.append(Path(scratch) / f"{Path(name).stem}.json")
                files[-1].write_text(json.dumps(data, indent=1, default=str))
            with server.session() as client:
                for local in files:
                    client.log_artifact(run_id, str(local), folder or None)
        url = artifact_url(server, run_id, artifact_path)
        create_image_artifact(image_url=url, key=key, description=description)
    except Exception as error:  # a chart reports the run; it must never fail it
        logger.warning("could not publish the chart %s: %r", key, error)
        return None
    logger.info("chart %s: %s", key, url)
    return url


class _PngFile:
    """A PNG already on disk, standing in for a figure: `save_png` copies its bytes as they
    are (a redraw would not be the same image)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.data = self.path.read_bytes()
        if not self.data.startswith(PNG_MAGIC):
            raise ValueError(f"{self.path} is not a PNG file")

    def savefig(self, path: str | Path, **_: object) -> None:
        Path(path).write_bytes(self.data)


def publish_file(
    path: str | Path,
    *,
    server: MLflowServer,
    run_id: str,
    artifact_path: str,
    key: str,
    description: str,
) -> str | None:
    """`publish` for a chart drawn earlier (a PNG file on this machine, e.g. by another flow
    run): logged on the MLflow run byte for byte and shown as the image artifact `key`.
    Returns its URL, or None (logged) when the file is missing, not a PNG, or not published."""
    return publish(
        lambda: _PngFile(path),  # type: ignore[arg-type,return-value]
        server=server,
        run_id=run_id,
        artifact_path=artifact_path,
        key=key,
        description=description,
    )
