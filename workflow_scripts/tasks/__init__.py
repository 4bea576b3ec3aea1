"""What differs by kind of experiment: templates, answer extraction and metrics."""
