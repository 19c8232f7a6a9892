"""Kernel and precision experiments: one GPU operation or one numeric choice alone, away from the
server. Each is `python -m bench.kernels.NAME` and answers one question:

- `codec_gelu`: how far the decoder's tanh GELU (`codec.gelu_epilogue`) moves the codec's audio.
- `codec_ring`: the codec's streaming attention per decoder stage, copy-and-mask against in place.
- `fp8_cublas`: cuBLAS's float8 matmuls at a decode step's rows, by scales and operand order.
- `fp8_fidelity`: how far float8 weights move the Local-v1.5 talker's outputs from fp32.
- `fp8_kernels`: the float8 layer's own kernels (SwiGLU, scales, norms) by warps.
- `fp8_matmul`: the talker's matmuls from float8 weights against bf16, shape by shape.
- `local_attend`: the local attention kernel against the plain compiled attention.
- `paged_attention`: the talker's paged decode attention, by cache dtype and tile.
- `sampling`: the sampler before candidate filtering (a reference for the tests) and a timing of
  `sample_tokens`.
- `timing`: the shared helper that times one GPU operation from CUDA graphs.
"""
