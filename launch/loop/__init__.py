"""The one training loop and what it holds: the run folder, the schedule and stop rule, signals, the checkpointer,
the runtime, the objects a run is built of, and what it reports."""
