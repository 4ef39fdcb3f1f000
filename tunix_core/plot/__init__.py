"""A run's curves as PNG files: `python -m tunix_core.plot RUN_DIR [--out DIR]`
(`plot.curves`)."""
