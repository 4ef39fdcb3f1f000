"""Command lines above every library floor: `train` is `trainer.py`'s (flags -> config ->
`run.loop.train` or `aot.compile.compile_only`, failures as one line and a status)."""
