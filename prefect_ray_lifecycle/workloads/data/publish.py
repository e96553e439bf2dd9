"""Staging and atomic publish: a run writes into a hidden sibling of its output, then the
manifest, then one rename puts the whole dataset in place."""

from __future__ import annotations

import json
import posixpath
import uuid
from typing import Any

import pyarrow.fs as pafs

MANIFEST = "_manifest.json"


def staging_path(output: str) -> str:
    """A hidden sibling of `output`: same folder, so the final move is a rename."""
    parent, name = posixpath.split(output.rstrip("/"))
    return posixpath.join(parent, f".{name}.staging-{uuid.uuid4().hex[:12]}")


def read_manifest(filesystem: pafs.FileSystem, output: str) -> dict[str, Any] | None:
    """The manifest of a published dataset, or None when there is none."""
    path = posixpath.join(output, MANIFEST)
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        return None
    with filesystem.open_input_stream(path) as stream:
        return json.loads(stream.read())


def publish(
    filesystem: pafs.FileSystem, staging: str, output: str, manifest: dict[str, Any]
) -> None:
    """Write the manifest last, then move the staged folder into place. Readers see the old
    dataset or the new one, never a mix (one rename on a local or POSIX filesystem)."""
    with filesystem.open_output_stream(posixpath.join(staging, MANIFEST)) as out:
        out.write(json.dumps(manifest, indent=2, sort_keys=True).encode())
    filesystem.create_dir(posixpath.dirname(output.rstrip("/")), recursive=True)
    if filesystem.get_file_info(output).type == pafs.FileType.NotFound:
        filesystem.move(staging, output)
        return
    replaced = staging.replace(".staging-", ".replaced-")
    filesystem.move(output, replaced)
    filesystem.move(staging, output)
    filesystem.delete_dir(replaced)


def discard(filesystem: pafs.FileSystem, staging: str) -> None:
    """Remove a staging folder that will not be published (no-op when it is gone)."""
    if filesystem.get_file_info(staging).type == pafs.FileType.Directory:
        filesystem.delete_dir(staging)
