"""Scripts that the tests start as processes, not test modules."""

collect_ignore_glob = ["*.py"]
