"""The residual LFQ quantizer's encode against upstream's formula written out (every stage's
distances recomputed from its codebook, negated, the largest taken): the same codes to the bit
with rows of several lengths; and the normalised codebook it keeps between encodes follows the
weights when they change."""

import torch
import torch.nn.functional as F

from stages.models.codec.config import QuantizerConfig
from stages.models.codec.quantizer import ResidualLFQ


def upstream_codes(q: ResidualLFQ, z: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """codes [nq, B, T] as upstream computes them."""
    residual = q.input_proj(z.float()).float()
    valid = (torch.arange(residual.shape[-1])[None, :] < lengths[:, None])[:, None]
    out = []
    for stage in q.quantizers:
        masked = residual * valid
        z_e = stage.in_proj(masked)
        enc = F.normalize(z_e.transpose(1, 2).reshape(-1, z_e.shape[1]))
        book = F.normalize(stage.codebook.weight.float())
        dist = enc.pow(2).sum(1, keepdim=True) - 2 * enc @ book.t() + book.pow(2).sum(1, keepdim=True).t()
        codes = (-dist).max(1)[1].view(z.shape[0], -1)
        chosen = stage.codebook(codes).transpose(1, 2).float()
        residual = residual - stage.out_proj(z_e + (chosen - z_e)) * valid
        out.append(codes)
    return torch.stack(out)


def quantizer(seed: int) -> ResidualLFQ:
    torch.manual_seed(seed)
    q = ResidualLFQ(QuantizerConfig(input_dim=64, rvq_dim=48, output_dim=64, num_quantizers=8,
                                    codebook_size=256, codebook_dim=8))
    with torch.no_grad():
        for p in q.parameters():
            p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
    return q


@torch.no_grad()
def test_codes_are_upstreams_to_the_bit_with_rows_of_several_lengths():
    q = quantizer(0)
    torch.manual_seed(1)
    z, lengths = torch.randn(6, 64, 40), torch.tensor([40, 33, 1, 40, 17, 28])
    for _ in range(2):  # the first encode makes the kept codebook, the second reuses it
        assert torch.equal(q.encode(z, lengths), upstream_codes(q, z, lengths))


@torch.no_grad()
def test_the_kept_codebook_follows_new_weights():
    q, other = quantizer(0), quantizer(5)
    torch.manual_seed(2)
    z, lengths = torch.randn(3, 64, 24), torch.tensor([24, 24, 10])
    before = q.encode(z, lengths)
    q.load_state_dict(other.state_dict())  # copied in place: the same storage, a new version
    after = q.encode(z, lengths)
    assert torch.equal(after, upstream_codes(other, z, lengths)) and not torch.equal(after, before)


def test_weights_made_in_inference_mode_are_served_too():
    """Inference tensors keep no version counter: the kept codebook is made all the same."""
    with torch.inference_mode():
        q = quantizer(0)
        z, lengths = torch.randn(2, 64, 9), torch.tensor([9, 4])
        assert torch.equal(q.encode(z, lengths), upstream_codes(q, z, lengths))
