"""Raw records, the normalised dataset, derived-field transforms and token batching."""
