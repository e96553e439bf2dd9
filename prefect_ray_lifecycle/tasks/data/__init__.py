"""Prefect tasks of dataset prep: plan, cache, the one Ray Data pipeline, publish."""
