"""Helpers that only the tests (and the benchmarks) use, kept out of the shipped package.

Importable as `helpers.<module>`: pytest puts `tests/` on `sys.path` (`pythonpath` in
pyproject's pytest config), and `tests/conftest.py` adds it to `PYTHONPATH` so that the
processes the tests start (`ember serve`, worker ranks, Ray actors) import them too.

    helpers.server    `ember serve` as a real subprocess, its request log, SDK datum helpers
    helpers.postgres  a throwaway PostgreSQL server (initdb into a temp directory)
    helpers.ranks     functions and objects the worker-group tests run on ranks (pickled by reference)
    helpers.datums    reproducible random datums and the contract-2 tensor comparison
"""
