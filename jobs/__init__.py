"""Entry points: one module per job, runnable as ``python -m jobs.<name>`` or ``python jobs/<name>.py``."""
