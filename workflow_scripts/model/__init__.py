"""Loading models and adapters, the demo's tiny model, and memory estimates."""
