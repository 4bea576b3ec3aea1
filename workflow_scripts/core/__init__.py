"""Settings, errors, atomic outputs and manifests: what every stage shares."""
