"""Benchmarks (never timed tests): ``python -m bench NAME`` runs one, ``python -m bench`` all.

Each benchmark is a module here with ``main(argv) -> int``, registered by name in
``bench/__main__.py``. Results are written under ``bench/results/`` (gitignored).
"""
