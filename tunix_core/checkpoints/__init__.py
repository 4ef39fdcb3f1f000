"""Checkpoints: Orbax saves with fingerprints (`store`), verified resume on any layout
and device count (`resume`), a saved step exported as a Hugging Face directory
(`export`)."""
