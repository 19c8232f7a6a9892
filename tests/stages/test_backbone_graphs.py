"""Backbone graphs of the Delay and Realtime runners (`ScheduledRunner.forward_scheduled`): the
split step (decoding rows through per-bucket static inputs, prefill chunks in one eager call or
through prefill-graph buckets) gives the one-call step's rows, on the CPU through the graph
path's eager mode."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from speech.sampling import SamplingParams
from stages.models.delay.runner import DelayRunner
from stages.models.realtime.processor import RealtimeProcessor
from stages.models.realtime.runner import RealtimeRunner
from stages.runtime.attention.backends import PaddedBatchAttention, ReferenceAttention
from tests.stages.runner_drive import drive
from tests.conftest import golden_dir

DELAY, REALTIME = golden_dir("moss_tts_delay"), golden_dir("moss_tts_realtime")
GREEDY = SamplingParams(greedy=True, temperature=0.0, text_temperature=0.0, max_new_frames=1000)


def golden(folder: Path, name: str) -> dict[str, np.ndarray]:
    with np.load(folder / f"case_{name}.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("name", ["plain", "voice_clone", "continuation"])
def test_delay_greedy_rows_equal_upstream_through_graph_buckets(name):
    g = golden(DELAY, name)
    runner = DelayRunner.from_dir(DELAY, max_running=4, num_kv_blocks=64, finish_on_audio_end=False,
                                  graph_path="eager")
    runner.add(7, g["input_ids"], GREEDY)
    for _ in range(48):
        runner.step()
    np.testing.assert_array_equal(runner.rows(7)[-48:], g["generated_rows"])
    assert {b for b, _ in runner._backbone_graphs.keys} == {1}  # its decode rows went through buckets


def test_delay_sampled_requests_arriving_mid_decode_equal_the_one_call_runner():
    """Requests join while others decode (prefill chunks and decode rows in one step), padded to
    buckets of 4 with three running: the same frames as the one-call step with the same kernel."""
    prompts = [golden(DELAY, n)["input_ids"] for n in ("plain", "voice_clone", "continuation")]
    params = [SamplingParams(temperature=1.0, top_k=20, top_p=0.9, repetition_penalty=1.2, text_temperature=1.0,
                             seed=s, forced_frames=f) for s, f in ((3, 6), (4, 4), (5, 5))]
    arrivals = {0: [(1, prompts[0], params[0])], 5: [(2, prompts[1], params[1])], 9: [(3, prompts[2], params[2])]}

    def run(graph_path):
        runner = DelayRunner.from_dir(DELAY, max_running=4, num_kv_blocks=64, prefill_chunk_tokens=24,
                                      attention=PaddedBatchAttention(), graph_path=graph_path)
        return drive(runner, arrivals), runner

    plain, _ = run("off")
    graphed, runner = run("eager")
    assert {b for b, _ in runner._backbone_graphs.keys} >= {1, 2, 4}
    for rid in plain:
        assert len(plain[rid]) > 0
        np.testing.assert_array_equal(graphed[rid], plain[rid])


@pytest.mark.parametrize("family", ["delay", "realtime"])
def test_prefill_graph_buckets_give_the_one_call_runners_frames(family):
    """With prefill graphs the prompt chunks of a step (new requests beside decoding ones, long
    prompts over several chunks) go through token buckets; the frames do not change, and the
    warm-up's capture makes every bucket ahead."""
    if family == "delay":
        prompts = [golden(DELAY, n)["input_ids"] for n in ("plain", "voice_clone", "continuation")]
        make = lambda **kw: DelayRunner.from_dir(DELAY, **kw)  # noqa: E731
        params = [SamplingParams(temperature=1.0, top_k=20, text_temperature=1.0, seed=s, forced_frames=5)
                  for s in (3, 4, 5)]
    else:
        text = json.loads((REALTIME / "cases.json").read_text())["text"]
        processor = RealtimeProcessor.from_dir(REALTIME)
        ref = golden(REALTIME, "voice_clone")["reference_audio_codes"]
        prompts = [processor.build_prompt(text), processor.build_prompt("Short one.", reference=ref),
                   processor.build_prompt(text, reference=ref)]
        make = lambda **kw: RealtimeRunner.from_dir(REALTIME, **kw)  # noqa: E731
        params = [SamplingParams(temperature=0.8, top_k=30, seed=s, forced_frames=6) for s in (3, 4, 5)]
    arrivals = {0: [(1, prompts[0], params[0])], 3: [(2, prompts[1], params[1]), (3, prompts[2], params[2])]}
    kw = dict(max_running=4, num_kv_blocks=64, prefill_chunk_tokens=24, max_prefill_tokens_per_step=40,
              attention=PaddedBatchAttention())
    plain = drive(make(graph_path="off", **kw), arrivals)
    runner = make(graph_path="eager", prefill_graphs=True, **kw)
    graphed = drive(runner, arrivals)
    assert runner.prefill_graphs is not None and len(runner.prefill_graphs.keys) >= 2
    for rid in plain:
        assert len(plain[rid]) > 0
        np.testing.assert_array_equal(graphed[rid], plain[rid], err_msg=str(rid))
    assert runner.capture_prefill_graphs(60.0) > 0 and runner.capture_prefill_graphs(60.0) == 0
    assert make(graph_path="off", prefill_graphs=True, **kw).capture_prefill_graphs(60.0) == 0  # no graph path


