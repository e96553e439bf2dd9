"""One rollout of a model version on a route, as an object: what every stage needs (the route
context, the gates, the MLflow server, the model, the version, the route's URL, the candidate
and the live version), the traffic gates in order (shadow, canary steps, a person's approval)
and its endings. Every ending leaves through one door (`_close`): the version's verdict and
the `live` alias in MLflow, a Prefect event, then the timeline and the chart; `finish`
returns the result, `fail` raises RolloutFailed with the decision."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

from prefect import get_run_logger
from prefect.runtime import flow_run
from prefect.utilities.urls import url_for
from pydantic import BaseModel, Field

from prefect_ray_lifecycle.blocks import MLflowServer
from prefect_ray_lifecycle.control import registry, serve_control
from prefect_ray_lifecycle.control.canary import GateFailed
from prefect_ray_lifecycle.tasks.rollout import StageResult
from prefect_ray_lifecycle.tasks.rollout.approval import ask
from prefect_ray_lifecycle.tasks.rollout.apps import RouteContext, version_app
from prefect_ray_lifecycle.tasks.rollout.changes import inject, retire, rollback, swap, take_back
from prefect_ray_lifecycle.tasks.rollout.config import Gates, LLMServing, Serving
from prefect_ray_lifecycle.tasks.rollout.gates import bake, canary_step, shadow, shadow_tags
from prefect_ray_lifecycle.tasks.rollout.record import Timeline, emit, record
from prefect_ray_lifecycle.workloads.serve.router_config import Target, TargetKind

__all__ = [
    "LiveNotRecorded",
    "Outcome",
    "Rollout",
    "RolloutFailed",
    "RolloutResult",
    "best_effort",
    "resolve_version",
]

Outcome = Literal["promoted", "first_rollout", "already_live", "withdrawn", "rebaked"]


class RolloutFailed(RuntimeError):
    """The candidate was rejected or rolled back; the live version kept serving."""


class LiveNotRecorded(RuntimeError):
    """The router was swapped but MLflow's `live` alias could not be moved to match (MLflow
    unreachable past the task's retries): the swap was undone, so the route serves what `live`
    names; the candidate was not judged, and the next reconcile rolls the champion out again."""


class RolloutResult(BaseModel):
    model_name: str
    version: str
    route: str
    outcome: str = Field(
        description="promoted, first_rollout, already_live, or for a recovered rollout: "
        "withdrawn or rebaked."
    )
    reason: str
    url: str = Field(description="The route's URL.")
    previous_version: str | None = None
    timeline: list[dict[str, Any]] = Field(default_factory=list)
    chart_url: str | None = Field(
        None, description="The rollout's chart (a PNG on the version's MLflow run)."
    )
    flow_run_id: str | None = Field(None, description="The flow run that rolled it out.")
    flow_run_url: str | None = Field(None, description="That flow run in the Prefect UI.")


def resolve_version(server: MLflowServer, model_name: str, version: str | None, alias: str) -> str:
    """The version to roll out: `version`, else the one `alias` names now; READY or an error."""
    with server.session() as client:
        if version is not None:
            found = client.get_model_version(model_name, str(version))
        else:
            found = registry.resolve_alias(client, model_name, alias)
            if found is None:
                raise ValueError(
                    f"{model_name} has no version with alias {alias!r}; pass a "
                    f"version or set the alias"
                )
    if found.status != "READY":
        raise ValueError(f"{model_name} v{found.version} is {found.status}, not READY")
    return str(found.version)


@dataclass
class Rollout:
    """A rollout in progress on a route this flow run holds (`ctx.claim`)."""

    ctx: RouteContext
    gates: Gates
    server: MLflowServer
    model_name: str
    version: str
    url: str
    timeline: Timeline
    live: Target | None  # what the route served when the rollout started
    previous_version: str | None  # what the result calls the version it replaced
    candidate: Target | None = None
    app_config: dict[str, Any] | None = None
    health_period_s: float = 0.0
    inline_live: bool = False  # the router hosts the live version in its replicas
    # Kept on the version with every verdict: the shadow's figures, who approved.
    tags: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def begin(
        cls,
        ctx: RouteContext,
        gates: Gates,
        server: MLflowServer,
        model_name: str,
        version: str,
        url: str,
        *,
        kind: TargetKind,
        serving: Serving,
        llm: LLMServing,
        faults: dict[str, Any],
    ) -> Rollout:
        """A rollout of `version` onto the route as its router serves it now."""
        app_config, candidate, health_period_s = version_app(
            kind, server, model_name, version, serving, llm, faults, ctx.runtime_env
        )
        router = serve_control.current_router(ctx.route)
        live = router.live if router else None
        rollout = cls(
            ctx=ctx,
            gates=gates,
            server=server,
            model_name=model_name,
            version=version,
            url=url,
            timeline=cls.new_timeline(ctx, gates, server, model_name, version, "Rollout"),
            live=live,
            previous_version=live.version if live else None,
            candidate=candidate,
            app_config=app_config,
            health_period_s=health_period_s,
            inline_live=bool(router and router.inline_live and live and ctx.hosts(live)),
        )
        rollout.timeline.live = rollout.previous_version
        rollout.timeline.kind = kind
        return rollout

    @staticmethod
    def new_timeline(
        ctx: RouteContext,
        gates: Gates,
        server: MLflowServer,
        model_name: str,
        version: str,
        kind: str,
    ) -> Timeline:
        return Timeline(
            f"{kind} of {model_name} v{version} on /{ctx.route}",
            model_name=model_name,
            version=version,
            route=ctx.route,
            server=server,
            gates=gates,
        )

    @property
    def route(self) -> str:
        return self.ctx.route

    @property
    def already_live(self) -> bool:
        return (
            self.live is not None
            and self.candidate is not None
            and self.live.version == self.version
            and self.live.app == self.candidate.app
        )

    def add(
        self,
        stage: str,
        outcome: str,
        result: StageResult | str,
        figures: dict[str, Any] | None = None,
    ) -> None:
        """A stage on the timeline: a stage's result (its reason and figures), or a detail."""
        if isinstance(result, StageResult):
            self.timeline.add(stage, outcome, result.reason, result.figures())
        else:
            self.timeline.add(stage, outcome, result, figures)

    def shadow(self) -> None:
        """The shadow stage, when the gates ask for one: GateFailed at `shadow` otherwise."""
        if not self.gates.shadow_share:
            return
        try:
            result = shadow(self.ctx, self.gates, self.live, self.candidate, self.inline_live)
        except GateFailed as failure:
            self.tags.update(shadow_tags(failure.figures))
            raise
        self.tags.update(shadow_tags(result.figures()))
        self.add("shadow", "inconclusive" if result.inconclusive else "passed", result)

    def gate_traffic(self, steps: list[float], asked: bool = False) -> None:
        """The canary steps in order, each judged, and a person's approval where the gates
        ask for it (`asked`: the approval before the swap was given already)."""
        for weight in steps:
            step = canary_step(
                self.ctx, self.gates, weight, self.live, self.candidate, self.inline_live
            )
            self.add(f"canary {weight:.0%}", "passed", step)
            if self.gates.asks_after(weight):
                self.approve(weight, "after_step")
        if self.gates.approval == "before_swap" and not asked:
            self.approve(steps[-1] if steps else 0.0, "before_swap")

    def approve(self, weight: float, point: Literal["before_swap", "after_step"]) -> None:
        """Wait for a person's approval at `weight`: GateFailed at `approval` on an abort."""
        try:
            result = ask(
                self.ctx,
                self.gates,
                self.timeline,
                self.live,
                self.candidate,
                self.inline_live,
                weight,
                point,
            )
        except GateFailed as failure:
            self.tags.update(approval_by=failure.figures.get("name"))
            raise
        self.tags.update(approved_by=result.by, approval_reason=result.reason)
        self.add("approval", "approved", result)

    def finish(
        self,
        outcome: Outcome,
        reason: str,
        decision: str,
        *,
        verdict: dict[str, Any] | None = None,
        move_live_to: str | None = None,
        live_reason: str = "",
        event: tuple[str, dict[str, Any]] | None = None,
        chart: bool = True,
    ) -> RolloutResult:
        """End the rollout with `outcome`: record, announce, publish; its result."""
        self._close(decision, verdict, move_live_to, live_reason, event, chart)
        return RolloutResult(
            model_name=self.model_name,
            version=self.version,
            route=self.route,
            outcome=outcome,
            reason=reason,
            url=self.url,
            previous_version=self.previous_version,
            timeline=self.timeline.entries,
            chart_url=self.timeline.chart_url,
            flow_run_id=str(flow_run.id) if flow_run.id else None,
            flow_run_url=_run_url(),
        )

    def fail(
        self,
        failure: GateFailed,
        verdict: Literal["rejected", "rolled_back"],
        serving: Target | None,
    ) -> NoReturn:
        """End the rollout on a failed gate (`serving` keeps the route): tagged with the reason,
        announced, published; raises RolloutFailed with the decision."""
        self.timeline.add(failure.stage, "failed", failure.reason, failure.figures)
        decision = (
            f"v{self.version} {'rolled back' if verdict == 'rolled_back' else 'rejected'} at "
            f"{failure.stage}: {failure.reason}; v{serving.version if serving else '?'} serves "
            f"/{self.route}"
        )
        self._close(
            decision,
            {"verdict": verdict, "stage": failure.stage, "reason": failure.reason},
            serving.version if verdict == "rolled_back" and serving else None,
            f"rollback: v{self.version} {failure.reason}",
            (
                verdict.replace("_", "-"),
                {
                    "stage": failure.stage,
                    "reason": failure.reason,
                    "live": serving and serving.version,
                },
            ),
            True,
        )
        raise RolloutFailed(decision)

    def _close(
        self,
        decision: str,
        verdict: dict[str, Any] | None,
        move_live_to: str | None,
        live_reason: str,
        event: tuple[str, dict[str, Any]] | None,
        chart: bool,
    ) -> None:
        """The one way out: the verdict and `live` in MLflow, the event, the timeline."""
        if verdict is not None or move_live_to is not None:
            record(
                self.server,
                self.model_name,
                self.version,
                {**self.tags, **(verdict or {}), "route": self.route},
                move_live_to=move_live_to,
                reason=live_reason,
            )
        if event is not None:
            emit(event[0], self.model_name, self.version, self.route, event[1])
        self.timeline.publish(decision, chart=chart)

    def move_live(self, verdict: str, reason: str) -> None:
        """After the swap, `live` follows the router. The router moves first (users must get
        the new version before MLflow says they do), and when `live` cannot follow, the swap is
        undone: the route goes back to what it served (nothing, for a first rollout), so the
        router and `live` never name different versions once this run has ended."""
        try:
            record(
                self.server,
                self.model_name,
                self.version,
                {**self.tags, "verdict": verdict, "route": self.route, "app": self.candidate.app},
                move_live_to=self.version,
                reason=reason,
            )
        except BaseException as error:
            if self.live is None:
                best_effort(take_back, self.ctx, self.candidate.app)
                back = "the route serves nothing again, as before this first rollout"
            else:
                best_effort(rollback, self.ctx, self.live, self.candidate.app)
                back = f"/{self.route} is back on v{self.live.version}"
            message = (
                f"v{self.version} was swapped in on /{self.route}, but MLflow's `live` could "
                f"not be moved to it ({type(error).__name__}: {error}): the swap is undone and "
                f"{back}; the next reconcile rolls the champion out again"
            )
            get_run_logger().error(message)
            raise LiveNotRecorded(message) from error

    def swap_then_bake(self, after_swap: dict[str, Any] | None = None) -> RolloutResult:
        """The swap (`live` follows the router, before the bake decides), a drill's faults
        on the new version when asked, then the bake and what follows it."""
        swapped = swap(self.ctx, self.candidate, self.live)
        self.move_live("swapped", "passed health, smoke and canary gates")
        self.add(
            "swap",
            "done",
            f"/{self.route} -> v{self.version}; alias live moved",
            {"seconds": swapped.seconds},
        )
        if after_swap:
            inject(self.candidate.app, after_swap)
            self.add("drill", "injected", f"after the swap: {after_swap}")
        return self.bake_then_settle(self.candidate, self.live, swapped.at, "promoted")

    def bake_then_settle(
        self, new: Target, previous: Target, since: float, outcome: Outcome
    ) -> RolloutResult:
        """Bake the swapped-in version, then retire the previous one, or roll back to it."""
        try:
            baked = bake(self.ctx, self.gates, new, since)
        except GateFailed as failure:
            undone = rollback(self.ctx, previous, new.app)
            detected = failure.figures.get("detected_at")
            seconds = round(time.time() - detected, 2) if detected else None
            self.add(
                "rollback",
                "done",
                f"/{self.route} -> v{previous.version}",
                {"seconds_to_rollback": seconds, **undone.figures()},
            )
            self.fail(failure, "rolled_back", previous)
        except BaseException:
            best_effort(rollback, self.ctx, previous, new.app)
            raise
        self.add("bake", "passed", baked)
        retired = retire(self.ctx, new, previous.app)
        hosted = "in process" if retired.inline else "through its app"
        self.add(
            "retire",
            "done",
            f"v{previous.version}'s app deleted; router hosts v{new.version} {hosted}",
            retired.figures(),
        )
        return self.finish(
            outcome,
            baked.reason,
            f"v{new.version} replaced v{previous.version} on /{self.route}",
            verdict={"verdict": "promoted", "app": new.app, "reason": baked.reason},
            event=("promoted", {"previous": previous.version, "url": self.url}),
        )


def _run_url() -> str | None:
    return str(url_for("flow-run", obj_id=flow_run.id) or "") or None if flow_run.id else None


def best_effort(stage: Any, *args: Any) -> None:
    """Clean up after an unexpected error without hiding it."""
    try:
        stage(*args)
    except Exception as error:  # the original error matters more
        get_run_logger().error("cleanup %s failed: %r", stage.name, error)
