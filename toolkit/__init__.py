"""Process setup, state, the jitted step, the loop, checkpointing, data and metrics."""
