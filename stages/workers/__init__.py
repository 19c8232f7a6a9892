"""The worker processes: talker, codec, tensor-parallel ranks, and their common start-up."""
