"""The route now: what a route serves, how each version fared lately, the last verdicts.

    python -m deployments.status [--url http://127.0.0.1:8000/policy] [--model cartpole-ppo]
                                 [--mlflow-uri URI] [--window 300] [--json]

One `GET <url>/-/status?window_s=N` gives the router's live and candidate versions, the
candidate's weight and the share it is served (none once its rollout's lease lapsed), the
lease, a rollout waiting for approval, and each version's requests, errors, fallbacks and
latency over the last N seconds, as every router replica reported them; a shadow stage's
agreement with live (and the noise floor), and testers' requests, apart. MLflow gives the
model's aliases and the last rollout verdicts (the `lifecycle.rollout.*` tags), newest
first. The model is the one the router's live version names, else --model. Prints terminal
tables, or one JSON object with --json.

Exit status: 0 when the route answered (MLflow unreachable is reported, not fatal), 2 when
nothing listens at the URL or what answers there is not a router.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Collection, Iterator
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000/policy"
DEFAULT_MODEL = "cartpole-ppo"
DEFAULT_MLFLOW = "http://127.0.0.1:5000"
DEFAULT_WINDOW_S = 300
MAX_WINDOW_S = 900  # what a route's state keeps (workloads.serve.route_state.FIGURES_KEEP_S)
VERDICTS = 5
NOT_A_ROUTE = 2  # exit status


class NotARoute(Exception):
    """Nothing answers at the URL, or what answers is not a router."""


def route_status(url: str, window_s: int = DEFAULT_WINDOW_S, timeout: float = 10) -> dict:
    """The router's `GET <url>/-/status?window_s=N`; NotARoute when there is none."""
    address = f"{url.rstrip('/')}/-/status?window_s={window_s}"
    try:
        with urllib.request.urlopen(address, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        detail = error.read()[:200].decode(errors="replace")
        raise NotARoute(
            f"{address} answered {error.code} ({detail.strip() or error.reason}): "
            f"{url} is not a route"
        ) from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise NotARoute(f"nothing answers at {url}: {reason}") from None
    try:
        status = json.loads(body)
    except ValueError:
        status = None
    if not (
        isinstance(status, dict) and "route" in status and isinstance(status.get("config"), dict)
    ):
        raise NotARoute(f"{address} answered, but not as a router does: {url} is not a route")
    return status


@contextlib.contextmanager
def _quick_mlflow() -> Iterator[None]:
    """MLflow's client retries an unreachable server for minutes: a status says so at once."""
    values = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if saved[k] is None})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)


def registry_view(tracking_uri: str, model_name: str, limit: int = VERDICTS) -> dict[str, Any]:
    """{"aliases": {alias: version or None}, "verdicts": the last `limit` versions with a
    rollout verdict, newest first}; {"error": ...} when MLflow could not tell."""
    from mlflow import MlflowClient

    from prefect_ray_lifecycle.control import registry

    prefix = f"{registry.TAG}.rollout."
    try:
        with _quick_mlflow():
            client = MlflowClient(tracking_uri)
            aliases = {}
            for alias in (registry.CHAMPION, registry.LIVE, registry.CHALLENGER):
                found = registry.resolve_alias(client, model_name, alias)
                aliases[alias] = found.version if found else None
            versions = client.search_model_versions(f"name = '{model_name}'")
    except Exception as error:  # down, or no such model: the route's part still stands
        return {"error": f"MLflow at {tracking_uri}: {type(error).__name__}: {error}"[:400]}
    verdicts = []
    for found in versions:
        tags = found.tags or {}
        if f"{prefix}verdict" not in tags:
            continue
        verdicts.append(
            {
                "version": str(found.version),
                "verdict": tags[f"{prefix}verdict"],
                "stage": tags.get(f"{prefix}stage"),
                "reason": tags.get(f"{prefix}reason"),
                "route": tags.get(f"{prefix}route"),
                "at": tags.get(f"{prefix}at"),
                "flow_run_id": tags.get(f"{prefix}flow_run_id") or None,
            }
        )
    # Newest verdict first; verdicts from before they carried a time, by version.
    verdicts.sort(key=lambda v: (v["at"] or "", int(v["version"])), reverse=True)
    return {"aliases": aliases, "verdicts": verdicts[:limit]}


def _source(target: dict[str, Any] | None) -> dict[str, Any]:
    """{name, tracking_uri} of a target's registered model: a policy's spec, or an LLM's
    app args' MLflow source (targets written by older code carry neither)."""
    model = (target or {}).get("model") or {}
    mlflow = model.get("mlflow") or {}
    if mlflow:
        return {"name": mlflow.get("model_name"), "tracking_uri": mlflow.get("tracking_uri")}
    return {"name": model.get("name"), "tracking_uri": model.get("tracking_uri")}


