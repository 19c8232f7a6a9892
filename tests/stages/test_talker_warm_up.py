"""The talker worker's warm-up: besides one request and two together, a serving-size batch is
prefilled together (several prompts of a few hundred rows in one step, as under load, so their
kernels are compiled before `/ready`; the prefix cache skips only the template rows they share),
then a wide batch of those prompts again (their cached blocks taken, more chunks in one step
than a prefill-graph replay holds: the eager call's kernels compiled too), and the warm-up leaves
the runner empty: every request removed, every KV block back."""

import pytest

from profiles import load_profile
from stages.registry import load_variant
from stages.workers.talker import WARM_SERVING_REQUESTS, serving_size_request, warm_up
from tests.conftest import golden_dir


@pytest.fixture(scope="module")
def variant():
    codec = golden_dir("moss_audio_tokenizer_v2")
    profile = load_profile("cpu", [f"model.codec_path={codec}", "talker.max_running=16",
                                   "talker.prefill_graph_seqs=4"])
    return load_variant(golden_dir("moss_tts_local_v1_5"), profile)


def test_serving_size_request_is_shaped_like_a_served_one(variant):
    plain = variant.build_request(variant.warm_up_job())
    serving = serving_size_request(variant)
    assert len(serving.prompt) > len(plain.prompt) + 60  # the reference frames and the longer text
    assert serving.sampling.forced_frames == 4


def test_warm_up_prefills_a_serving_batch_together_and_leaves_the_runner_empty(variant, caplog):
    caplog.set_level("INFO", logger="stages.workers.talker")
    runner = variant.make_talker_runner("cpu")
    free = runner.cache.num_free_blocks
    steps = []  # the scheduler's batches: (request, rows fed) per step
    schedule = runner.scheduler.schedule
    runner.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    warm_up(runner, variant)
    serving_rows = min(len(serving_size_request(variant, i).prompt) for i in range(WARM_SERVING_REQUESTS))
    serving, wide = range(-10 - WARM_SERVING_REQUESTS + 1, -9), range(-10**6, -99)
    together = max(sum(1 for r, n in batch if r.rid in serving and n > 1) for batch in steps)
    assert together >= 3  # several serving-size prompts prefilled in one step
    fed = sum(n for batch in steps for r, n in batch if r.rid in serving)
    assert fed >= WARM_SERVING_REQUESTS * serving_rows * 0.5  # mostly computed: they share the template only
    # the wide batch: more prompt chunks in one step than a prefill-graph replay takes (4 here),
    # each the few rows past its prompt's cached blocks
    chunks = max(sum(1 for r, n in batch if r.rid in wide and n > 1) for batch in steps)
    assert chunks > runner.prefill_graph_seqs == 4
    wide_fed = sum(n for batch in steps for r, n in batch if r.rid in wide)
    assert runner.scheduler.cached_tokens > 3 * wide_fed
    assert runner.num_running() == 0 and runner.cache.num_free_blocks == free
    # each warm-up batch's start-up time, in the log as it ends (where a slow start goes)
    lines = [r.getMessage() for r in caplog.records if "warm-up batch" in r.getMessage()]
    assert [line.split(" (")[0] for line in lines] == [f"talker: warm-up batch {i} of 4" for i in range(1, 5)]
    assert [line.split("(")[1].split(":")[0] for line in lines] == ["alone", "two", "serving", "wide"]
    assert all(line.endswith(" s") for line in lines)  # nothing compiles on the CPU


@pytest.mark.parametrize("name", ["delay", "ttsd", "sound-effect", "voice-generator", "realtime"])
def test_every_family_builds_its_serving_size_request(tmp_path, name):
    """Each family's rules accept the serving-size warm-up request (TTSD wants a transcript with
    its reference; SoundEffect takes none), and the reference is in it where the family takes one."""
    from stages.tools.make_checkpoint import make_checkpoint

    make_checkpoint(tmp_path / name, variant=name, size="tiny", seed=4)
    family = load_variant(tmp_path / name, load_profile("cpu"))
    plain = family.build_request(family.warm_up_job())
    serving = serving_size_request(family)
    assert len(serving.prompt) > len(plain.prompt)
    if "reference" in family.used_fields:
        assert len(serving.prompt) > len(plain.prompt) + 60
