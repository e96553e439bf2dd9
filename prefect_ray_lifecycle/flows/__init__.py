"""Prefect flows: thin stories of task calls and decisions."""
