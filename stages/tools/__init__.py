"""Developer tools apart from the runtime: random-weight checkpoints and the embedded demo model."""
