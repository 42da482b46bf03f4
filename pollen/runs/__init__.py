"""A run on the server beyond the strategy: the global model's evaluation,
the recorder (history, console, learning-rate schedule, notifications), the
run directory and its checkpoints."""
