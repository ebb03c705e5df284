"""Processes: jax.distributed's initialisation and heartbeat, and rp.distributed.launch (rounds of processes, restarts, resizing)."""
