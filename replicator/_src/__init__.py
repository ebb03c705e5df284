"""Private implementation of replicator. Import names from `replicator`, not from here."""
