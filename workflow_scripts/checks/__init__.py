"""Parse-time checks of the config that ask the task types, the fairness guard and the data transforms (layer 2)."""
