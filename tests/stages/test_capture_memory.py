"""Graph recording under the memory plan's cap (`graph_capture.record`, CUDA only): a recording's
warm-up leaves its blocks cached for its side stream, which the capture's private pool cannot use
and, while recording, cannot free; `record` releases them first, so the capture has the room."""

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_recording_under_the_cap_gets_the_room_its_warm_up_cached():
    """A body needing 1.5 GiB recorded with 2 GiB of room under the cap, after warm-up left 1.5 GiB
    cached on the default stream: the side-stream warm-up gets its room by the allocator's own
    release, the capture only because `record` releases the warm-up's blocks."""
    from stages.runtime.graph_capture import record

    device = torch.device("cuda")
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info()
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (2 << 30)) / total)
    try:
        warm = torch.empty(3 << 29, dtype=torch.uint8, device=device)  # 1.5 GiB cached once freed
        del warm
        ones = torch.ones(1, dtype=torch.uint8, device=device)

        def body():
            big = ones.expand(3 << 29) + 0  # [1.5 Gi] uint8 from the graph's pool
            return (big[-1:].to(torch.int64),)

        out = torch.zeros(1, dtype=torch.int64, device=device)
        graph = record(body, (out,), torch.cuda.graph_pool_handle(), device)
        out.zero_()
        graph.replay()
        assert out.item() == 1
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
