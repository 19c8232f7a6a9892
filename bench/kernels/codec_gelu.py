"""How far the decoder's tanh GELU (`codec.gelu_epilogue`) moves the codec's audio, beside bf16's
own distance from fp32 (the full-size v2 codec, seeded random weights).

    python -m bench.kernels.codec_gelu [--device cpu] [--frames 8] [--rows 2] [--seeds 3]

Random codes [12 quantizers, rows, frames] decoded whole (from position 0) four ways: fp32 with
the checkpoint's erf GELU (the reference), fp32 with the tanh GELU, bf16 with erf, bf16 with
tanh. Each line: the waveform's distance from the reference as an SNR in dB (10 log10 of the
reference's power over the difference's) and the largest difference over the reference's RMS.
The random weights are not a trained codec: the figures compare the approximation with bf16's
rounding on the same network, not the audible result.
"""

from __future__ import annotations

import argparse

import torch

from bench.codec import random_codec
from stages.models.codec.config import CodecConfig, full_size_v2_config

N_VQ = 12  # the quantizers Local-v1.5 decodes


def _distance(audio: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(SNR dB, max |difference| / reference RMS)."""
    diff = (audio.double() - reference.double())
    power = reference.double().pow(2).mean()
    snr = 10 * torch.log10(power / diff.pow(2).mean().clamp_min(1e-30))
    return float(snr), float(diff.abs().max() / power.sqrt())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=3, help="code draws (the weights stay seed 0)")
    args = ap.parse_args(argv)
    cfg = CodecConfig.from_json(full_size_v2_config())
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = random_codec(cfg, args.device, dtype).eval()
        for seed in range(args.seeds):
            gen = torch.Generator().manual_seed(seed)
            codes = torch.randint(0, cfg.quantizer.codebook_size, (N_VQ, args.rows, args.frames), generator=gen)
            for tanh in (False, True):
                model.use_gelu_epilogue(tanh)
                rows[(dtype, tanh, seed)] = model.decode(codes.to(args.device)).float().cpu()
        del model
    print(f"full-size v2 codec, random weights, {N_VQ} quantizers, {args.rows} rows x {args.frames} frames "
          f"decoded whole, {args.seeds} code draws, on {args.device}: distance from fp32 with erf GELU")
    for dtype, tanh in ((torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True)):
        found = [_distance(rows[(dtype, tanh, s)], rows[(torch.float32, False, s)]) for s in range(args.seeds)]
        snr = sum(f[0] for f in found) / len(found)
        peak = max(f[1] for f in found)
        print(f"  {str(dtype).removeprefix('torch.'):8s} {'tanh' if tanh else 'erf '} GELU: SNR {snr:6.1f} dB "
              f"(mean of draws), largest difference {peak:.4f} x the reference RMS")


if __name__ == "__main__":
    main()
