"""The llm-finetune flow's pure pieces, without services: the schedule, the just-in-time
checkpoint's timing, resumes and their cost from the history, the generated corpus,
packing, settings and their messages, base checks, the history file, the loss chart, the
flow's described parameters."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from prefect_ray_lifecycle.flows.llm_finetune import llm_finetune
from prefect_ray_lifecycle.tasks.finetune.chart import draw_finetune
from prefect_ray_lifecycle.tasks.finetune.plan import (
    TINY_BASE,
    default_base,
    split_problem,
)
from prefect_ray_lifecycle.workloads.llm import corpus
from prefect_ray_lifecycle.workloads.llm.models import (
    MODEL_CACHE_ENV,
    causal_lm_problem,
    context_problem,
    local_model,
)
from prefect_ray_lifecycle.workloads.llm.train.history import (
    CONTROLLER_START,
    read_history,
    summarize,
)
from prefect_ray_lifecycle.workloads.llm.train.preemption import (
    effective_deadline_s,
    jit_verdict,
    steps_between_checks,
)
from prefect_ray_lifecycle.workloads.llm.train.recorder import HistoryRecorder
from prefect_ray_lifecycle.workloads.llm.train.schedule import WarmupCosine
from prefect_ray_lifecycle.workloads.llm.train.settings import (
    CorpusSettings,
    ResourceSettings,
    TrainingSettings,
)
from prefect_ray_lifecycle.workloads.llm.train.tokenize import block_ids, pack_ids
from tests.schema_checks import undescribed

# --- pure pieces ---------------------------------------------------------------------------


def test_the_schedule_warms_up_linearly_then_decays_by_cosine_to_its_floor():
    schedule = WarmupCosine(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert [schedule(s) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.55)  # half way down the cosine
    assert schedule(110) == pytest.approx(0.1) and schedule(500) == pytest.approx(0.1)
    values = [schedule(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_the_jit_checkpoint_waits_for_the_last_safe_step():
    # 30 s left; a step and a checkpoint take 3 s with the margin: train on.
    assert jit_verdict(100.0, 130.0, 0.5, 0.5, 2.0).kind == "train_on"
    verdict = jit_verdict(100.0, 102.5, 0.5, 0.5, 2.0)
    assert verdict.kind == "checkpoint_now" and "2.5 s to the deadline" in verdict.reason
    assert jit_verdict(100.0, 99.0, 0.5, 0.5, 2.0).kind == "checkpoint_now"  # past it
    assert effective_deadline_s(1_700_000_012_000, 1_700_000_000.0) == 1_700_000_012.0
    # No deadline in the drain: Ray Train restarts 120 s after it first saw the notice.
    assert effective_deadline_s(None, 1_000.0) == 1_120.0


def test_the_loop_asks_about_a_preemption_once_per_poll_interval_and_at_least_every_step():
    assert steps_between_checks(1.0, 0.25) == 4  # a poll's worth of steps
    assert steps_between_checks(5.0, 0.3) == 16
    assert steps_between_checks(1.0, 3.0) == 1  # steps slower than a poll: every step
    # Nothing measured yet (the first step), or nonsense: ask at the next step.
    assert [steps_between_checks(1.0, s) for s in (None, 0.0, -1.0, math.nan)] == [1] * 4


def step(n: int, attempt: str, **fields) -> dict:
    return {"step": n, "tokens_seen": n * 100, "attempt": attempt, "loss": 5.0 - n / 100, **fields}


def test_resumes_and_what_each_cost_come_from_the_history():
    records = [
        step(0, "a", eval_loss=6.9, loss=None),
        *[step(n, "a") for n in range(1, 25)],
        {"event": "worker-failure", "ranks": [1], "error": "killed"},
        step(21, "b", resumed_from={"step": 20, "kind": "periodic", "tokens_seen": 2000}),
        *[step(n, "b") for n in range(22, 31)],
        step(
            31, "b", preemption={"deadline_ms": 1, "ranks": [1], "nodes": ["n2"], "detected_at": 0}
        ),
        step(35, "b", checkpoint_kind="jit", eval_loss=2.0, checkpoint_path="/c/35"),
        step(
            36,
            "c",
            resumed_from={"step": 35, "kind": "jit", "tokens_seen": 3500, "reread_blocks": 48},
            reread_blocks=80,
            repeated_blocks=3,
        ),
        step(
            40, "c", checkpoint_kind="periodic", eval_loss=1.5, reread_blocks=80, repeated_blocks=3
        ),
        step(43, "c", reread_blocks=80, repeated_blocks=3),
        {"event": CONTROLLER_START},
        step(41, "d", resumed_from={"step": 40, "kind": "periodic", "tokens_seen": 4000}),
        step(50, "d", checkpoint_kind="final", eval_loss=1.2),
    ]
    summary = summarize(records, blocks_per_step=16)
    assert [(r.kind, r.from_step, r.reached_step, r.lost_steps) for r in summary.resumes] == [
        ("worker failure", 20, 24, 4),
        ("preemption", 35, 35, 0),
        ("flow re-run", 40, 43, 3),
    ]
    assert summary.resumes[0].replayed_blocks == 64
    assert (summary.resumes[1].reread_blocks, summary.resumes[1].repeated_blocks) == (32, 3)
    assert (summary.base_eval_loss, summary.best_eval_loss, summary.final_eval_loss) == (
        6.9,
        1.2,
        1.2,
    )
    assert [c.kind for c in summary.checkpoints] == ["jit", "periodic", "final"]
    assert summary.preemptions[0].nodes == ["n2"] and summary.steps == 50


def test_the_corpus_is_templated_the_same_for_a_seed_and_held_out_prompts_are_new(tmp_path):
    train = corpus.examples(500, seed=3)
    assert train == corpus.examples(500, seed=3) != corpus.examples(500, seed=4)
    held_out = corpus.examples(50, seed=3, held_out=True)
    assert not {e.prompt for e in held_out} & {e.prompt for e in train}
    for example in train + held_out:
        start = example.prompt.rsplit(" ", 1)[1]
        answer = example.completion.split()
        if start.isdigit():
            assert answer == [str(int(start) + k) for k in (1, 2, 3)]
        else:
            index = corpus.LETTERS.index(start)
            assert answer == [corpus.LETTERS[(index + k) % len(corpus.LETTERS)] for k in (1, 2, 3)]
    with pytest.raises(ValueError, match=r"tasks must be some of \['copy', 'count', 'reverse'\]"):
        corpus.examples(1, tasks=("sort",))
    files = corpus.write_corpus(tmp_path / "jsonl", 10, layout="text", files=2)
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert len(rows) == 10 and set(rows[0]) == {"id", "text"}
    import pyarrow.parquet as pq

    (parquet,) = corpus.write_corpus(tmp_path / "pq", 4, fmt="parquet", files=1)
    assert pq.read_table(parquet).column_names == ["id", "prompt", "completion"]


def test_texts_pack_into_fixed_length_blocks_each_with_an_id():
    blocks = pack_ids([[1, 2, 3], [4, 5], [6]], eos_id=0, seq_len=4)
    assert blocks.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6]]  # the last partial block is dropped
    ids = block_ids(blocks)
    assert ids.dtype.name == "int64" and len(set(ids.tolist())) == 2 and (ids >= 0).all()
    assert block_ids(blocks[:1]).tolist() == ids[:1].tolist()  # an id is the block's tokens


def test_columns_resources_and_settings_name_what_is_wrong():
    assert CorpusSettings().resolve(["id", "text"]) == ("text", ["text"])
    assert CorpusSettings().resolve(["id", "prompt", "completion"]) == (
        "prompt_completion",
        ["prompt", "completion"],
    )
    with pytest.raises(ValueError, match=r"corpus.text, or corpus.prompt and corpus.completion: "):
        CorpusSettings().resolve(["id", "prompt"])
    with pytest.raises(ValueError, match=r"corpus.text: the data has no column 'body'"):
        CorpusSettings(text="body", layout="text").resolve(["id", "text"])
    resources = ResourceSettings(workers=2, cpus_per_worker=1, tokenize_tasks=2)
    assert resources.problem(cluster_cpus=2.5, cluster_gpus=0, largest_node_cpus=2) is None
    assert "reserves 2.5 CPUs at once" in resources.problem(2.0, 0, 2)
    assert "resources.cpus_per_worker: 1 CPUs, but the largest node" in resources.problem(4, 0, 0.5)
    assert not resources.use_gpu(cluster_gpus=1) and resources.use_gpu(cluster_gpus=2)
    assert not ResourceSettings(gpus="never").use_gpu(8)
    with pytest.raises(ValidationError, match="warmup_steps .20. must be below total_steps .20."):
        TrainingSettings(total_steps=20, warmup_steps=20)
    assert "train split has no rows" in split_problem(0, 5, 3)
    assert split_problem(5, 0, 0).startswith("data.eval_fraction:")
    assert split_problem(5, 1, 0) is None


def test_a_base_must_be_a_causal_lm_with_a_tokenizer_and_the_context_asked_for(tmp_path):
    folder = tmp_path / "bert"
    folder.mkdir()
    assert "has no config.json" in causal_lm_problem(folder)
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"})
    )
    assert "is not a causal language model (architectures: ['BertForMaskedLM']" in (
        causal_lm_problem(folder)
    )
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 64})
    )
    assert "has no tokenizer" in causal_lm_problem(folder)
    (folder / "tokenizer.json").write_text("{}")
    assert causal_lm_problem(folder) is None
    assert context_problem(folder, 64) is None
    assert context_problem(folder, 65) == (
        "65 tokens is over the model's limit of 64 (max_position_embeddings)"
    )


def test_the_history_is_appended_on_a_folder_and_rewritten_on_a_uri(tmp_path):
    for location in (str(tmp_path / "run" / "history.jsonl"), f"file://{tmp_path}/uri/h.jsonl"):
        recorder = HistoryRecorder(location)
        recorder.after_report(None, [step(1, "a")], None)
        recorder.after_report(None, [{}], None)  # another rank's empty report: nothing
        recorder.after_exception(None, {1: RuntimeError("killed")})
        recorder.after_exception(None, {1: RuntimeError("killed")})  # seen again: once
        recorder.after_report(None, [step(2, "b", checkpoint_kind="final")], None)
        records = read_history(location)
        assert [r.get("step", r.get("event")) for r in records] == [1, "worker-failure", 2]
        # A new controller (a flow re-run) appends after what the last one wrote.
        again = HistoryRecorder(location)
        again.after_report(None, [step(3, "c", resumed_from={"step": 2})], None)
        assert [r.get("step", r.get("event")) for r in read_history(location)] == [
            1,
            "worker-failure",
            2,
            CONTROLLER_START,
            3,
        ]


def test_a_base_on_a_uri_is_fetched_once_per_node(tmp_path, monkeypatch):
    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path / "cache"))
    root = tmp_path / "storage"
    (root / TINY_BASE).mkdir(parents=True)  # where default_base builds the tiny Llama
    (root / TINY_BASE / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 512})
    )
    (root / TINY_BASE / "tokenizer.json").write_text("{}")
    base = default_base(f"file://{root}")
    assert base.path == f"file://{root}/{TINY_BASE}"
    folder = local_model(base)
    assert folder.is_relative_to(tmp_path / "cache") and causal_lm_problem(folder) is None
    assert local_model(base) == folder  # the copy is reused


def synthetic_history() -> list[dict]:
    return [
        step(0, "a", eval_loss=6.9, loss=None),
        *[step(n, "a") for n in range(1, 20)],
        step(20, "a", checkpoint_kind="periodic", eval_loss=3.0),
        *[step(n, "a") for n in range(21, 26)],
        step(21, "b", resumed_from={"step": 20, "kind": "periodic", "tokens_seen": 2000}),
        step(
            30,
            "b",
            preemption={"deadline_ms": None, "ranks": [1], "nodes": ["n2"], "detected_at": 1},
        ),
        step(34, "b", checkpoint_kind="jit", eval_loss=2.0),
        step(35, "c", resumed_from={"step": 34, "kind": "jit", "tokens_seen": 3400}),
        step(40, "c", checkpoint_kind="final", eval_loss=1.5),
    ]


def test_the_loss_chart_marks_base_checkpoints_preemption_resumes_and_lost_steps():
    records = synthetic_history()
    figure = draw_finetune(records, summarize(records, 16), title="tiny")
    (axes,) = figure.axes
    gids = {line.get_gid() for line in axes.get_lines()}
    assert {"train:0", "lost:0", "train:1", "train:2", "eval", "base"} <= gids
    assert {"checkpoint:periodic", "checkpoint:jit", "checkpoint:final"} <= gids
    assert {"preemption:0", "resume:0", "resume:1"} <= gids
    lines = {line.get_gid(): line for line in axes.get_lines()}
    # The steps after the resumed checkpoint, trained again, are drawn apart (dashed).
    assert list(lines["lost:0"].get_xdata()) == [n * 100 for n in range(20, 26)]
    assert lines["lost:0"].get_linestyle() == "--"
    assert list(lines["checkpoint:jit"].get_xdata()) == [3400]
    assert list(lines["resume:1"].get_xdata()) == [3400, 3400]
    assert "2 resumes" in figure.get_suptitle()


def test_every_flow_parameter_and_setting_is_described_for_the_ui():
    assert undescribed(llm_finetune) == []
