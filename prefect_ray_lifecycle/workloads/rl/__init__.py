"""RLlib: environments, algorithm configs, evaluation, and the MLflow pyfunc of a policy."""
