"""`release_cached_memory`: the workers release the allocator's cached blocks before recording
graphs, so a capture under the memory plan's cap has the room warm-up left cached (CUDA only)."""

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_capture_under_the_cap_gets_the_room_warm_up_cached():
    """Under a process cap (the memory plan's), blocks the default pool cached while warming up
    are no use to a graph capture's private pool: the capture fails until they are released."""
    from stages.workers.common import release_cached_memory

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    cap = torch.cuda.memory_reserved() + (2 << 30)  # room for 2 GiB more than now
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        warm = torch.empty(3 << 29, dtype=torch.uint8, device="cuda")  # 1.5 GiB cached once freed
        del warm

        def capture():
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = torch.zeros(3 << 29, dtype=torch.uint8, device="cuda")  # 1.5 GiB from the graph's pool
            return g, out

        with pytest.raises(torch.OutOfMemoryError):
            capture()
        release_cached_memory()
        g, out = capture()
        g.replay()
        assert int(out[-1]) == 0
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
