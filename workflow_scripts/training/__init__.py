"""One training step shared by the gate and training: setup, checks, checkpoints, logs, processes."""
