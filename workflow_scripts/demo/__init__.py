"""Generators of the demo's input files (``demo_data/``); no rule runs them.

``python -m workflow_scripts.demo.make_data --out demo_data`` writes every text set (with
``make_classification`` and ``make_corpus``); ``python -m workflow_scripts.demo.make_images --out
demo_data/shapes`` the image set. Each writes the same bytes for the same ``--seed``.
"""
