"""Starting distributed processes and leasing GPUs to concurrent jobs."""
