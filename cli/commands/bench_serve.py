"""`mossvox bench serve`: closed-loop streaming clients against a running server.

    mossvox bench serve --url http://127.0.0.1:8000 --concurrency 1,16,64 \
        [--dataset auto | synthetic-en1088 | synthetic-sound-effect | synthetic-voice-design | PATH] \
        [--num-prompts N] [--voices new|known] [--client-procs P|auto] [--out results.json]

Every pass sends each reference clip as a voice new to the server unless ``--voices known``
(`bench.voices`). Prints the forcing rule and a table of runs (one per concurrency), and the request fields the
server said it ignored; exit status 1 when any request of any run (warm-up included) failed, 2
when the dataset or server cannot be used. The default prompt set, ``auto``, is the one in the
served model's own fields (`bench.prompt_sets`). Clients: `bench.client`; prompt sets:
`bench.dataset`, `bench.text_prompts`; figures: `bench.report`.
"""

from __future__ import annotations

import argparse
import sys


def _client_procs(value: str) -> int | None:
    """``auto`` (None: ceil(C / 32) per concurrency) or a number >= 1."""
    if value.strip().lower() == "auto":
        return None
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"--client-procs must be >= 1 or auto, got {number}")
    return number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.levels import add_concurrency_option

    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    add_concurrency_option(parser, [1], "closed-loop clients")
    parser.add_argument("--dataset", default="auto", metavar="NAME|PATH",
                        help="a Seed-TTS-format directory (<root>/en/meta.lst) or a synthetic set: "
                             "synthetic-en1088 (clips and transcripts), synthetic-sound-effect, "
                             "synthetic-voice-design; auto (default): the set in the served model's "
                             "own fields (sound descriptions for MOSS-SoundEffect, voice descriptions "
                             "for MOSS-VoiceGenerator, synthetic-en1088 otherwise)")
    parser.add_argument("--num-prompts", type=int, default=None, metavar="N",
                        help="prompts per pass, in a seeded order (default: the whole dataset)")
    parser.add_argument("--seed", type=int, default=0, help="prompt order and per-request sampling seeds")
    parser.add_argument("--text-shift", type=int, default=0, metavar="K",
                        help="prompt i keeps its voice and speaks the text of prompt i + K (after a pass "
                             "with K = 0 and N prompts, K >= N: known voices, new texts)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--model", default=None, help="model name to request (default: the first served)")
    parser.add_argument("--voices", choices=("new", "known"), default="new",
                        help="new (default): every pass sends each reference clip as a recording "
                             "the server has never heard (the same voice, starting a little later, "
                             "at another gain), so no cache the server keeps can help; known: the "
                             "clips as they are (after the warm-up pass, voices the server knows)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="run a full discarded pass before each measured one (default on; with "
                             "--voices new it sends other new voices than the measured pass)")
    parser.add_argument("--frames-per-char", type=float, default=0.87,
                        help="forced length per input character for random weights; 0 = send none")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="cap of the forced length")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    parser.add_argument("--cache-dir", default="~/.cache/mossvox/bench",
                        help="where synthetic-en1088's clips are generated once")
    parser.add_argument("--out", default=None, metavar="FILE", help="write the JSON results here")
    parser.add_argument("--client-procs", type=_client_procs, default=None, metavar="P|auto",
                        help="spread the C clients over P processes, so that the client is not the "
                             "limit (default auto: ceil(C / 32); 1 = one process)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import datetime

    import httpx

    from bench.client import ClientConfig, ForcedLength, run_sweep, server_info
    from bench.levels import levels_of
    from bench.dataset import DatasetError, describe, digest, select_prompts
    from bench.prompt_sets import load_dataset
    from bench.report import format_table, write_json

    concurrencies = levels_of(args)
    forced = ForcedLength(args.frames_per_char, args.max_new_tokens) if args.frames_per_char > 0 else None
    config = ClientConfig(args.url.rstrip("/"), args.model, args.api_key, args.seed, forced, args.timeout)
    try:
        info = asyncio.run(server_info(config))
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        print(f"mossvox bench serve: cannot use {config.url}: {exc}", file=sys.stderr)
        return 2
    try:
        dataset = load_dataset(args.dataset, args.cache_dir, model=info.root or info.model)
    except (ValueError, DatasetError) as exc:
        print(f"mossvox bench serve: {exc}", file=sys.stderr)
        return 2
    prompts = select_prompts(dataset.prompts, args.num_prompts, args.seed, args.text_shift)
    dataset.prepare(prompts)
    rule = forced.describe() if forced else "none (the model stops by itself)"
    family = f" ({info.root})" if info.root and info.root != info.model else ""
    print(f"server {config.url}: model {info.model}{family}, {info.sample_rate} Hz x {info.channels} ch s16 PCM")
    stats = describe(prompts)
    print(f"dataset {dataset.name}: {stats['prompts']} prompts, {stats['distinct_clips']} distinct "
          f"reference clips, input text {stats['target_chars_mean']} chars on average")
    print(f"forced length: {rule}")
    print(f"warm-up pass: {'yes, discarded' if args.warmup else 'no'}")
    print("voices: " + ("new to the server in every pass" if args.voices == "new" else
                        "the clips as they are" + (" (known from the warm-up pass)" if args.warmup else "")))
    runs = asyncio.run(run_sweep(prompts, config, concurrencies, warmup=args.warmup, info=info,
                                 progress=None if args.no_progress else sys.stderr,
                                 client_procs=args.client_procs, voices=args.voices))
    failed = any(r["failed"] for r in runs) or len(runs) < len(concurrencies)
    print(format_table(runs))
    for r in runs:
        if r["ignored_fields"]:
            counts = ", ".join(f"{name} ({n} of {r['num_requests']} requests)"
                               for name, n in r["ignored_fields"].items())
            print(f"C={r['concurrency']}: the server ignored {counts}: the model does not use them")
        for line in (r["warmup"] or {}).get("errors", []) + r["errors"]:
            print(f"C={r['concurrency']} failed request: {line}")
    if len(runs) < len(concurrencies):
        print(f"stopped after the failed run at C={runs[-1]['concurrency']}")
    print("RESULT: FAILED" if failed else "RESULT: ok (every request returned non-empty audio)")
    if args.out:
        write_json(args.out, {
            "tool": "mossvox bench serve",
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "url": config.url, "model": info.model, "root": info.root, "sample_rate": info.sample_rate,
            "channels": info.channels, "dataset": {"name": dataset.name, "digest": digest(prompts), **stats},
            "seed": args.seed, "text_shift": args.text_shift, "warmup": args.warmup, "voices": args.voices,
            "forced_length": rule, "failed": failed,
            "client_procs": "auto" if args.client_procs is None else args.client_procs,
            "concurrencies": concurrencies, "runs": runs,
        })
    return 1 if failed else 0
