"""Prefect tasks of a Serve rollout: its settings, the route claim, the gates, the router
writes, what it records, its chart, and the recovery of an interrupted rollout."""
