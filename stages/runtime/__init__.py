"""What every model shares: scheduling, KV cache, attention, sampling, graphs, chunking, loading."""
