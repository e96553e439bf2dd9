"""Finding a source's files (a path, glob or pyarrow filesystem URI) and fingerprinting them."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import posixpath
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

EXTENSIONS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".jsonl": "json",
    ".ndjson": "json",
    ".json": "json",
}
HASH_CHUNK_BYTES = 4 << 20


class SourceError(ValueError):
    """The source or the schema is unusable; raised before any Ray work."""


@dataclass(frozen=True)
class SourceFiles:
    """The files a source names, on one pyarrow filesystem, all of one format."""

    source: str
    filesystem: pafs.FileSystem
    path: str  # the source's path on `filesystem`, glob included
    paths: tuple[str, ...]
    format: str

    @property
    def uri(self) -> str:
        """The source as a URI, for lineage (`file:///...` for local files)."""
        return to_uri(self.filesystem, self.path)


def _has_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def to_uri(filesystem: pafs.FileSystem, path: str) -> str:
    if isinstance(filesystem, pafs.LocalFileSystem):
        return "file://" + os.path.abspath(path)
    return f"{filesystem.type_name}://{path.lstrip('/')}"


def filesystem_and_path(location: str) -> tuple[pafs.FileSystem, str]:
    """A local path or any pyarrow filesystem URI, as (filesystem, path)."""
    if "://" in location:
        glob_at = min((location.find(c) for c in "*?[" if c in location), default=-1)
        if glob_at >= 0:  # from_uri rejects some glob characters; resolve the prefix only
            head = location[:glob_at]
            base, _, partial = head.rpartition("/")
            filesystem, path = pafs.FileSystem.from_uri(base + "/")
            return filesystem, posixpath.join(path, partial + location[glob_at:])
        return pafs.FileSystem.from_uri(location)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(location))


def data_files(filesystem: pafs.FileSystem, base: str) -> list[pafs.FileInfo]:
    """Files under `base`, leaving out any below a `_` or `.` name (markers, hidden files)."""
    selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
    return [
        info
        for info in filesystem.get_file_info(selector)
        if info.type == pafs.FileType.File
        and not any(
            part.startswith(("_", ".")) for part in posixpath.relpath(info.path, base).split("/")
        )
    ]


def _glob_match(parts: list[str], pattern: list[str]) -> bool:
    """Shell-glob match by path segment: `*` stays inside a segment, `**` spans any number."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_match(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return (
        bool(parts)
        and fnmatch.fnmatchcase(parts[0], pattern[0])
        and _glob_match(parts[1:], pattern[1:])
    )


def resolve_source(source: str) -> SourceFiles:
    """The files behind a path, glob or URI; raises SourceError when there are none."""
    filesystem, path = filesystem_and_path(source)
    if _has_glob(path):
        base = path[: min(path.find(c) for c in "*?[" if c in path)].rpartition("/")[0] or "/"
        pattern = path.strip("/").split("/")
        infos = [
            i
            for i in data_files(filesystem, base)
            if _glob_match(i.path.strip("/").split("/"), pattern)
        ]
    else:
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise SourceError(f"source {source!r} does not exist")
        infos = [info] if info.type == pafs.FileType.File else data_files(filesystem, path)
        if info.type == pafs.FileType.Directory:
            infos = [i for i in infos if posixpath.splitext(i.path)[1].lower() in EXTENSIONS]
    if not infos:
        raise SourceError(f"source {source!r} matched no files")
    formats = {EXTENSIONS.get(posixpath.splitext(i.path)[1].lower()) for i in infos}
    if None in formats or len(formats) != 1:
        kinds = sorted({posixpath.splitext(i.path)[1] or "(none)" for i in infos})
        raise SourceError(
            f"source {source!r} must hold files of one format (.parquet, .csv or "
            f".jsonl); found extensions {kinds}"
        )
    return SourceFiles(
        source=source,
        filesystem=filesystem,
        path=path,
        paths=tuple(sorted(i.path for i in infos)),
        format=formats.pop(),
    )


def _file_digest(filesystem: pafs.FileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with filesystem.open_input_stream(path) as stream:
        while chunk := stream.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def content_fingerprint(
    files: SourceFiles, transform_source: str, parameters: dict[str, Any]
) -> str:
    """sha256 over the files' bytes (in path order), the transform's source and the parameters
    that shape the output: same inputs, same fingerprint, wherever the files live."""
    with ThreadPoolExecutor(4) as pool:  # hashlib releases the GIL on large buffers
        digests = list(pool.map(lambda p: _file_digest(files.filesystem, p), files.paths))
    outer = hashlib.sha256()
    for value in (
        files.format,
        *digests,
        transform_source,
        json.dumps(parameters, sort_keys=True, default=str),
    ):
        outer.update(value.encode())
        outer.update(b"\0")
    return outer.hexdigest()
