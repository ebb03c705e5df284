"""``python -m replicator.cli ...``: the same as the ``replicator`` command."""

from replicator.cli import main

raise SystemExit(main())
