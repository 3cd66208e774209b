"""Benchmarks of sglang-supervisor, measured side by side with supervisord in one run.

``python -m bench`` (or ``make bench``) runs every measurement on the simulator, writes
``bench/results.json`` and renders the table between the ``bench`` markers in README.md.
``python -m bench --quick`` is the CI smoke size (no timing claims are made from it).
"""
