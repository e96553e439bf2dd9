"""`python -m benchmarks.NAME`: each compares this project against a peer in one run."""
