"""What depth-use will hold in memory beyond the model's weights, worked out before any work, and
the largest batch that fits.

A batch of b windows of t tokens, a model of n layers, width d and a vocabulary of v, 4-byte floats:
- the streams entering every block and the last block's output, and each block's contribution:
  (2n + 1) b t d, in the model's dtype and in float32;
- the output's log-probabilities, b t v, kept for the batch;
- one window's lens row at a time (its logits, log-probabilities and the KL's temporaries): 5 t v;
- with `--tuned-lens`, its training first: a micro-batch's streams, its output's log-probabilities
  and one translator's logits, log-probabilities and their gradients, about (n + 6) m t max(d, v)
  for a micro-batch of m (the streams d-wide, the rest v-wide).

None of it grows with depth x vocabulary: `tests/test_depth_use.py` measures the peak flat in the
layers, and `benchmarks/depth_use/depth_use_memory.py` measures it against this estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthcurse.errors import DepthcurseError
from depthcurse.surgery import num_layers

FLOAT = 4
WINDOW_TEMPORARIES = 5  # a lens row's logits, log-probabilities, and output_kl's exp, difference and product, one window at a time
LENS_COPIES = 6  # the tuned lens's output log-probabilities, a translator's logits, log-probabilities and their gradients (two), the KL's product


@dataclass(frozen=True)
class Shape:
    layers: int
    width: int
    vocab: int
    dtype_bytes: int = FLOAT

    @classmethod
    def of(cls, model) -> "Shape":
        head = model.get_output_embeddings().weight
        return cls(num_layers(model), int(head.shape[1]), int(head.shape[0]), head.element_size())


def measuring_bytes(shape: Shape, batch: int, tokens: int) -> int:
    """The measurement's peak for a batch: the streams, the output's log-probabilities, one window's lens row."""
    streams = (shape.layers + 1) * batch * tokens * shape.width * shape.dtype_bytes + shape.layers * batch * tokens * shape.width * FLOAT
    return streams + batch * tokens * shape.vocab * FLOAT + WINDOW_TEMPORARIES * tokens * shape.vocab * FLOAT


def lens_bytes(shape: Shape, micro_batch: int, tokens: int) -> int:
    """The tuned lens's training peak for a micro-batch (0 without one: a micro-batch of 0)."""
    return micro_batch * tokens * ((shape.layers + 1) * shape.width * shape.dtype_bytes + LENS_COPIES * shape.vocab * FLOAT)


def peak_bytes(shape: Shape, batch: int, tokens: int, lens_micro_batch: int = 0) -> int:
    """Beyond the weights: the larger of the lens's training and the measurement."""
    return max(measuring_bytes(shape, batch, tokens), lens_bytes(shape, lens_micro_batch, tokens))


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_fits(shape: Shape, batch: int, tokens: int, available: int | None, lens_micro_batch: int = 0) -> int:
    """The estimate; one line where it passes `available` (free memory beyond the loaded weights; None:
    unknown), naming the largest --batch-size that fits, or what to shorten where none does."""
    need = peak_bytes(shape, batch, tokens, lens_micro_batch)
    if available is None or need <= available:
        return need
    fits = [b for b in range(batch - 1, 0, -1) if peak_bytes(shape, b, tokens, lens_micro_batch) <= available]
    if fits:
        how = f"--batch-size {fits[0]} fits (about {gib(peak_bytes(shape, fits[0], tokens, lens_micro_batch))})"
    elif lens_bytes(shape, lens_micro_batch, tokens) > available >= measuring_bytes(shape, 1, tokens):
        how = f"the tuned lens's training, {lens_micro_batch} windows a micro-batch, does not fit: shorten --seq-len"
    else:
        how = "no batch fits at this --seq-len: shorten it"
    raise DepthcurseError(f"depth-use would need about {gib(need)} beyond the model's weights at --batch-size {batch} x {tokens} tokens "
                          f"(a {shape.vocab:,}-token vocabulary, {shape.layers} layers of width {shape.width}), and {gib(available)} is free: {how}")


def free_bytes(device) -> int | None:
    """Memory free now on `device`'s kind: the GPU's, or the machine's (None where unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)
