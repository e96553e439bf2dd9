"""What a route's router serves, carried in its Serve user_config: the live version, a
candidate and its share (or, in a shadow stage, the copies it gets), the previous version a
bake falls back to, who may reach the candidate with a tester's header, and the rollout that
holds the route. Parsing refuses any config that would put traffic on a version that has not
passed its gates without a rollout holding the route under a lease."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from prefect_ray_lifecycle.workloads.constants import LLM_DEPLOYMENT, POLICY_DEPLOYMENT
from prefect_ray_lifecycle.workloads.llm.config import LLMAppArgs
from prefect_ray_lifecycle.workloads.serve.policy import ModelSpec

__all__ = [
    "DEPLOYMENTS",
    "Approval",
    "RolloutRecord",
    "RouterConfig",
    "Shadow",
    "Target",
    "TargetKind",
    "Testers",
]

TargetKind = Literal["policy", "llm"]
# The Serve deployment a target's app runs, by its kind.
DEPLOYMENTS: dict[str, str] = {"policy": POLICY_DEPLOYMENT, "llm": LLM_DEPLOYMENT}
# shadow: the candidate gets copies only; canary: a share of users; bake: swapped, the
# previous version kept.
STAGES = ("shadow", "canary", "bake")
CANDIDATE_STAGES = ("shadow", "canary")
TESTER_MODES = ("off", "on", "token")


@dataclass(frozen=True)
class Target:
    """A model version's Serve application (a policy or an LLM, by `kind`), and how to load
    it in process."""

    version: str
    app: str
    kind: TargetKind = "policy"
    # How to load it in the router's replicas: a policy's ModelSpec fields, an LLM's app
    # args (workloads.llm.LLMAppArgs). None: always reached through its app.
    model: dict[str, Any] | None = None

    def __post_init__(self):
        if self.kind not in DEPLOYMENTS:
            raise ValueError(
                f"a target's kind must be one of {sorted(DEPLOYMENTS)}, got {self.kind!r}"
            )

    @property
    def deployment(self) -> str:
        return DEPLOYMENTS[self.kind]

    @classmethod
    def parse(cls, value: dict[str, Any] | None) -> Target | None:
        if value is None:
            return None
        if not isinstance(value, dict) or not value.get("app") or not value.get("version"):
            raise ValueError(f"a target needs app and version, got {value!r}")
        kind = value.get("kind")
        if kind is None:  # a config written before targets had a kind names the deployment
            kind = "llm" if value.get("deployment") == LLM_DEPLOYMENT else "policy"
        model = value.get("model")
        if model is not None and kind == "llm":
            model = LLMAppArgs.model_validate(model).model_dump(mode="json")
        elif model is not None:
            ModelSpec.parse(model)
        return cls(str(value["version"]), str(value["app"]), kind, model)

    def as_dict(self) -> dict[str, Any]:
        # `deployment` too: routers still running the previous code read it.
        return {
            "version": self.version,
            "app": self.app,
            "kind": self.kind,
            "deployment": self.deployment,
            "model": self.model,
        }


@dataclass(frozen=True)
class Approval:
    """A rollout waiting for a person's approval (in the Prefect UI) at `weight`, the canary
    share it keeps serving meanwhile: whoever finds the holder dead asks again, and never
    swaps an unapproved candidate in."""

    point: Literal["before_swap", "after_step"]
    weight: float
    since: float = 0.0  # wall-clock time it started waiting

    @classmethod
    def parse(cls, value: dict[str, Any] | None) -> Approval | None:
        if value is None:
            return None
        if not isinstance(value, dict) or value.get("point") not in ("before_swap", "after_step"):
            raise ValueError(f"an approval's point is before_swap or after_step, got {value!r}")
        weight = float(value.get("weight", 0.0))
        if not 0.0 <= weight < 1.0:
            raise ValueError(f"an approval's weight must be within [0, 1), got {weight}")
        return cls(value["point"], weight, float(value.get("since", 0.0)))

    def as_dict(self) -> dict[str, Any]:
        return {"point": self.point, "weight": self.weight, "since": self.since}


@dataclass(frozen=True)
class RolloutRecord:
    """The rollout holding the route and how far it got, so that whoever finds it after the
    holder died can finish it: `shadow` or `canary` (a candidate that gets copies or a share,
    not yet swapped; with `approval` while it waits for a person) or `bake` (the new version
    is live, the previous one is still up)."""

    holder: str  # the holder's id: the Prefect flow run that claimed the route
    stage: Literal["shadow", "canary", "bake"]
    version: str  # the version being rolled out
    started_at: float = 0.0  # wall-clock time the rollout claimed the route
    approval: Approval | None = None

    @classmethod
    def parse(cls, value: dict[str, Any] | None) -> RolloutRecord | None:
        if value is None:
            return None
        if not isinstance(value, dict) or not value.get("holder") or not value.get("version"):
            raise ValueError(f"a rollout record needs holder and version, got {value!r}")
        if value.get("stage") not in STAGES:
            raise ValueError(f"a rollout stage is one of {STAGES}, got {value.get('stage')!r}")
        approval = Approval.parse(value.get("approval"))
        if approval is not None and value["stage"] != "canary":
            raise ValueError("a rollout waits for approval only in its canary")
        return cls(
            str(value["holder"]),
            value["stage"],
            str(value["version"]),
            float(value.get("started_at", 0.0)),
            approval,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "holder": self.holder,
            "stage": self.stage,
            "version": self.version,
            "started_at": self.started_at,
            "approval": self.approval and self.approval.as_dict(),
        }


@dataclass(frozen=True)
class Shadow:
    """The shadow stage's copies: `share` of live requests (and at most `max_per_s` a second
    from each router replica) are sent to the candidate as well, off the users' path, and its
    answers compared with live's; with `noise_floor`, as many to the live version's own app,
    to measure how often live disagrees with itself."""

    share: float
    max_per_s: float
    noise_floor: bool = False

    @classmethod
    def parse(cls, value: dict[str, Any] | None) -> Shadow | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"a shadow needs share and max_per_s, got {value!r}")
        shadow = cls(
            float(value.get("share", 0.0)),
            float(value.get("max_per_s", 0.0)),
            bool(value.get("noise_floor", False)),
        )
        if not 0.0 < shadow.share <= 1.0 or shadow.max_per_s <= 0:
            raise ValueError(
                f"a shadow needs a share in (0, 1] and a positive max_per_s: {value!r}"
            )
        return shadow

    def as_dict(self) -> dict[str, Any]:
        return {"share": self.share, "max_per_s": self.max_per_s, "noise_floor": self.noise_floor}


@dataclass(frozen=True)
class Testers:
    """Who may send a request to the candidate on purpose (`X-Canary: always`, or keep off it
    with `never`) while a rollout holds the route: nobody (`off`), anyone (`on`), or whoever
    also sends the token whose SHA-256 is `token_sha256` (`token`). Their requests are kept
    out of the gates' figures."""

    mode: Literal["off", "on", "token"] = "off"
    token_sha256: str | None = None

    @classmethod
    def parse(cls, value: dict[str, Any] | None) -> Testers:
        value = dict(value or {})
        mode = value.get("mode", "off")
        if mode not in TESTER_MODES:
            raise ValueError(f"testers' mode is one of {TESTER_MODES}, got {mode!r}")
        digest = value.get("token_sha256") or None
        if mode == "token" and not (
            isinstance(digest, str) and len(digest) == 64 and set(digest) <= set("0123456789abcdef")
        ):
            raise ValueError("testers' token mode needs token_sha256, a hex SHA-256 digest")
        return cls(mode, digest if mode == "token" else None)

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "token_sha256": self.token_sha256}


