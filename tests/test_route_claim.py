"""A route's claim (tasks.rollout.claim) when its holder died: the next claimant frees the dead
holder's Prefect slot by the lease id the holder recorded, rather than wait for Prefect to
expire it (on the session's Ray head and Prefect server; no Serve app). And how a rollout
that ended tells whether Prefect is there to record it (record.wait_for_prefect)."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import uuid

import httpx
import pytest
import ray
from prefect.client.orchestration import get_client

from prefect_ray_lifecycle.tasks.rollout.claim import ensure_rollout_limit, hold_route
from prefect_ray_lifecycle.workloads.serve.route_state import drop_route_state, route_state

ROUTE = "claim-test"
DEAD_SLOT_S = 3600  # the dead holder's slot would outlive the test many times over


def test_a_dead_holders_slot_is_freed_by_its_lease_id_not_left_to_expire(stack):
    with stack.ray_cluster().connect():
        limit = ensure_rollout_limit(ROUTE)
        actor = route_state(ROUTE)
        dead_slot = claimant = None
        try:
            # A holder that took the slot (for an hour) and the route's lease (for 1 s), then
            # died: it renews neither.
            dead = str(uuid.uuid4())
            with get_client(sync_client=True) as client:
                response = client.increment_concurrency_slots_with_lease(
                    names=[limit], slots=1, mode="concurrency", lease_duration=DEAD_SLOT_S
                )
            dead_slot = uuid.UUID(response.json()["lease_id"])
            granted = ray.get(actor.claim.remote(dead, 1.0, {"slot_lease_id": str(dead_slot)}))
            assert granted["granted"]

            taken: dict = {}

            def take() -> None:
                with hold_route(ROUTE, str(uuid.uuid4()), lease_s=10) as claim:
                    taken["claim"] = claim
                    with get_client(sync_client=True) as client:
                        taken["active"] = client.read_global_concurrency_limit_by_name(
                            limit
                        ).active_slots
                        # The dead holder's lease is gone: Prefect no longer renews it.
                        with pytest.raises(httpx.HTTPStatusError) as gone:
                            client.renew_concurrency_lease(dead_slot, 60)
                        taken["renew_status"] = gone.value.response.status_code

            claimant = threading.Thread(
                target=contextvars.copy_context().run, args=(take,), daemon=True
            )
            claimant.start()
            # Freed, the slot is had within a few polls; left to expire, not for an hour.
            claimant.join(timeout=120)
            assert not claimant.is_alive(), "the claimant still waits for the dead holder's slot"
            assert taken["claim"].took_over == dead
            assert taken["active"] == 1  # the claimant's own slot, the dead one's freed
            assert taken["renew_status"] == 410
            lease = ray.get(actor.lease.remote())
            assert lease["holder"] is None  # the claimant let the route go on its way out
            with get_client(sync_client=True) as client:
                assert client.read_global_concurrency_limit_by_name(limit).active_slots == 0
        finally:
            if dead_slot is not None:  # when it failed: let a waiting claimant end in Ray
                with get_client(sync_client=True) as client, contextlib.suppress(Exception):
                    client.release_concurrency_slots_with_lease(dead_slot)
            if claimant is not None:
                claimant.join(timeout=60)
            drop_route_state(ROUTE)


def test_a_rollout_waits_for_prefect_only_while_nothing_answers(tmp_path):
    """Any answer of the API's host counts (one behind auth says 401); a port where nothing
    listens is waited on until the bound, then reported."""
    import http.server
    import socket

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_ray_lifecycle.tasks.rollout.record import wait_for_prefect

    class Unauthorised(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unauthorised)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead_port = unused.getsockname()[1]  # closed again when the block ends
    try:
        with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{server.server_port}/api"}):
            assert wait_for_prefect(max_s=0) is True
        with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{dead_port}/api"}):
            assert wait_for_prefect(max_s=0) is False
    finally:
        server.shutdown()
