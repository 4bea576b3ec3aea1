"""Comparing variants: paired bootstrap, the fairness guard and plots."""
