"""Benchmarks (not timed tests): the clients of a running server (`mossvox bench serve`), the
offline engine (`mossvox bench engine`), ipc, the stages alone (codec, talker step), the GPU
measurement script (`device_runs.sh`), and kernel and precision experiments in `bench/kernels/`."""