def model_of(status: dict[str, Any]) -> str | None:
    """The registered model the router's targets name."""
    config = status.get("config") or {}
    for key in ("live", "candidate", "previous"):
        name = _source(config.get(key))["name"]
        if name:
            return str(name)
    return None


def tracking_uri_of(status: dict[str, Any]) -> str | None:
    return _source((status.get("config") or {}).get("live"))["tracking_uri"]


def gather(
    url: str,
    model_name: str | None = None,
    tracking_uri: str | None = None,
    window_s: int = DEFAULT_WINDOW_S,
) -> dict[str, Any]:
    """The route now, as one JSON-ready object (NotARoute when there is no router)."""
    status = route_status(url, window_s)
    config = status["config"]
    model = model_of(status) or model_name or DEFAULT_MODEL
    uri = (
        tracking_uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or tracking_uri_of(status)
        or DEFAULT_MLFLOW
    )
    view = registry_view(uri, model)
    figures = status.get("figures") or {
        "window_s": window_s,
        "versions": {},
        "error": "this router reports no figures (it predates them)",
    }
    return {
        "url": url,
        "route": status["route"],
        "model": model,
        "mlflow_uri": uri,
        "generation": config.get("generation"),
        "live": config.get("live"),
        "candidate": config.get("candidate"),
        "candidate_weight": config.get("candidate_weight", 0.0),
        "candidate_share": status.get("candidate_share", 0.0),
        "previous": config.get("previous"),
        "rollout": config.get("rollout"),
        "lease": status.get("lease"),
        "serving": status.get("serving"),
        "inline_version": status.get("inline_version"),
        "rejected_config": status.get("rejected_config"),
        "shadow": config.get("shadow"),
        "testers": (config.get("testers") or {}).get("mode", "off"),
        "figures": figures,
        "aliases": view.get("aliases", {}),
        "verdicts": view.get("verdicts", []),
        **({"mlflow_error": view["error"]} if "error" in view else {}),
    }


# ---- the terminal view ---------------------------------------------------------------------


