"""gpt-oss (transformers' `GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b): the MoE decoder
of moe.py with the switches its ArchSpec sets (attention sinks, a biased router, biased
experts with the clamped SwiGLU; q/k/v/o biases, YaRN and the sliding/full `layer_types`
come from its config), plus the way its checkpoints lay the experts out.

Float checkpoints (what transformers saves) keep transformers' in-memory layout:
`experts.gate_up_proj` [E, H, 2I] whose output columns interleave gate and up (column 2j is
gate row j, 2j + 1 up row j), `experts.gate_up_proj_bias` [E, 2I] interleaved the same way,
`experts.down_proj` [E, I, H] and `experts.down_proj_bias` [E, H].

The published checkpoints quantize the experts' matrices to MXFP4
(`quantization_config: {"quant_method": "mxfp4"}`): `gate_up_proj_blocks` [E, 2I, H/32, 16]
with `gate_up_proj_scales` [E, 2I, H/32], and `down_proj_blocks` [E, H, I/32, 16] with
`down_proj_scales` [E, H, I/32]. Rows are output features (the same interleaving); each
row's inputs come in blocks of 32 values, 16 bytes, byte b holding value 2b in its low
nibble and 2b + 1 in its high nibble, as e2m1 codes; the block's value is code * 2^(scale -
127) (an e8m0 exponent). This is the layout transformers' integrations/mxfp4.py
dequantizes; everything else in those checkpoints is bf16.

On CUDA the experts stay packed as published (`Mxfp4Experts`: a quarter of the bf16 bytes,
so gpt-oss-120b fits one 80 GB card) and the fused MoE kernels dequantize them tile by tile
(layers/fused_moe.py). Elsewhere, and where a tensor-parallel rank's slice of the down
projection's inputs is not whole blocks of 32 (gpt-oss's 2880 over 4 or 8 ranks), they are
dequantized once at load, expert by expert on the model's device, into the model's dtype.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedllm import batch_invariant
from pagedllm.distributed import all_reduce, get_tp_world_size
from pagedllm.model_executor.layers import fused_moe
from pagedllm.model_executor.layers.quantization import QuantConfig
from pagedllm.model_executor.layers.sharding import read_block, shape_of
from pagedllm.model_executor.models.moe import MoeForCausalLM, SparseMoeBlock

logger = logging.getLogger(__name__)

# The e2m1 value of each 4-bit code: sign bit 3, then exponent and mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values sharing one scale
E8M0_BIAS = 127

_EXPERTS = re.compile(r"(.+\.mlp)\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., G, 16] uint8 blocks and [..., G] uint8 scales -> [..., G * 32] values."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # low nibble first
    values = lut[codes.long()]
    exponents = scales.to(torch.int32)[..., None] - E8M0_BIAS
    return torch.ldexp(values, exponents).flatten(-2).to(dtype)


class Mxfp4Experts(SparseMoeBlock):
    """The MoE block with its experts kept in MXFP4 (CUDA: the fused kernels read them):
    w13 [E, 2I, H/2] and w2 [E, H, I/2] bytes, w13_scale [E, 2I, H/32] and w2_scale
    [E, H, I/32] exponents; this rank's rows of gate and up, its columns of down."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        e, hidden, inter = self.num_experts, self.w2.shape[1], self.inter
        for name, rows, cols in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
            setattr(self, name, nn.Parameter(torch.empty(e, rows, cols // 2, dtype=torch.uint8),
                                             requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(torch.empty(e, rows, cols // 32, dtype=torch.uint8),
                                                        requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fused_moe.available(x):
            raise RuntimeError("MXFP4 experts are kept packed on CUDA only")
        weights, ids = self.route(x)
        out = fused_moe.fused_experts(x, self.w13, self.w2, weights, ids, b13=self.b13, b2=self.b2,
                                      swiglu=(self.act.alpha, self.act.limit), w13_scale=self.w13_scale,
                                      w2_scale=self.w2_scale, invariant=batch_invariant.is_enabled())
        return all_reduce(out) if get_tp_world_size() > 1 else out

    def load_packed(self, e: int, proj: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """Expert e's published tensors ([rows, K/32, 16] bytes, [rows, K/32] exponents):
        gate_up's interleaved rows split into this rank's gate and up rows, down's input
        blocks cut to this rank's columns."""
        with torch.no_grad():
            if proj == "down_proj":
                cut = slice(self.start // 32, (self.start + self.inter) // 32)
                self.w2[e].copy_(blocks[:, cut].reshape(blocks.shape[0], -1))
                self.w2_scale[e].copy_(scales[:, cut])
                self._loaded.add((e, "down"))
                return
            rows = slice(self.start, self.start + self.inter)
            for kind, first, off in (("gate", 0, 0), ("up", 1, self.inter)):
                b, sc = blocks[first::2][rows], scales[first::2][rows]
                self.w13[e, off : off + self.inter].copy_(b.reshape(b.shape[0], -1))
                self.w13_scale[e, off : off + self.inter].copy_(sc)
                self._loaded.add((e, kind))

    def fill_random(self, generator: torch.Generator) -> None:
        """Random codes at scale 2^-6 (weights of about 0.03) and zero biases: the dummy
        loader's stand-in for a checkpoint."""
        with torch.no_grad():
            for w in (self.w13, self.w2):
                w.copy_(torch.randint(0, 256, w.shape, generator=generator, device=w.device, dtype=torch.uint8))
            self.w13_scale.fill_(127 - 6)
            self.w2_scale.fill_(127 - 6)
            self.b13.zero_()
            self.b2.zero_()


class GptOssForCausalLM(MoeForCausalLM):
    """Float or MXFP4 experts; the rest of the model is the shared decoder. `quant` (an
    MXFP4 QuantConfig) keeps the experts packed; the loader passes none off CUDA."""

    def __init__(self, config, architecture: str, max_positions: int, backend,
                 quant: QuantConfig | None = None):
        if quant is not None and quant.method != "mxfp4":
            raise ValueError(f"{quant.method} gpt-oss checkpoints are not supported "
                             "(float or MXFP4 experts only)")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported gpt-oss activation {config.hidden_act!r}")
        packed = quant is not None
        rank_inter = config.intermediate_size // get_tp_world_size()
        if packed and (rank_inter % 32 or config.hidden_size % 32):
            logger.info("MXFP4 experts dequantized at load: %d intermediate rows per rank are "
                        "not whole blocks of 32", rank_inter)
            packed = False
        super().__init__(config, architecture, max_positions, backend,
                         block_cls=Mxfp4Experts if packed else SparseMoeBlock)

    def _route_expert_tensors(self, weights: Iterable[tuple[str, torch.Tensor]],
                              blocks: dict[str, SparseMoeBlock]) -> Iterator[tuple[str, torch.Tensor]]:
        """Expert tensors go to their block (a `_blocks` tensor waits for its `_scales`
        and the other way round, read into memory since a lazy slice dies with its file);
        the router becomes the block's gate; the rest goes on to the Llama loader."""
        pending: dict[tuple[str, str, str], torch.Tensor] = {}
        for name, t in weights:
            name = name.replace(".mlp.router.", ".mlp.gate.")
            m = _EXPERTS.match(name)
            if not m or m[1] not in blocks:
                yield name, t
                continue
            block, proj, suffix = blocks[m[1]], m[2], m[3] or ""
            if suffix == "_bias":
                self._load_bias(block, proj, t)
            elif suffix == "":
                if isinstance(block, Mxfp4Experts):
                    raise ValueError(f"{name}: float experts in a checkpoint whose config says mxfp4")
                full = read_block(t)
                for e in range(full.shape[0]):  # [H, 2I] / [I, H]: inputs first
                    self._load_matrix(block, proj, e, full[e].t())
            else:
                pending[(m[1], proj, suffix)] = read_block(t)
                other = (m[1], proj, "_scales" if suffix == "_blocks" else "_blocks")
                if other in pending:
                    packed = pending.pop((m[1], proj, "_blocks"))
                    scales = pending.pop((m[1], proj, "_scales"))
                    self._load_mxfp4(block, proj, packed, scales)
        if pending:
            raise ValueError(f"MXFP4 tensors without their pair: {sorted(pending)[:4]}")

    @staticmethod
    def _load_matrix(block: SparseMoeBlock, proj: str, e: int, w: torch.Tensor) -> None:
        """Expert e's [out, in] matrix: gate_up's interleaved rows split into gate and up."""
        if proj == "down_proj":
            block.load_expert(e, "down", w)
        else:
            block.load_expert(e, "gate", w[0::2])
            block.load_expert(e, "up", w[1::2])

    @staticmethod
    def _load_bias(block: SparseMoeBlock, proj: str, t) -> None:
        full = read_block(t)
        if full.dim() != 2:
            raise ValueError(f"expert {proj} bias: expected [experts, features], got {shape_of(t)}")
        for e in range(full.shape[0]):
            if proj == "down_proj":
                block.load_expert_bias(e, "down", full[e])
            else:
                block.load_expert_bias(e, "gate", full[e, 0::2])
                block.load_expert_bias(e, "up", full[e, 1::2])

    def _load_mxfp4(self, block: SparseMoeBlock, proj: str, packed: torch.Tensor,
                    scales: torch.Tensor) -> None:
        """Dequantize expert by expert (a whole layer at once would need its float copy
        four times over on the device) and load it as a float matrix."""
        if packed.dim() != 4:
            raise ValueError(f"MXFP4 {proj}_blocks: expected [experts, rows, blocks, 16], got "
                             f"{tuple(packed.shape)}")
        if isinstance(block, Mxfp4Experts):
            for e in range(packed.shape[0]):
                block.load_packed(e, proj, packed[e], scales[e])
            return
        dev, dtype = block.w13.device, block.w13.dtype
        for e in range(packed.shape[0]):
            w = dequantize_mxfp4(packed[e].to(dev), scales[e].to(dev), dtype)
            self._load_matrix(block, proj, e, w)
