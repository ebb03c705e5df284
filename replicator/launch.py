"""``python -m replicator.launch -n 2 [--devices-per-process 4] [--watchdog S] -- python train.py``

Starts N local processes of one job on JAX's distributed runtime (coordinator on 127.0.0.1),
prefixes their output with their rank, and ends them all at the first failure. The same as
``replicator launch``.
"""

from replicator.cli import launch

if __name__ == "__main__":
    raise SystemExit(launch.main())
