"""The GGUF-packed weight method: llama.cpp Q4_0 / Q8_0 blocks kept packed.

A Q4_0 or Q8_0 block is exactly a GPTQ group of 32 inputs: one fp16 scale and a constant
zero point. So a layer takes the file's raw blocks (`<module>.weight`, uint8 [out, bytes
per row]), cuts out its rank's rows (column-parallel) or whole blocks of its input slice
(row-parallel), and re-packs only that block into the GPTQ/AWQ method's internal layout;
from there the kernels and the CPU path are the packed method's. The GGUF loader decides
when layers get this method (loader/gguf_file.py: CUDA, one packable type for every
linear weight); otherwise the file is dequantized at load into dense layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.model_executor.layers.quantization.gptq_awq import PACKED_TENSORS, PackedMethod
from pagedllm.model_executor.layers.sharding import check_shape, copy_block, read_block
from pagedllm.model_executor.layers.weight_method import piece

if TYPE_CHECKING:
    from pagedllm.model_executor.layers.linear import LinearBase

# GGUF types whose blocks are exactly GPTQ groups of 32 -> bits of the packed values.
PACKABLE_TYPES = {"Q4_0": 4, "Q8_0": 8}
BLOCK_VALUES = 32
# bytes of one block: an fp16 scale and 32 values of 4 or 8 bits
BLOCK_BYTES = {4: 2 + BLOCK_VALUES // 2, 8: 2 + BLOCK_VALUES}


def blocks_to_packed(blocks: np.ndarray, bits: int) -> dict[str, torch.Tensor]:
    """Q4_0 / Q8_0 blocks [out, bytes per row] -> GPTQ v2 `qweight` [in * bits / 32, out],
    `scales` [in / 32, out] and `qzeros` [in / 32, out * bits / 32], exactly.

    Q4_0: value j of a block is the low nibble of byte j (j < 16) or the high nibble of
    byte j - 16, x = d * (nib - 8): the nibble is the GPTQ value and 8 the zero point.
    Q8_0: x = d * q with int8 q: the value is q + 128 and 128 the zero point. d (fp16) is the
    scale as it is, so w = (value - zero) * scale reproduces the dequantized float bit for bit.
    """
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, BLOCK_BYTES[bits])  # [out, groups, block bytes]
    scales = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0]  # [out, groups]
    if bits == 4:
        qs = b[..., 2:]
        vals = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [out, groups, 32], in order
    else:
        vals = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    pack = 32 // bits
    shifts = (np.arange(pack, dtype=np.uint32) * bits).astype(np.uint32)
    words = (vals.reshape(n, -1, pack).astype(np.uint32) << shifts).sum(-1, dtype=np.uint32)  # [out, in/pack]
    zero = 1 << (bits - 1)
    zero_word = np.array(sum(zero << (bits * j) for j in range(pack)), dtype=np.uint32).view(np.int32)
    qzeros = np.full((scales.shape[1], n // pack), zero_word, dtype=np.int32)
    return {
        "qweight": torch.from_numpy(np.ascontiguousarray(words.T).view(np.int32)),
        "scales": torch.from_numpy(np.ascontiguousarray(scales.T)),
        "qzeros": torch.from_numpy(qzeros),
    }


class GGUFPackedMethod(PackedMethod):
    """Loads raw GGUF blocks; stores and computes them as GPTQ v2 groups of 32."""

    accepts_zero_bias = False  # GGUF files carry no stray biases

    def load(self, layer: LinearBase, param_name: str, shard: str | None, tensor) -> None:
        if param_name != "weight":
            raise ValueError(f"checkpoint tensor {param_name!r} has no place in a GGUF-packed layer")
        layout, bits = layer.layout, self.quant.bits
        full, src, n = layout.parts[shard]
        start = layout.shards[shard][0]
        k0, k = layout.in_start, layout.in_features
        per_block, pack = BLOCK_BYTES[bits], self.quant.pack_factor
        what = piece("weight", shard)
        check_shape(what, tensor, (full, layout.full_in // BLOCK_VALUES * per_block))
        cols = slice(k0 // BLOCK_VALUES * per_block, (k0 + k) // BLOCK_VALUES * per_block)
        block = read_block(tensor, slice(src, src + n), cols)
        packed = blocks_to_packed(np.ascontiguousarray(block.numpy()), bits)
        copy_block(piece("qweight", shard), layer.qweight.data[:, start:start + n], packed["qweight"])
        copy_block(piece("scales", shard), layer.scales.data[:, start:start + n], packed["scales"])
        copy_block(piece("qzeros", shard), layer.qzeros.data[:, start // pack:(start + n) // pack], packed["qzeros"])
        self._loaded.update((name, shard) for name in PACKED_TENSORS)

    def missing(self, layer: LinearBase) -> list[str]:
        return [piece("weight", s) for s in layer.layout.shards if ("qweight", s) not in self._loaded]
