"""What the flow process runs without Prefect: driving Ray Serve, the MLflow registry, the
pure decisions (canary judgement, convergence, promotion) and stopping Ray off the critical
path. Imports nothing from Prefect, so each decision is tested without any service."""
