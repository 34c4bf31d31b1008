"""The named benchmark workloads and the random-token dataset they draw from.

Prompts are random token ids (seed 0 by default) so that every backend, every machine and
every run sees the very same requests; lengths are drawn uniformly from a closed range.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np

# Architecture shapes of the GPU workloads, written as config.json for load_format="dummy"
# (random weights: only shapes decide speed). Values follow the public model cards.
LLAMA2_7B_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

QWEN3_0_6B_CONFIG: dict = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}

QWEN3_30B_A3B_CONFIG: dict = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}

# DeepSeek-V2-Lite (15.7B total, 2.4B active): multi-head latent attention, whose pages hold
# a 576-value latent a token a layer, and 64 routed experts (6 a token) + 2 shared.
DEEPSEEK_V2_LITE_CONFIG: dict = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "vocab_size": 102400,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "torch_dtype": "bfloat16",
}


# Llama-3.1-8B: the shape of TensorRT-LLM's published FP8 throughput figures.
LLAMA31_8B_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128009,
    "torch_dtype": "bfloat16",
}


# gpt-oss-20b's published config, its MXFP4 experts included: on CUDA the dummy loader
# fills them packed with random codes, as the checkpoint's are kept (models/gpt_oss.py).
GPT_OSS_20B_CONFIG: dict = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "vocab_size": 201088,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "rope_theta": 150000.0,
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "mxfp4"},
}


@dataclass(frozen=True)
class Workload:
    """One named row of the benchmark table: what to load and which requests to send."""

    name: str
    arch_config: dict | None  # None: the default model (real weights)
    load_format: str
    dtype: str
    num_prompts: int
    input_range: tuple[int, int]  # inclusive
    output_range: tuple[int, int]  # inclusive
    hf_batch_size: int  # the HF baseline's batch size for this workload
    hf_static_batch_size: int  # same, with --hf-static-cache
    quantization: str | None = None  # e.g. "fp8": the engine quantizes the weights at load
    kv_cache_dtype: str = "auto"

    def engine_kwargs(self, max_num_seqs: int | None = None) -> dict:
        """The engine settings the workload itself fixes (its FP8 weights and pages, for
        trt-8b-*), plus a cap on running sequences where one is given: for the scripts
        that build the engine themselves (profiles, host checks)."""
        kw: dict = {}
        if self.quantization is not None:
            kw["quantization"] = self.quantization
        if self.kv_cache_dtype != "auto":
            kw["kv_cache_dtype"] = self.kv_cache_dtype
        if max_num_seqs:
            kw["max_num_seqs"] = max_num_seqs
        return kw


WORKLOADS: dict[str, Workload] = {
    "gpu-7b": Workload("gpu-7b", LLAMA2_7B_CONFIG, "dummy", "bfloat16", 256,
                       (256, 256), (256, 256), 64, 256),
    "gpu-0.6b": Workload("gpu-0.6b", QWEN3_0_6B_CONFIG, "dummy", "bfloat16", 256,
                         (100, 1024), (100, 1024), 256, 256),
    "gpu-moe": Workload("gpu-moe", QWEN3_30B_A3B_CONFIG, "dummy", "bfloat16", 256,
                        (256, 256), (256, 256), 64, 64),
    # KV-bound: 512 long requests on the 7B shape (MHA, 512 KiB of bf16 K/V per token), the
    # page pool, not the batch cap, limits concurrency: what an FP8 KV cache is for.
    "gpu-7b-kv": Workload("gpu-7b-kv", LLAMA2_7B_CONFIG, "dummy", "bfloat16", 512,
                          (2048, 2048), (512, 512), 16, 16),
    # TensorRT-LLM's published `trtllm-bench throughput` rows for Llama-3.1-8B FP8 (FP8
    # weights and KV, fixed lengths, every request at once): 1,000 in / 1,000 out and
    # 128 in / 2,048 out, 3,000 requests each.
    "trt-8b-1k": Workload("trt-8b-1k", LLAMA31_8B_CONFIG, "dummy", "bfloat16", 3000,
                          (1000, 1000), (1000, 1000), 64, 64, "fp8", "fp8"),
    "trt-8b-2k": Workload("trt-8b-2k", LLAMA31_8B_CONFIG, "dummy", "bfloat16", 3000,
                          (128, 128), (2048, 2048), 64, 64, "fp8", "fp8"),
    # Long prompts on the Llama-3.1-8B shape (llama3 rope scaling): 16 documents at once,
    # and time to first token of one 32k and one 128k prompt (one output token: the
    # elapsed time of a run is the TTFT; run with --repeats 3 for the median).
    "gpu-long": Workload("gpu-long", LLAMA31_8B_CONFIG, "dummy", "bfloat16", 16,
                         (32000, 32000), (128, 128), 4, 4),
    "gpu-long-ttft": Workload("gpu-long-ttft", LLAMA31_8B_CONFIG, "dummy", "bfloat16", 1,
                              (32000, 32000), (1, 1), 1, 1),
    "gpu-long-128k": Workload("gpu-long-128k", LLAMA31_8B_CONFIG, "dummy", "bfloat16", 1,
                              (128000, 128000), (1, 1), 1, 1),
    "gpu-dsv2-lite": Workload("gpu-dsv2-lite", DEEPSEEK_V2_LITE_CONFIG, "dummy", "bfloat16", 256,
                              (1000, 1000), (1000, 1000), 64, 64),
    "gpu-oss-20b": Workload("gpu-oss-20b", GPT_OSS_20B_CONFIG, "dummy", "bfloat16", 256,
                            (256, 256), (256, 256), 64, 64),
    "cpu-smol": Workload("cpu-smol", None, "auto", "float32", 16,
                         (32, 256), (128, 128), 16, 16),
}


def write_arch_config(config: dict, directory: str | None = None) -> str:
    """Write `config` as config.json in a (fresh temporary) directory; return the directory,
    which both pagedllm (load_format="dummy") and HF `from_config` can read."""
    if directory is None:
        directory = tempfile.mkdtemp(prefix="pagedllm-bench-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return directory


def write_word_tokenizer(directory: str, vocab_size: int) -> None:
    """A tokenizer for random-weight models in a server: id i is the word `w<i>`, so every
    id the model samples streams as text and every prompt of such words round-trips.
    Real tokenizers would not fit an arbitrary architecture's vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "w0",
                   "model_max_length": 1 << 20}, f)


