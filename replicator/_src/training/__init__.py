"""A training run: rp.fit's loop, its log and writers, checkpoints (Orbax), non-finite steps, stop signals, profiles, the run directory's lock."""
