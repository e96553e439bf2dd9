"""Every private Ray or Prefect name the project relies on, one module per upstream package
(ray_internals, prefect_internals), each use saying what it relies on and the version it
was checked against. tests/test_compat.py fails naming the symbol when an upgrade drops one."""
