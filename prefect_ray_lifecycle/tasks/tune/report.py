"""What a sweep shows in Prefect: a progress artifact kept up to date by a Tune callback, the
trial table, the best trial's summary and the sweep's chart. Every artifact is written by one
background thread in the task run's context, so neither Tune's event loop nor the sweep's tail
waits on the API; `close()` waits for what is queued."""

from __future__ import annotations

import base64
import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.exceptions import PrefectException
from prefect.logging import get_run_logger

from prefect_ray_lifecycle.workloads.rl import rllib

PROGRESS_KEY = "tune-sweep-progress"
TRIALS_KEY = "tune-sweep-trials"
BEST_KEY = "tune-sweep-best"
CHART_KEY = "tune-sweep-chart"


def log(message: str, warning: bool = False) -> None:
    logger = get_run_logger()
    (logger.warning if warning else logger.info)(message)


def _flat_get(result: dict[str, Any], key: str) -> Any:
    for part in key.split("/"):
        result = result.get(part, {}) if isinstance(result, dict) else {}
    return None if result == {} else result


class SweepReport:
    """The sweep's artifacts, written in order by one background thread. While entered, it is
    this thread's report (`current()`), which Tune's callbacks write to."""

    def __init__(self) -> None:
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sweep-artifacts")
        self._progress_id: Any = None
        self._token: contextvars.Token | None = None
        self._writes: list[Future] = []

    def __enter__(self) -> SweepReport:
        self._token = _CURRENT.set(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        _CURRENT.reset(self._token)
        self._writer.shutdown(wait=True)
        if exc_type is None:
            for write in self._writes:
                write.result()  # an API hiccup was only logged; a bug fails the task here

    @staticmethod
    def current() -> SweepReport | None:
        return _CURRENT.get()

    def _submit(self, what: str, write: Callable[[], None]) -> None:
        def guarded() -> None:
            try:
                write()
            except (httpx.HTTPError, OSError, PrefectException) as error:
                # Artifacts report the sweep; an API hiccup must not fail the sweep itself.
                log(f"could not write the {what} artifact: {error!r}", warning=True)

        # Each write runs in a copy of the caller's context: the task run it belongs to.
        self._writes.append(self._writer.submit(contextvars.copy_context().run, guarded))

    def progress(self, done: int, total: int) -> None:
        def write() -> None:
            share = 100.0 * done / max(total, 1)
            description = f"{done} of {total} trials finished"
            if self._progress_id is None:
                self._progress_id = create_progress_artifact(
                    share, key=PROGRESS_KEY, description=description
                )
            else:
                update_progress_artifact(self._progress_id, share, description=description)

        self._submit("progress", write)

    def trials(self, rows: list[dict[str, Any]]) -> None:
        self._submit(
            "trial table",
            lambda: create_table_artifact(
                key=TRIALS_KEY, table=rows, description="Every trial of the sweep"
            ),
        )

    def best(self, markdown: str) -> None:
        self._submit(
            "best trial",
            lambda: create_markdown_artifact(
                key=BEST_KEY, markdown=markdown, description="Best trial of the sweep"
            ),
        )

    def chart(self, png: bytes, caption: str) -> None:
        """The sweep's chart, embedded in a markdown artifact as a data URI: the sweep has no
        server to host the image (registration logs it on the version's MLflow run)."""
        data = base64.b64encode(png).decode("ascii")
        self._submit(
            "sweep chart",
            lambda: create_markdown_artifact(
                key=CHART_KEY,
                markdown=f"![sweep chart](data:image/png;base64,{data})\n\n{caption}\n",
                description="Every trial's learning curve, and the best one's evaluation",
            ),
        )


# Tune pickles its callbacks with the experiment and a resumed sweep runs the unpickled ones,
# so they find the live report here; where there is none (Tune's driver on the cluster, as
# through Ray Client) they do nothing.
_CURRENT: contextvars.ContextVar[SweepReport | None] = contextvars.ContextVar(
    "tune_sweep_report", default=None
)


def progress_callback():
    """A Tune callback that keeps the progress artifact at the share of finished trials."""
    from ray.tune import Callback

    class ProgressArtifact(Callback):
        def setup(self, total_num_samples=None, **info):
            self.total = total_num_samples or 0
            self.started = False

        def _update(self, trials, finishing=None):
            # Tune calls the hooks before it marks the finishing trial as done.
            done = len(
                {t.trial_id for t in trials if t.status in ("TERMINATED", "ERROR")}
                | ({finishing.trial_id} if finishing is not None else set())
            )
            report = SweepReport.current()
            if report is not None:
                report.progress(done, max(self.total, len(trials), 1))

        def on_trial_start(self, iteration, trials, trial, **info):
            if not self.started:
                self.started = True
                self._update(trials)

        def on_trial_complete(self, iteration, trials, trial, **info):
            if SweepReport.current() is None:
                return
            result = trial.last_result or {}
            log(
                f"trial {trial.trial_id} finished after {result.get('training_iteration')} "
                f"iterations: {rllib.RETURN_METRIC}="
                f"{_flat_get(result, rllib.RETURN_METRIC)}"
            )
            self._update(trials, trial)

        def on_trial_error(self, iteration, trials, trial, **info):
            if SweepReport.current() is None:
                return
            log(f"trial {trial.trial_id} failed for good (no retries left)")
            self._update(trials, trial)

    return ProgressArtifact()
