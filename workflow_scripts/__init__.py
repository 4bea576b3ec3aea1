"""Stages of the LoRA experiment workflow; each stage module has a ``main(argv)`` entry point."""