def table(headers: list[str], rows: list[list[Any]], right: Collection[int] = ()) -> str:
    """Fixed-width columns; the columns in `right` aligned right (numbers)."""
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(values: list[str]) -> str:
        return "  ".join(
            v.rjust(w) if i in right else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def _ms(value: Any) -> str | None:
    return None if value is None else f"{value:.1f}"


def _target(target: dict[str, Any] | None) -> str:
    if not target:
        return "none"
    return f"v{target['version']}  (app {target['app']}, {target.get('kind', 'policy')})"


def render(now: dict[str, Any]) -> str:
    live, candidate = now["live"], now["candidate"]
    lease = now.get("lease") or {}
    out = [
        f"route /{now['route']}  {now['url']}  model {now['model']}  "
        f"generation {now['generation']}",
        "",
    ]
    hosted = "; hosted in the router" if live and now["inline_version"] == live["version"] else ""
    out.append(f"live       {_target(live)}{hosted}")
    if candidate:
        out.append(
            f"candidate  {_target(candidate)}; weight {now['candidate_weight']:.0%}, "
            f"served {now['candidate_share']:.0%}"
        )
    else:
        out.append("candidate  none")
    if now.get("shadow"):
        shadow = now["shadow"]
        out.append(
            f"shadow     {shadow['share']:.0%} of requests copied to the candidate (at most "
            f"{shadow['max_per_s']:g}/s per router replica)"
            f"{'; and to live again, the noise floor' if shadow.get('noise_floor') else ''}"
        )
    if now["previous"]:
        out.append(f"previous   {_target(now['previous'])} (kept during the bake)")
    rollout = now["rollout"]
    if rollout:
        out.append(
            f"rollout    v{rollout['version']} at {rollout['stage']}, by {rollout['holder']}; "
            f"lease {'held' if lease.get('held') else 'NOT held'}"
            f"{' (lapsed: live only)' if lease.get('lapsed') else ''}"
        )
        if rollout.get("approval"):
            approval = rollout["approval"]
            out.append(
                f"approval   waiting for a person ({approval['point'].replace('_', ' ')}, "
                f"candidate at {approval['weight']:.0%}): python -m deployments.approve "
                f"{rollout['holder']} --approve|--abort --reason ... --name ..."
            )
    else:
        out.append(
            f"rollout    none{'; lease held by ' + lease['holder'] if lease.get('held') else ''}"
        )
    if now["rejected_config"]:
        out.append(f"refused    {now['rejected_config']}")
    aliases = now["aliases"]
    if aliases:
        out.append(
            "aliases    " + ", ".join(f"{a} {'v' + v if v else '-'}" for a, v in aliases.items())
        )

    figures = now["figures"]
    roles = {}
    for role in ("previous", "candidate", "live"):  # live wins where one version is both
        if now[role]:
            roles[now[role]["version"]] = role
    rank = {"live": 0, "candidate": 1, "previous": 2}
    versions = figures.get("versions") or {}
    ordered = sorted(
        versions, key=lambda v: (rank.get(roles.get(v, ""), 3), -int(v) if v.isdigit() else 0)
    )
    out += ["", f"last {figures['window_s']} s, per version"]
    if figures.get("error"):
        out.append(f"  (no figures: {figures['error']})")
    elif not versions:
        out.append("  (no requests)")
    else:
        rows = [
            [
                version,
                roles.get(version, ""),
                f["requests"],
                f["errors"],
                f"{f['error_rate']:.2%}",
                f.get("fallbacks", 0),
                _ms(f.get("p50_ms")),
                _ms(f.get("p99_ms")),
            ]
            for version, f in ((v, versions[v]) for v in ordered)
        ]
        headers = ["version", "role", "requests", "errors", "error rate", "fallbacks"]
        out.append(table([*headers, "p50 ms", "p99 ms"], rows, right={2, 3, 4, 5, 6, 7}))
    out += _shadow_lines(figures.get("shadow") or {})
    testers = figures.get("testers") or {}
    if testers:
        out.append(
            "testers    (X-Canary, not in the gates' figures) "
            + ", ".join(
                f"v{v}: {f['requests']} requests, {f['errors']} errors" for v, f in testers.items()
            )
        )

    out += ["", "last rollout verdicts"]
    if "mlflow_error" in now:
        out.append(f"  (MLflow did not answer: {now['mlflow_error']})")
    elif not now["verdicts"]:
        out.append(f"  (none for {now['model']})")
    else:
        rows = [
            [v["version"], v["verdict"], v["stage"], v["route"], v["at"], _cut(v["reason"], 60)]
            for v in now["verdicts"]
        ]
        out.append(table(["version", "verdict", "stage", "route", "at (UTC)", "reason"], rows))
    return "\n".join(out)


def _share(value: Any) -> str | None:
    return None if value is None else f"{value:.1%}"


def _difference(figures: dict[str, Any]) -> str | None:
    """An LLM's common token prefix share, or a policy's mean total variation distance."""
    if figures.get("token_prefix") is not None:
        return f"prefix {figures['token_prefix']:.1%}"
    return None if figures.get("tvd") is None else f"tvd {figures['tvd']:.3f}"


def _shadow_lines(shadow: dict[str, Any]) -> list[str]:
    """The shadow's comparisons per version: the candidate's against live, and the noise
    floor (live's own app against live)."""
    rows = [
        [
            version,
            "candidate" if role == "candidate" else "noise floor",
            f["copies"],
            f["errors"],
            f["dropped"],
            _share(f["agreement"]),
            _difference(f),
            _ms(f["candidate_p99_ms"]),
            _ms(f["live_p99_ms"]),
        ]
        for role in ("candidate", "noise_floor")
        for version, f in sorted((shadow.get(role) or {}).items())
    ]
    if not rows:
        return []
    headers = ["version", "against live", "copies", "errors", "dropped", "agreement"]
    headers += ["tvd/prefix", "its p99 ms", "live p99 ms"]
    return ["", "shadow", table(headers, rows, right={2, 3, 4, 5, 6, 7, 8})]


def _cut(text: str | None, limit: int) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 3] + "..."


def _window(value: str) -> int:
    if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= MAX_WINDOW_S:
        raise argparse.ArgumentTypeError(f"a whole number of seconds from 1 to {MAX_WINDOW_S}")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.status",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default=DEFAULT_URL, help="the route (default %(default)s)")
    parser.add_argument(
        "--model",
        default=None,
        help=f"the registered model when the router's targets do not name it "
        f"(default {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--mlflow-uri",
        default=None,
        help="MLflow (default: $MLFLOW_TRACKING_URI, else the one the live version was "
        f"loaded from, else {DEFAULT_MLFLOW})",
    )
    parser.add_argument(
        "--window",
        type=_window,
        default=DEFAULT_WINDOW_S,
        help="seconds of figures (default %(default)s, at most 900)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    args = parser.parse_args(argv)
    try:
        now = gather(args.url, args.model, args.mlflow_uri, args.window)
    except NotARoute as error:
        print(f"deployments.status: {error}", file=sys.stderr)
        return NOT_A_ROUTE
    print(json.dumps(now, indent=2) if args.json else render(now))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
