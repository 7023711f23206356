"""The run folder. Claimed by one run at a time, its checkpoints, and resuming from them."""
