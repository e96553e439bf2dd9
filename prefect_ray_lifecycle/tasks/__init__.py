"""Prefect tasks: each wraps one coarse unit of Ray or MLflow work."""
