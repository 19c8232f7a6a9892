"""`mossvox synth`: synthesise text to a WAV file in this process (no server, no workers).

    mossvox synth "text" [--model DIR] [--ref-audio FILE] [--ref-text TEXT] [--language L]
                  [--instructions I] [--seed N] [--profile P --set k=v] -o out.wav

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", help="the text to speak ([pause 1.5s] markers pass through)")
    parser.add_argument("-o", "--out", required=True, type=Path, help="output WAV file")
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint directory; default: the profile's model.path, else the demo model")
    parser.add_argument("--ref-audio", type=Path, default=None, help="reference clip to clone the voice of")
    parser.add_argument("--ref-text", default=None,
                        help="transcript of --ref-audio: continue from the clip instead of cloning it")
    parser.add_argument("--language", default=None, help="language name written into the prompt, e.g. English")
    parser.add_argument("--instructions", default=None,
                        help="style/voice instructions, where the variant has such a field")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")


def model_dir_for(args: argparse.Namespace, profile) -> Path:
    """--model, else the profile's model.path, else the embedded demo model (created on first use)."""
    if args.model is not None:
        return args.model
    if profile.model.path:
        return Path(profile.model.path).expanduser()
    from stages.demo_model import ensure_demo_model

    return ensure_demo_model(profile.model.demo_cache_dir)


def run(args: argparse.Namespace) -> int:
    from api.commands import profile_from_args

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    profile = profile_from_args(args, default="cpu")
    if args.ref_text and args.ref_audio is None:
        print("mossvox: --ref-text needs --ref-audio", file=sys.stderr)
        return 2
    if args.ref_audio is not None and not args.ref_audio.is_file():
        print(f"mossvox: no such reference file: {args.ref_audio}", file=sys.stderr)
        return 2

    import soundfile as sf
    import torch

    from stages.synth_direct import DirectSynthesizer

    if profile.talker.torch_threads:
        torch.set_num_threads(profile.talker.torch_threads)
    model_dir = model_dir_for(args, profile)
    synth = DirectSynthesizer(model_dir, profile)
    try:
        pcm, stats = synth.synthesize(args.text, ref_audio=args.ref_audio, ref_text=args.ref_text,
                                      language=args.language, instructions=args.instructions, seed=args.seed)
    except sf.LibsndfileError as exc:
        print(f"mossvox: cannot decode {args.ref_audio}: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a field the variant rejects
        print(f"mossvox: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(args.out), pcm.T, synth.sample_rate, subtype="FLOAT", format="WAV")
    seconds = pcm.shape[1] / synth.sample_rate
    log.info("wrote %s: %.2f s of %d-channel %d Hz audio, %d frames (%s), %.2f s wall, first chunk %.2f s",
             args.out, seconds, pcm.shape[0], synth.sample_rate, stats.frames, stats.finish_reason,
             stats.total_s, stats.first_chunk_s)
    return 0
