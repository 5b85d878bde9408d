"""Benchmark and table scripts. A package so that tests import the architecture table's builder and runner
(``from benchmarks.arch_models import ...``, with the repository root on ``pythonpath``); the scripts themselves run
as ``python benchmarks/<name>.py``."""
