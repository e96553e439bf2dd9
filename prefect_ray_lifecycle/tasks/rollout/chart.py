"""One chart per rollout: per version, requests/s, error rate and p99 through the router over
the rollout, with the stage boundaries (health, smoke, shadow, each canary step, approval,
swap, bake, retire or rollback) and the gates' thresholds drawn; after a shadow stage, a
fourth panel: the candidate's agreement with live over time, beside the noise floor (live's
own app against live) and the gate's minimum. Its data comes from the route's state actor
(what every router replica reported) and the rollout's timeline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefect_ray_lifecycle.tasks.charts import new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["draw_rollout"]

LIVE_COLOUR, CANDIDATE_COLOUR, OTHER_COLOUR = "tab:blue", "tab:orange", "tab:gray"
FAILED_OUTCOMES = {"failed", "rolled_back"}


def draw_rollout(data: dict[str, Any]) -> Figure:
    """Draw `data`: {"title", "started" (time.time()), "candidate", "live" (versions or None),
    "series": {version: [{"at", "requests_per_s", "error_rate", "p99_ms"}, ...]},
    "stages": [{"at" (time.time()), "stage", "outcome"}, ...],
    "thresholds": {"max_error_rate", "max_p99_ms", "max_p99_ratio", "p99_slack_ms",
    "min_agreement"}, and optionally "shadow": {"candidate" | "noise_floor": {version: [{"at",
    "compared", "agreement"}, ...]}}."""
    shadow = data.get("shadow") or {}
    shadowed = any(points for versions in shadow.values() for points in versions.values())
    figure = new_figure(11.0, 10.0 if shadowed else 8.0)
    panels = figure.subplots(4 if shadowed else 3, 1, sharex=True)
    rate, errors, p99 = panels[:3]
    started = data["started"]
    colours = {data.get("live"): LIVE_COLOUR, data["candidate"]: CANDIDATE_COLOUR}
    for version, points in sorted(data["series"].items()):
        if not points:
            continue
        role = (
            "candidate"
            if version == data["candidate"]
            else "live"
            if version == data.get("live")
            else "other"
        )
        style = {"color": colours.get(version, OTHER_COLOUR), "label": f"v{version} ({role})"}
        xs = [p["at"] - started for p in points]
        rate.plot(xs, [p["requests_per_s"] for p in points], marker=".", **style)
        errors.plot(xs, [p["error_rate"] for p in points], marker=".", **style)
        latencies = [(x, p["p99_ms"]) for x, p in zip(xs, points, strict=True) if p["p99_ms"]]
        if latencies:
            p99.plot(*zip(*latencies, strict=True), marker=".", **style)

    limits = data["thresholds"]
    errors.axhline(
        limits["max_error_rate"],
        color="red",
        linestyle="--",
        label=f"gate: max {limits['max_error_rate']:g}",
    )
    p99.axhline(
        limits["max_p99_ms"],
        color="red",
        linestyle="--",
        label=f"gate: max {limits['max_p99_ms']:g} ms",
    )
    live_points = data["series"].get(data.get("live")) or []
    relative = [
        (p["at"] - started, limits["max_p99_ratio"] * p["p99_ms"] + limits["p99_slack_ms"])
        for p in live_points
        if p["p99_ms"]
    ]
    if relative and data.get("live") != data["candidate"]:
        p99.plot(
            *zip(*relative, strict=True),
            color="red",
            linestyle=":",
            label="gate: live p99 x ratio + slack",
        )
    # Scaled to what was measured: a far-off absolute cap stays named in the legend.
    seen = [p["p99_ms"] for points in data["series"].values() for p in points if p["p99_ms"]]
    seen += [limit for _, limit in relative]
    top = max(seen, default=limits["max_p99_ms"]) * 1.5
    p99.set_ylim(0, min(top, limits["max_p99_ms"] * 1.1))
    rate.set_ylim(bottom=0)
    errors.set_ylim(bottom=0)

    if shadowed:
        _draw_agreement(panels[3], shadow, started, limits.get("min_agreement"))

    marks = [
        (m["at"] - started, f"{m['stage']}: {m['outcome']}", m["outcome"] in FAILED_OUTCOMES)
        for m in data["stages"]
    ]
    end = max([at for at, _, _ in marks] + [rate.get_xlim()[1], 1.0])
    for axes in panels:
        for at, _, failed in marks:
            axes.axvline(at, color="red" if failed else "black", linewidth=0.8, alpha=0.6)
        axes.set_xlim(0, end)
        axes.grid(alpha=0.3)
    for at, label, failed in _grouped(marks, end * 0.025):
        rate.annotate(
            label,
            xy=(at, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=60,
            fontsize=7,
            va="bottom",
            ha="left",
            color="red" if failed else "black",
        )
    if not any(data["series"].values()):
        rate.text(
            0.5,
            0.5,
            "no requests through the router during this rollout",
            transform=rate.transAxes,
            ha="center",
            color="gray",
        )
    rate.set_ylabel("requests/s")
    errors.set_ylabel("error rate")
    p99.set_ylabel("p99 (ms)")
    panels[-1].set_xlabel("seconds since the rollout started")
    for axes in panels:  # outside the plot: the lines stay readable
        if axes.get_legend_handles_labels()[0]:
            axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    figure.suptitle(data["title"])
    return figure


def _draw_agreement(
    axes: Any, shadow: dict[str, Any], started: float, minimum: float | None
) -> None:
    """The shadow panel: agreement per bucket of the candidate's copies, and of the noise
    floor's, with the gate's minimum."""
    styles = {
        "candidate": {"color": CANDIDATE_COLOUR, "marker": "."},
        "noise_floor": {"color": LIVE_COLOUR, "marker": "x", "linestyle": "--"},
    }
    for role, versions in sorted(shadow.items()):
        for version, points in sorted(versions.items()):
            shown = [
                (p["at"] - started, p["agreement"]) for p in points if p["agreement"] is not None
            ]
            if not shown:
                continue
            label = (
                f"v{version} vs live"
                if role == "candidate"
                else f"noise floor: v{version} vs itself"
            )
            axes.plot(*zip(*shown, strict=True), label=label, **styles.get(role, {}))
    if minimum is not None:
        axes.axhline(minimum, color="red", linestyle="--", label=f"gate: min {minimum:.0%}")
    axes.set_ylim(-0.02, 1.05)
    axes.set_ylabel("shadow agreement")


def _grouped(marks: list[tuple[float, str, bool]], within: float) -> list[tuple[float, str, bool]]:
    """Stage labels closer than `within` seconds to the previous one share one label, so
    stages that ended together (health then smoke) stay readable."""
    groups: list[tuple[float, str, bool]] = []
    for at, label, failed in marks:
        if groups and at - groups[-1][0] < within:
            first, text, any_failed = groups[-1]
            groups[-1] = (first, f"{text}, {label}", any_failed or failed)
        else:
            groups.append((at, label, failed))
    return groups
