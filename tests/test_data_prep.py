"""Data prep on the session's Ray head: quarantine counts, stable split, cache hits without
Ray, atomic output and replacement, lineage; and the two reference transforms."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pyarrow.parquet as pq
import pytest
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    FlowFilter,
    FlowFilterName,
)
from prefect.client.schemas.sorting import ArtifactSort, FlowRunSort
from prefect.states import StateType

from prefect_ray_lifecycle.blocks import RayCluster
from prefect_ray_lifecycle.flows.data_prep import DataPrepParams, data_prep
from prefect_ray_lifecycle.ray_runner import JOB_METADATA_FLOW_RUN_ID
from prefect_ray_lifecycle.tasks.data.prep import TooManyBadRows, judge_bad_rows, plan_dataset
from prefect_ray_lifecycle.workloads.data.source import SourceError, resolve_source
from prefect_ray_lifecycle.workloads.data.splits import split_of
from prefect_ray_lifecycle.workloads.data.transforms import (
    BOS_ID,
    EOS_ID,
    ByteTokenizer,
    prepare_numeric,
    tokenize_text,
)

GOOD_ROWS = 1500  # per CSV file; two files
NUMERIC = "prefect_ray_lifecycle.workloads.data.transforms:prepare_numeric"
PINNED_SPLIT = ["eval"] * 3 + ["train"] * 5


def good_frame(start: int, rows: int) -> pd.DataFrame:
    ids = np.arange(start, start + rows)
    return pd.DataFrame(
        {"id": ids, "age": ids % 90, "score": (ids % 7) / 7.0, "text": [f"row {i}" for i in ids]}
    )


def write_csv_source(root: Path) -> Path:
    """Two good CSV files with injected bad rows, and a third file that lacks `score`."""
    source = root / "src"
    source.mkdir()
    first = good_frame(0, GOOD_ROWS).astype(str)
    first.loc[10, "age"] = "abc"  # wrong type
    first.loc[20, "age"] = "4.5"  # wrong type (not an integer)
    first.loc[30, "score"] = "not-a-float"  # wrong type
    first.loc[40, "text"] = ""  # null in a required column
    first.loc[50, "score"] = "inf"  # parses; prepare_numeric raises on it
    first.to_csv(source / "part-0.csv", index=False)
    second = good_frame(GOOD_ROWS, GOOD_ROWS).astype(str)
    second.loc[5, "text"] = ""  # null in a required column
    text = second.to_csv(index=False)
    # A line with an extra field: a malformed CSV row.
    text += "99999,1,0.5,hello,extra\n"
    (source / "part-1.csv").write_text(text)
    good_frame(10_000, 7).drop(columns="score").to_csv(source / "part-2.csv", index=False)
    return source


def csv_params(source: Path, output: Path, **overrides) -> DataPrepParams:
    fields = dict(
        source=str(source),
        output=str(output),
        split_key="id",
        eval_fraction=0.2,
        expected_schema={"id": "int64", "age": "int64", "score": "float64", "text": "string"},
        required_columns=["id", "text"],
        transform=NUMERIC,
        transform_kwargs={"columns": ["age", "score"], "log_columns": ["age"]},
        max_bad_fraction=0.01,
    )
    return DataPrepParams(**(fields | overrides))


def exception_text(error: BaseException | None) -> str:
    """An exception with its causes: Ray and Prefect wrap what the pipeline raised."""
    parts = []
    while error is not None:
        parts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return "\n".join(parts)


def staged_leftovers(output: Path) -> list[str]:
    return sorted(
        p.name for p in output.parent.iterdir() if ".staging-" in p.name or ".replaced-" in p.name
    )


def asset_events(client, asset_key: str) -> list:
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    flt = EventFilter(
        event=EventNameFilter(name=["prefect.asset.materialization.succeeded"]),
        resource=EventResourceFilter(id=[asset_key]),
    )
    deadline = time.monotonic() + 20
    while True:  # events reach the API asynchronously
        events = client.read_events(filter=flt, limit=50).events  # server max: 50
        if events or time.monotonic() > deadline:
            return events
        time.sleep(0.5)


def test_bad_rows_go_to_the_quarantine_with_exact_counts_and_reasons(
    stack, prefect_client, task_runs, tmp_path
):
    source = write_csv_source(tmp_path)
    output = tmp_path / "out" / "dataset"
    # A dataset published there before is replaced as a whole: none of its rows or files stay.
    (output / "train").mkdir(parents=True)
    pq.write_table(pa.table({"id": [-1]}), output / "train" / "old.parquet")
    (output / "_manifest.json").write_text('{"fingerprint": "old"}')
    result = data_prep(csv_params(source, output), ray_cluster=stack.ray_cluster())

    expected = {
        "missing column 'score'": 7,
        "wrong type in 'age'": 2,
        "null in required column 'text'": 2,
        "wrong type in 'score'": 1,
        "malformed CSV row": 1,
        "transform raised ValueError": 1,
    }
    assert result.reasons == expected
    assert result.rows_in == 2 * GOOD_ROWS + 1 + 7
    assert result.rows_quarantined == sum(expected.values()) == 14
    assert result.rows_train + result.rows_eval == 2 * GOOD_ROWS - 6
    assert result.rows_filtered == 0 and not result.cache_hit

    quarantine = pq.read_table(result.quarantine_path).to_pandas()
    assert quarantine["reason"].value_counts().to_dict() == expected
    raised = quarantine[quarantine.reason == "transform raised ValueError"].iloc[0]
    assert "non-finite value inf in column 'score'" in raised.detail
    assert json.loads(raised.row)["id"] == "50"
    wrong = quarantine[quarantine.reason == "wrong type in 'age'"]
    assert sorted(wrong.detail) == ["'4.5' is not int64", "'abc' is not int64"]
    assert set(quarantine[quarantine.reason.str.startswith("missing")].source) == {
        str(source / "part-2.csv")
    }

    train = pq.read_table(result.train_path)
    assert train.num_rows == result.rows_train
    # Through a pandas batch the fixed-size list comes back as a plain list.
    assert train.schema.field("features").type.value_type == pa.float32()
    assert set(pa.compute.list_value_length(train["features"]).to_pylist()) == {4}
    assert result.output_schema["id"] == "int64"
    bad_ids = {10, 20, 30, 40, 50, GOOD_ROWS + 5}
    kept = set(train["id"].to_pylist()) | set(pq.read_table(result.eval_path)["id"].to_pylist())
    assert kept == set(range(2 * GOOD_ROWS)) - bad_ids
    manifest = json.loads((output / "_manifest.json").read_text())
    assert manifest["fingerprint"] == result.fingerprint
    assert not (output / "train" / "old.parquet").exists()
    assert staged_leftovers(output) == []

    (event,) = asset_events(prefect_client, result.asset_key)
    assert result.asset_key == f"file://{output}"
    assert event.payload["rows_quarantined"] == 14
    assert event.payload["rows_out"] == result.rows_train + result.rows_eval
    assert event.payload["fingerprint"] == result.fingerprint
    assert {r.id for r in event.related} >= {f"file://{source}"}
    # The run is tied both ways to the Ray job that did the work: a user goes from either one
    # to the other.
    (flow_run,) = prefect_client.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=["data-prep"])),
        sort=FlowRunSort.START_TIME_DESC,
        limit=1,
    )
    (job,) = [j for j in ray_jobs(stack) if j.job_id == flow_run.labels["ray.job_id"]]
    assert job.metadata[JOB_METADATA_FLOW_RUN_ID] == str(flow_run.id)

    def prepared(runs):
        return any(r.name.startswith("prepare_dataset") and r.state.is_completed() for r in runs)

    runs = task_runs(flow_run.id, prepared)
    assert {r.name.rsplit("-", 1)[0]: r.state.type for r in runs}["prepare_dataset"] == (
        StateType.COMPLETED
    )
    artifacts = prefect_client.read_artifacts(
        artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["data-prep"])),
        sort=ArtifactSort.CREATED_DESC,
    )
    assert any(result.fingerprint in str(a.data) for a in artifacts)


def test_the_split_is_stable_across_runs_and_file_layouts(stack, tmp_path):
    """The split is a function of the key alone: the flow's Ray workers (one layout, its own
    batching) agree with this process on a shuffled, re-batched copy of the keys."""
    frame = good_frame(0, 3000).sample(frac=1.0, random_state=7)
    source = tmp_path / "src"
    source.mkdir()
    for i in range(3):
        pq.write_table(
            pa.Table.from_pandas(frame.iloc[i * 1000 : (i + 1) * 1000], preserve_index=False),
            source / f"part-{i}.parquet",
            row_group_size=257,
        )
    # Source and output as pyarrow filesystem URIs.
    result = data_prep(
        DataPrepParams(
            source=f"file://{source}",
            output=f"file://{tmp_path}/out",
            split_key="id",
            eval_fraction=0.25,
        ),
        ray_cluster=stack.ray_cluster(),
    )
    assert result.output == str(tmp_path / "out")

    on_ray = set(pq.read_table(result.eval_path)["id"].to_pylist())
    train = set(pq.read_table(result.train_path)["id"].to_pylist())
    assert on_ray | train == set(range(3000)) and not on_ray & train
    assert 0.2 < len(on_ray) / 3000 < 0.3
    keys = pa.array(np.arange(3000))
    here = set()
    for start in range(0, 3000, 113):  # other batch boundaries than any run used
        chunk = keys[start : start + 113]
        here |= {
            k
            for k, s in zip(chunk.to_pylist(), split_of(chunk, 0.25).to_pylist(), strict=True)
            if s == "eval"
        }
    assert here == on_ray
    # Pinned values: a change of hash would silently reshuffle every dataset's eval split.
    assert split_of(pa.array([0, 1, 2, 3, 4, 5, 6, 7]), 0.25).to_pylist() == PINNED_SPLIT


def ray_jobs(stack) -> list:
    from ray.util.state import list_jobs

    return list_jobs(address=stack.ray_dashboard_url, limit=1000, detail=True)


def ray_job_ids(stack) -> set[str]:
    return {job.job_id for job in ray_jobs(stack)}


def test_a_rerun_with_the_same_inputs_is_a_cache_hit_without_ray(stack, prefect_client, tmp_path):
    source = tmp_path / "src.parquet"
    pq.write_table(pa.Table.from_pandas(good_frame(0, 2000)), source)
    output = tmp_path / "out"
    params = DataPrepParams(
        source=str(source),
        output=str(output),
        split_key="id",
        transform="prefect_ray_lifecycle.workloads.data.transforms:tokenize_text",
        transform_kwargs={"max_length": 16},
    )
    first = data_prep(params, ray_cluster=stack.ray_cluster())
    jobs_before = ray_job_ids(stack)
    published = (output / "_manifest.json").stat().st_mtime_ns

    # An unreachable cluster: any attempt to use Ray would fail the run.
    second = data_prep(params, ray_cluster=RayCluster(address="127.0.0.1:1"))

    assert second.cache_hit and not first.cache_hit
    assert second.model_dump(exclude={"cache_hit"}) == first.model_dump(exclude={"cache_hit"})
    assert ray_job_ids(stack) == jobs_before
    assert (output / "_manifest.json").stat().st_mtime_ns == published

    # Each input of the fingerprint changes it: source bytes, parameters, transform source.
    base = plan_dataset.fn(params).fingerprint
    assert plan_dataset.fn(params.model_copy(update={"eval_fraction": 0.3})).fingerprint != base
    assert (
        plan_dataset.fn(params.model_copy(update={"output": str(tmp_path / "x")})).fingerprint
        == base
    )
    pq.write_table(pa.Table.from_pandas(good_frame(1, 2000)), source)
    assert plan_dataset.fn(params).fingerprint != base


BROKEN_TRANSFORMS = '''
def drop_rows(batch):
    """Breaks the one-row-out-per-row-in contract on every batch."""
    return batch.iloc[:0]
'''


def test_a_job_that_fails_midway_leaves_no_partial_output(stack, tmp_path, monkeypatch):
    package = tmp_path / "mods" / "prep_broken_transforms"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(BROKEN_TRANSFORMS)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    source = write_csv_source(tmp_path)
    output = tmp_path / "out" / "dataset"
    # A dataset published earlier must survive the failed runs untouched.
    output.mkdir(parents=True)
    (output / "_manifest.json").write_text('{"fingerprint": "old"}')
    (output / "train").mkdir()
    before = sorted(str(p.relative_to(output)) for p in output.rglob("*"))

    cluster = stack.ray_cluster(runtime_env={"py_modules": [str(package)]})
    with pytest.raises(Exception) as failure:
        data_prep(
            csv_params(
                source, output, transform="prep_broken_transforms:drop_rows", transform_kwargs={}
            ),
            ray_cluster=cluster,
        )
    assert "returned 0 rows" in exception_text(failure.value)
    assert staged_leftovers(output) == []
    assert sorted(str(p.relative_to(output)) for p in output.rglob("*")) == before

    with pytest.raises(TooManyBadRows) as too_many:
        data_prep(csv_params(source, output, max_bad_fraction=0.001), ray_cluster=cluster)
    message = str(too_many.value)
    assert "14 of 3008 rows quarantined" in message
    assert "\"missing column 'score'\": 7" in message
    assert "first: [" in message
    assert staged_leftovers(output) == []
    assert (output / "_manifest.json").read_text() == '{"fingerprint": "old"}'


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "does not exist"),
        ("empty-parquet", "has no rows"),
        ("empty-csv", "has no rows"),
        ("unknown-column", "names columns ['price'] that the source does not have"),
        ("bad-key", "column 'key' is not in the schema"),
    ],
)
def test_bad_sources_fail_clearly_before_any_ray_work(prefect_api, tmp_path, case, message):
    source = tmp_path / "src"
    source.mkdir()
    schema = None
    key = "id"
    if case == "missing":
        source = tmp_path / "nowhere"
    elif case == "empty-parquet":
        pq.write_table(pa.Table.from_pandas(good_frame(0, 0)), source / "a.parquet")
    elif case == "empty-csv":
        (source / "a.csv").write_text("id,age\n")
    else:
        pq.write_table(pa.Table.from_pandas(good_frame(0, 10)), source / "a.parquet")
        schema = {"id": "int64", "price": "float64"} if case == "unknown-column" else None
        key = "key" if case == "bad-key" else "id"
    params = DataPrepParams(
        source=str(source), output=str(tmp_path / "out"), split_key=key, expected_schema=schema
    )
    with pytest.raises(SourceError, match=message.replace("[", r"\[").replace("]", r"\]")):
        data_prep(params, ray_cluster=RayCluster(address="127.0.0.1:1"))
    assert not (tmp_path / "out").exists()


def test_json_lines_with_filters_and_tokenization(stack, tmp_path):
    lines = [
        json.dumps({"id": i, "text": f"sample {i}", "lang": "en" if i % 4 else "de"})
        for i in range(400)
    ]
    lines[7] = "{not json"
    lines[8] = json.dumps({"id": "eight", "text": "x", "lang": "en"})
    lines[9] = json.dumps([1, 2])
    source = tmp_path / "src"
    source.mkdir()
    (source / "a.jsonl").write_text("\n".join(lines) + "\n")
    # A file with no good row: its batch comes back empty, and must not upset the writer.
    (source / "b.jsonl").write_text('{"id": 1000}\n[]\n{"id": 1001, "text": null}\n')
    result = data_prep(
        DataPrepParams(
            source=str(source),
            output=str(tmp_path / "out"),
            split_key="id",
            expected_schema={"id": "int64", "text": "string", "lang": "string"},
            required_columns=["text"],
            filters=[{"column": "lang", "op": "==", "value": "en"}],
            transform="prefect_ray_lifecycle.workloads.data.transforms:tokenize_text",
            transform_kwargs={"max_length": 8},
            transform_batch_format="pyarrow",
            max_bad_fraction=0.05,
        ),
        ray_cluster=stack.ray_cluster(),
    )

    assert result.reasons == {
        "unparsable line": 3,
        "null in required column 'text'": 2,
        "wrong type in 'id'": 1,
    }
    assert result.rows_in == 403
    english = {i for i in range(400) if i % 4 and i not in (7, 9)}
    assert result.rows_train + result.rows_eval == len(english)
    assert result.rows_filtered == 403 - 6 - len(english)
    rows = pd.concat([pq.read_table(p).to_pandas() for p in (result.train_path, result.eval_path)])
    assert set(rows.lang) == {"en"}
    sample = rows.set_index("id").loc[13]
    assert list(sample.input_ids) == [BOS_ID, *(b + 3 for b in b"sample"), EOS_ID]
    assert sample.num_tokens == 8


# ---------------------------------------------------------------- transforms and decisions


def test_byte_tokenizer_is_lossless_deterministic_and_truncates():
    tokenizer = ByteTokenizer(max_length=64)
    text = "Grüße, 世界!"
    ids = tokenizer.encode(text)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID and max(ids) < tokenizer.vocab_size
    assert tokenizer.decode(ids) == text
    assert ByteTokenizer(max_length=64).encode(text) == ids
    assert len(ByteTokenizer(max_length=5).encode(text)) == 5
    assert ByteTokenizer(4, add_special_tokens=False).encode("abcdef") == [100, 101, 102, 103]
    with pytest.raises(ValueError, match="must be a string"):
        tokenizer.encode_batch(["ok", None])
    frame = tokenize_text(pd.DataFrame({"text": ["ab", ""]}), max_length=8)
    assert list(map(list, frame.input_ids)) == [[1, 100, 101, 2], [1, 2]]
    assert frame.num_tokens.tolist() == [4, 2]


def test_prepare_numeric_imputes_flags_logs_scales_and_rejects_non_finite():
    table = pa.table({"a": [1.0, None, 3.0], "b": [0, 9, -9]})
    out = prepare_numeric(
        table, columns=["a", "b"], log_columns=["b"], scale={"a": [2.0, 2.0]}, impute=2.0
    )
    features = np.array(out["features"].to_pylist())
    np.testing.assert_allclose(features[:, 0], [-0.5, 0.0, 0.5])
    np.testing.assert_allclose(features[:, 1], [0.0, np.log1p(9), -np.log1p(9)], rtol=1e-6)
    np.testing.assert_array_equal(features[:, 2:], [[0, 0], [1, 0], [0, 0]])
    with pytest.raises(ValueError, match="non-finite value inf in column 'a'"):
        prepare_numeric(pa.table({"a": [1.0, float("inf")]}), columns=["a"])
    with pytest.raises(KeyError, match="missing"):
        prepare_numeric(pa.table({"a": [1.0]}), columns=["missing"])


def test_the_bad_row_verdict_names_counts_and_reasons():
    passed = judge_bad_rows(1000, 10, 0.01, {"x": 10}, ["x: 1"])
    assert passed.passed and "10 of 1000 rows quarantined (1.00%, limit 1.00%)" == passed.reason
    failed = judge_bad_rows(1000, 11, 0.01, {"x": 11}, ["x: 1"])
    assert not failed.passed and "{'x': 11}" in failed.reason and "['x: 1']" in failed.reason


def test_sources_resolve_from_paths_globs_and_uris(tmp_path):
    (tmp_path / "d" / "nested").mkdir(parents=True)
    for name in ("d/a.parquet", "d/nested/b.parquet", "d/_SUCCESS", "d/.hidden.parquet"):
        (tmp_path / name).write_bytes(b"x")
    expected = (str(tmp_path / "d/a.parquet"), str(tmp_path / "d/nested/b.parquet"))
    assert resolve_source(str(tmp_path / "d")).paths == expected
    assert resolve_source(f"file://{tmp_path}/d").paths == expected
    assert resolve_source(f"file://{tmp_path}/d/*.parquet").paths == expected[:1]
    assert resolve_source(f"{tmp_path}/d/**/*.parquet").paths == expected
    assert resolve_source(str(tmp_path / "d" / "a.parquet")).format == "parquet"
    (tmp_path / "d" / "c.csv").write_text("a\n1\n")
    with pytest.raises(SourceError, match="one format"):
        resolve_source(str(tmp_path / "d"))
    with pytest.raises(SourceError, match="matched no files"):
        resolve_source(str(tmp_path / "d" / "*.jsonl"))
