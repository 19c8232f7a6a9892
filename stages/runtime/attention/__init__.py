"""Attention over the paged KV cache: the batch packing, the backends, and the Triton kernel."""