_FIELDS = {
    "live",
    "candidate",
    "candidate_weight",
    "previous",
    "inline_live",
    "fallback",
    "timeout_s",
    "generation",
    "rollout",
    "shadow",
    "testers",
}


@dataclass(frozen=True)
class RouterConfig:
    live: Target | None = None
    candidate: Target | None = None
    candidate_weight: float = 0.0  # served only while the rollout's lease holds
    previous: Target | None = None  # during a bake: the version that served before the swap
    inline_live: bool = False  # host the live version in the router's own replicas (hosted.py)
    fallback: bool = True  # answer a candidate's (or baking version's) failure from the other
    timeout_s: float = 10.0
    generation: int = 0
    rollout: RolloutRecord | None = None
    shadow: Shadow | None = None  # in a shadow stage: the candidate's copies
    testers: Testers = Testers()

    @classmethod
    def parse(cls, value: dict[str, Any] | None) -> RouterConfig:
        value = dict(value or {})
        unknown = set(value) - _FIELDS
        if unknown:
            raise ValueError(f"unknown router config fields {sorted(unknown)}")
        config = cls(
            live=Target.parse(value.get("live")),
            candidate=Target.parse(value.get("candidate")),
            candidate_weight=float(value.get("candidate_weight", 0.0)),
            previous=Target.parse(value.get("previous")),
            inline_live=bool(value.get("inline_live", False)),
            fallback=bool(value.get("fallback", True)),
            timeout_s=float(value.get("timeout_s", 10.0)),
            generation=int(value.get("generation", 0)),
            rollout=RolloutRecord.parse(value.get("rollout")),
            shadow=Shadow.parse(value.get("shadow")),
            testers=Testers.parse(value.get("testers")),
        )
        config.check()
        return config

    def check(self) -> None:
        """Raise ValueError naming what makes this config unsafe or inconsistent."""
        if not 0.0 <= self.candidate_weight <= 1.0:
            raise ValueError(f"candidate_weight must be within [0, 1], got {self.candidate_weight}")
        if self.candidate_weight and self.candidate is None:
            raise ValueError("candidate_weight is set but there is no candidate")
        if self.candidate is not None and (
            self.rollout is None
            or self.rollout.stage not in CANDIDATE_STAGES
            or self.rollout.version != self.candidate.version
        ):
            raise ValueError(
                "a candidate is served only under a shadow or canary rollout record for its "
                "version (its share lapses with the rollout's lease)"
            )
        shadowing = self.rollout is not None and self.rollout.stage == "shadow"
        if self.shadow is not None and not (shadowing and self.candidate is not None):
            raise ValueError("a shadow copies requests to a candidate only in a shadow stage")
        if shadowing and self.candidate_weight:
            raise ValueError("in a shadow stage the candidate answers no user: weight must be 0")
        if self.previous is not None and (self.rollout is None or self.rollout.stage != "bake"):
            raise ValueError("a previous version is kept only during a bake")
        if self.candidate is not None and self.live is None:
            raise ValueError("a candidate needs a live version to fall back on")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        live = self.live
        if self.inline_live and (live is None or live.model is None):
            raise ValueError("inline_live needs a live target with its model spec")

    def as_dict(self) -> dict[str, Any]:
        return {
            "live": self.live and self.live.as_dict(),
            "candidate": self.candidate and self.candidate.as_dict(),
            "candidate_weight": self.candidate_weight,
            "previous": self.previous and self.previous.as_dict(),
            "inline_live": self.inline_live,
            "fallback": self.fallback,
            "timeout_s": self.timeout_s,
            "generation": self.generation,
            "rollout": self.rollout and self.rollout.as_dict(),
            "shadow": self.shadow and self.shadow.as_dict(),
            "testers": self.testers.as_dict(),
        }

    def settled(self) -> RouterConfig:
        """This config with any rollout taken back: the live version only."""
        return replace(
            self, candidate=None, candidate_weight=0.0, previous=None, rollout=None, shadow=None
        )
