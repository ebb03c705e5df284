"""The workers are scripts that the tests start as processes, not test modules."""

collect_ignore_glob = ["worker_*.py"]
