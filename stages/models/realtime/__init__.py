"""The MOSS-TTS-Realtime talker: Qwen3 backbone + 16-codebook local depth transformer."""
