"""`mossvox synth`: synthesise text to an audio file without a server.

By default it goes through the engine (`engine.engine.Engine`: talker and codec worker processes,
the coordinator in this process); `--direct` runs the models in this process without workers.
The file's format is `--format`, else the output's extension (.wav, .mp3, .opus/.ogg, .aac,
.flac, .pcm/.raw): WAV as 32-bit float, the others encoded as the server encodes them, in the
model's own rate and channels.

    mossvox synth "text" [--model DIR] [--ref-audio FILE ...] [--ref-text TEXT] [--language L]
                  [--instructions I] [--seed N] [--format F] [--profile P --set k=v] -o out.wav

Without `--model` (and no `model.path` in the profile) it uses the embedded demo model: a tiny
checkpoint with RANDOM weights, created on first use, whose audio is noise-like. The default
profile here is `cpu`, which forces each request's length from its text (logged).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger("mossvox.synth")

FORMATS = ("wav", "mp3", "opus", "aac", "flac", "pcm")
EXTENSIONS = {".wav": "wav", ".mp3": "mp3", ".opus": "opus", ".ogg": "opus", ".aac": "aac",
              ".flac": "flac", ".pcm": "pcm", ".raw": "pcm"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", help="the text to speak ([pause 1.5s] markers pass through)")
    parser.add_argument("-o", "--out", required=True, type=Path,
                        help="output file; its extension names the format unless --format does")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="audio format of the output file (default: from its extension)")
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint directory; default: the profile's model.path, else the demo model")
    parser.add_argument("--ref-audio", type=Path, action="append", default=None,
                        help="reference clip to clone the voice of; repeat it for several speakers "
                             "(TTSD: [S1], [S2], ... in order)")
    parser.add_argument("--ref-text", default=None,
                        help="transcript of --ref-audio: continue from the clip instead of cloning it "
                             "(several clips: tag it by speaker, '[S1] ... [S2] ...')")
    parser.add_argument("--language", default=None, help="language name written into the prompt, e.g. English")
    parser.add_argument("--instructions", default=None,
                        help="style/voice instructions, where the variant has such a field")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    path = parser.add_mutually_exclusive_group()
    path.add_argument("--engine", dest="direct", action="store_false", default=False,
                      help="run through the engine: talker and codec worker processes (default)")
    path.add_argument("--direct", dest="direct", action="store_true",
                      help="run the models directly in this process, without workers")


def run(args: argparse.Namespace) -> int:
    from profiles.arguments import profile_from_args

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    profile = profile_from_args(args, default="cpu")
    if not args.text.strip():
        print("mossvox: the text to speak is empty", file=sys.stderr)
        return 2
    fmt = args.format or EXTENSIONS.get(args.out.suffix.lower())
    if fmt is None:
        print(f"mossvox: cannot tell the audio format from '{args.out.name}': name a "
              f"{', '.join(sorted(EXTENSIONS))} file or pass --format", file=sys.stderr)
        return 2
    args.format = fmt
    refs: list[Path] = args.ref_audio or []
    if args.ref_text and not refs:
        print("mossvox: --ref-text needs --ref-audio", file=sys.stderr)
        return 2
    for ref in refs:
        if not ref.is_file():
            print(f"mossvox: no such reference file: {ref}", file=sys.stderr)
            return 2
    if args.direct and len(refs) > 1:
        print("mossvox: several --ref-audio clips need the engine path (drop --direct)", file=sys.stderr)
        return 2

    import soundfile as sf
    import torch

    if not args.direct:
        return _run_engine(args, profile)
    from stages.synth_direct import DirectSynthesizer
    from stages.tools.demo_model import resolve_checkpoint

    if profile.talker.torch_threads:
        torch.set_num_threads(profile.talker.torch_threads)
    model_dir, profile = resolve_checkpoint(profile, args.model)
    synth = DirectSynthesizer(model_dir, profile)
    try:
        pcm, stats = synth.synthesize(args.text, ref_audio=refs[0] if refs else None, ref_text=args.ref_text,
                                      language=args.language, instructions=args.instructions, seed=args.seed)
    except sf.LibsndfileError as exc:
        print(f"mossvox: cannot decode {refs[0]}: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a field the variant rejects
        print(f"mossvox: {exc}", file=sys.stderr)
        return 2
    write_audio(args.out, args.format, pcm.T, synth.sample_rate)
    seconds = pcm.shape[1] / synth.sample_rate
    log.info("wrote %s: %.2f s of %d-channel %d Hz audio, %d frames (%s), %.2f s wall, first chunk %.2f s",
             args.out, seconds, pcm.shape[0], synth.sample_rate, stats.frames, stats.finish_reason,
             stats.total_s, stats.first_chunk_s)
    return 0


def _run_engine(args: argparse.Namespace, profile) -> int:
    """`synth` through the offline engine API (`engine.engine.Engine`): same audio, in workers."""
    import asyncio
    import time

    import soundfile as sf

    from engine.engine import Engine
    from speech.job import SpeechJob
    from stages.models.codec.audio_prep import prepare_reference, read_audio

    clips = []
    for ref in args.ref_audio or []:  # decode before starting the engine: a bad file fails fast
        try:
            clips.append(read_audio(ref))
        except sf.LibsndfileError as exc:
            print(f"mossvox: cannot decode {ref}: {exc}", file=sys.stderr)
            return 2

    async def go() -> tuple:
        async with Engine(profile, args.model) as eng:
            codes = []
            for wav, rate in clips:
                prepared = prepare_reference(wav, rate, target_rate=eng.sample_rate,
                                             channels=eng.channels)
                codes.append(await eng.encode_reference(prepared))
            job = SpeechJob(text=args.text, language=args.language,
                            instructions=args.instructions, ref_codes=codes[0] if codes else None,
                            extra_ref_codes=codes[1:], ref_text=args.ref_text or None,
                            sampling={} if args.seed is None else {"seed": args.seed})
            start = time.perf_counter()
            pcm, reason = await eng.synthesize(job)
            return pcm, reason, time.perf_counter() - start, eng.sample_rate

    try:
        pcm, reason, wall, rate = asyncio.run(go())
    except ValueError as exc:  # a field the variant rejects (its request adapter)
        print(f"mossvox: {exc}", file=sys.stderr)
        return 2
    write_audio(args.out, args.format, pcm, rate)
    log.info("wrote %s: %.2f s of %d-channel %d Hz audio (%s) through the engine, %.2f s wall",
             args.out, len(pcm) / rate, pcm.shape[1], rate, reason, wall)
    return 0


def write_audio(path: Path, fmt: str, pcm, sample_rate: int) -> None:
    """Write ``pcm`` ([samples, channels] float32) to ``path`` as ``fmt``, encoded as the server
    encodes a whole file of that format (a WAV holds 16-bit samples, as the server's)."""
    import numpy as np

    from api.audio_encoding import make_encoder

    path.parent.mkdir(parents=True, exist_ok=True)
    pcm = np.asarray(pcm, dtype=np.float32).reshape(len(pcm), -1)
    encoder = make_encoder(fmt, sample_rate, pcm.shape[1], streaming=False)
    path.write_bytes(encoder.encode(pcm) + encoder.finish())
