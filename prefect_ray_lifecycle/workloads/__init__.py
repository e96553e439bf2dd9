"""Code that runs inside Ray: Serve deployments, RLlib builders, Ray Data transforms.

Imports nothing from Prefect, so it ships to any cluster and loads in a Serve replica.
"""
