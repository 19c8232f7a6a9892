"""The model families, one folder each (local_v15, delay, realtime, codec), and the Qwen3 backbone."""