def write_byte_tokenizer(directory: str, vocab_size: int) -> None:
    """A byte-level tokenizer for random-weight models under grammars: ids 0..255 are the
    256 bytes (so any text, JSON included, can be written token by token), the rest
    whole words `w<i>`. The word tokenizer above has no `{` or `"` a JSON grammar could
    allow."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for i in range(len(vocab), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}, f)


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """`--input-len 256 --range-ratio 0.5` -> (128, 384), as `vllm bench`'s random dataset."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo, hi = int(length * (1 - range_ratio)), int(length * (1 + range_ratio))
    if lo < 1:
        raise ValueError(f"length {length} with range ratio {range_ratio} allows empty requests")
    return lo, hi


@dataclass
class RandomDataset:
    """Requests as plain token ids and output lengths: what every backend consumes."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def __len__(self) -> int:
        return len(self.prompts)


def random_dataset(num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int],
                   vocab_size: int, seed: int = 0) -> RandomDataset:
    """Uniform lengths in the closed ranges, uniform token ids in [0, vocab_size)."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_range[0], input_range[1] + 1, size=num_prompts)
    out_lens = rng.integers(output_range[0], output_range[1] + 1, size=num_prompts)
    prompts = [rng.integers(0, vocab_size, size=int(n)).tolist() for n in in_lens]
    return RandomDataset(prompts, [int(n) for n in out_lens])
