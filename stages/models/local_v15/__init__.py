"""MOSS-TTS-Local-Transformer-v1.5: config, model, prompt processor, runner, loader."""
