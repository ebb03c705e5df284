"""Parallel layers: rp.attention (ring and all-to-all attention over `context`) and rp.moe (routing, experts over `expert`)."""