def test_delay_preemption_under_graphs_resumes_exactly():
    """A pool too small for both: the newer request is preempted and recomputed; its frames are
    those it yields alone."""
    prompts = {1: golden(DELAY, "plain")["input_ids"], 2: golden(DELAY, "voice_clone")["input_ids"]}
    params = {rid: SamplingParams(temperature=1.0, top_k=20, top_p=0.95, text_temperature=1.0, seed=rid,
                                  forced_frames=6) for rid in prompts}

    def run(rids, blocks):
        runner = DelayRunner.from_dir(DELAY, max_running=2, num_kv_blocks=blocks, graph_path="eager")
        out = drive(runner, {0: [(rid, prompts[rid], params[rid]) for rid in rids]})
        return out, runner.preemptions

    together, preemptions = run([1, 2], blocks=13)
    assert preemptions > 0
    for rid in prompts:
        alone, _ = run([rid], blocks=64)
        np.testing.assert_array_equal(together[rid], alone[rid])


@pytest.mark.parametrize("name", ["plain", "voice_clone"])
def test_realtime_greedy_frames_equal_upstream_through_graph_buckets(name):
    g = golden(REALTIME, name)
    text = json.loads((REALTIME / "cases.json").read_text())["text"]
    prompt = RealtimeProcessor.from_dir(REALTIME).build_prompt(text, reference=g.get("reference_audio_codes"))
    runner = RealtimeRunner.from_dir(REALTIME, max_running=4, num_kv_blocks=64, graph_path="eager",
                                     upstream_sampling=True)  # upstream draws any id
    frames = drive(runner, {0: [(1, prompt, SamplingParams(greedy=True, temperature=0.0, max_new_frames=13))]})
    np.testing.assert_array_equal(frames[1], g["generated_frames"])


def test_graphs_refuse_the_reference_attention_and_a_cpu_capture():
    with pytest.raises(ValueError, match="ReferenceAttention"):
        DelayRunner.from_dir(DELAY, max_running=2, num_kv_blocks=16, graph_path="eager",
                             attention=ReferenceAttention())
    runner = DelayRunner.from_dir(DELAY, max_running=2, num_kv_blocks=16, graph_path="cuda")  # CPU model
    assert runner.backbone_graph_path == "eager"  # capture needs CUDA: the same bodies run eagerly
    assert DelayRunner.from_dir(DELAY, max_running=2, num_kv_blocks=16, cuda_graphs=True).backbone_graph_path == "off"


def test_padding_rows_write_only_the_scratch_block():
    """Three decoding requests in a bucket of four: the KV blocks of the requests hold the same
    values as after the one-call step, and the padding row wrote only the scratch block."""
    g = golden(DELAY, "plain")

    def run(graph_path):
        runner = DelayRunner.from_dir(DELAY, max_running=4, num_kv_blocks=32, attention=PaddedBatchAttention(),
                                      graph_path=graph_path)
        for rid in (1, 2, 3):
            runner.add(rid, g["input_ids"], SamplingParams(seed=rid, forced_frames=4, max_new_frames=50))
        for _ in range(3):
            runner.step()
        return runner

    plain, graphed = run("off"), run("eager")
    assert [b for b, _ in graphed._backbone_graphs.keys] == [4]  # three requests, padded to four
    for rid in (1, 2, 3):
        for table in (plain.cache.block_table(rid), graphed.cache.block_table(rid)):
            assert table  # the request holds blocks
        for pools in ("keys", "values"):
            for a, b in zip(getattr(plain.cache, pools), getattr(graphed.cache, pools)):
                torch.testing.assert_close(b[graphed.cache.block_table(rid)], a[plain.cache.block_table(rid)],
                                           rtol=0, atol=1e-5)
    scratch = graphed._graph_block
    assert scratch not in {b for rid in (1, 2, 3) for b in graphed.cache.block_table(rid)}


def test_delay_decode_graphs_of_one_table_width_made_ahead():
    """With one block-table width (an attention that reads a table only as far as its sequence's
    length), one backbone graph per batch bucket: made after a warm-up step, it is every graph
    the later requests need, and their frames are the one-call step's."""
    prompts = [golden(DELAY, n)["input_ids"] for n in ("plain", "voice_clone", "continuation")]
    params = [SamplingParams(temperature=1.0, top_k=20, top_p=0.9, text_temperature=1.0, seed=s, forced_frames=5)
              for s in (3, 4, 5)]
    arrivals = {0: [(1, prompts[0], params[0])], 4: [(2, prompts[1], params[1]), (3, prompts[2], params[2])]}

    def runner(graph_path):
        return DelayRunner.from_dir(DELAY, max_running=4, num_kv_blocks=64, prefill_chunk_tokens=24,
                                    attention=PaddedBatchAttention(), graph_path=graph_path)

    plain = drive(runner("off"), arrivals)
    graphed = runner("eager")
    graphed.graph_table_width = lambda: 32
    assert graphed.capture_decode_graphs(60.0) == 0  # no decode step yet: no graph set
    drive(graphed, {0: [(9, prompts[0], SamplingParams(greedy=True, forced_frames=2))]})
    made = graphed.capture_decode_graphs(60.0)
    before = set(graphed._backbone_graphs.keys)
    assert made == 2 and before == {(1, 32), (2, 32), (4, 32)}  # (1, 32) made by the warm-up step
    assert graphed.capture_decode_graphs(60.0) == 0
    got = drive(graphed, arrivals)
    assert set(graphed._backbone_graphs.keys) == before
    for rid in plain:
        np.testing.assert_array_equal(got[rid], plain[rid])
    assert runner("eager").capture_decode_graphs(60.0) == 0  # bucketed widths: nothing ahead
