"""The `specserve serve` and `specserve bench serve` subcommands.

Heavy imports (torch, FastAPI) happen inside the commands, so `specserve --help`
stays fast.
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from specserve.bench.cli import add_decode_parser
from specserve.entrypoints.cli import add_engine_args, engine_kwargs
from specserve.entrypoints.openai.tool_parsers import TOOL_PARSERS


def _positive(cast):
    def parse(text: str):
        value = cast(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model to serve (overrides --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model name clients send (default: MODEL)")
    p.add_argument("--max-waiting", type=_positive(int), default=512,
                   help="requests allowed to wait for admission; beyond that the server answers 503")
    p.add_argument("--request-timeout", type=_positive(float),
                   help="seconds after which a request is aborted and answered 408 (default: no limit)")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running requests get to finish on shutdown before they are aborted")
    p.add_argument("--stream-interval", type=_positive(int), default=1,
                   help="tokens per streamed chunk at most; a busy server sends fewer, larger chunks with more "
                        "(the first token and the end always go out at once)")
    p.add_argument("--max-request-bytes", type=_positive(int), default=8 * 2**20,
                   help="request bodies larger than this are refused (413) before they are read")
    p.add_argument("--receive-timeout", type=_positive(float), default=30.0,
                   help="seconds a client has to send a whole request (headers and body), from connecting or "
                        "from the end of its previous answer; slower clients are disconnected")
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"),
                   help="require this key (Authorization: Bearer KEY) on every route but /health "
                        "(default: $SPECSERVE_API_KEY; none if unset)")
    p.add_argument("--enable-docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json (behind the API key, if one is set)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template to use in place of the tokenizer's (for tool calling: one that "
                        "renders tools and tool calls)")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                   help="the format the model writes tool calls in (hermes: Hermes, Qwen 2.5 and Qwen 3; "
                        "llama3_json: Llama 3.1-3.3); needed for tool_choice auto, required or a named function")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto" (the default when a request has tools): the model decides '
                        "whether to call; needs --tool-call-parser")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)


def _missing_dependency(e: ImportError) -> SystemExit:
    return SystemExit(f"error: {e.name} is not installed, though specserve depends on it: the installation is "
                      "incomplete; reinstall specserve (pip install -e . in a checkout) to bring its dependencies")


def cmd_serve(a: argparse.Namespace) -> None:
    from specserve.config import EngineConfig

    try:
        from specserve.entrypoints.openai.api_server import ServerConfig, run_server
    except ImportError as e:
        raise _missing_dependency(e) from e

    from specserve.entrypoints.openai.tool_calling import ToolCallingConfig

    model = a.model_tag or a.model
    try:
        chat_template = Path(a.chat_template).read_text(encoding="utf-8") if a.chat_template else None
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: cannot read --chat-template {a.chat_template}: {e}") from e
    try:
        server = ServerConfig(
            host=a.host, port=a.port, served_model_name=a.served_model_name or model, max_waiting=a.max_waiting,
            request_timeout=a.request_timeout, shutdown_grace_s=a.shutdown_grace, stream_interval=a.stream_interval,
            max_request_bytes=a.max_request_bytes, receive_timeout_s=a.receive_timeout, api_key=a.api_key,
            enable_docs=a.enable_docs, chat_template=chat_template,
            tool_calling=ToolCallingConfig(a.tool_call_parser, a.enable_auto_tool_choice))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    run_server(EngineConfig(model=model, **engine_kwargs(a)), server)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("serve", help="load-test a running server and print throughput and latency")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to request (default: the server's first model)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--dataset", required=True,
                   help='JSONL of prompts: MT-bench style {"turns": [...]} (first turn used) or {"prompt": ...}')
    p.add_argument("--num-prompts", type=_positive(int), default=80,
                   help="requests to send (the dataset repeats if shorter)")
    p.add_argument("--max-tokens", type=_positive(int), default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--concurrency", type=_positive(int), help="most requests in flight at once (default: no limit)")
    p.add_argument("--request-rate", type=_positive(float), default=math.inf,
                   help="mean requests per second, Poisson arrivals (default: all at once)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--ignore-eos", action="store_true", help="make every request generate --max-tokens tokens")
    p.add_argument("--timeout", type=_positive(float), default=600.0, help="seconds per request")
    p.add_argument("--client-processes", type=_positive(int),
                   help="processes sharing the streams (default: one per 16 streams, at most the CPU count)")
    p.set_defaults(func=cmd_bench_serve)
    add_decode_parser(bench_sub)
    p = bench_sub.add_parser("offline", help="the engine's throughput on a prompt set in this process, the "
                             "figure `bench serve` is compared with")
    p.add_argument("--dataset", required=True, help="JSONL of prompts, as for `bench serve`")
    p.add_argument("--num-prompts", type=_positive(int), default=80)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="chat: the prompts go through the model's chat template, as `bench serve` sends them")
    p.add_argument("--max-tokens", type=_positive(int), default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=cmd_bench_offline)


def cmd_bench_offline(a: argparse.Namespace) -> None:
    from specserve.bench.offline import print_offline_report, run_offline
    from specserve.entrypoints.openai.bench_serve import load_prompts
    from specserve.llm import LLM

    prompts = load_prompts(a.dataset, a.num_prompts)
    llm = LLM(a.model, **engine_kwargs(a))
    print_offline_report(run_offline(llm, prompts, a.endpoint == "chat", a.max_tokens, a.temperature,
                                     a.ignore_eos))


def cmd_bench_serve(a: argparse.Namespace) -> None:
    try:
        from specserve.entrypoints.openai.bench_serve import BenchConfig, load_prompts, print_report, run_benchmark
    except ImportError as e:
        raise _missing_dependency(e) from e

    try:
        prompts = load_prompts(a.dataset, a.num_prompts)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: cannot read prompts from {a.dataset}: {e!r}") from e
    config = BenchConfig(a.base_url.rstrip("/"), a.model, a.endpoint, a.max_tokens, a.temperature, a.concurrency,
                         a.request_rate, a.seed, a.timeout, a.ignore_eos, a.client_processes)
    print_report(run_benchmark(config, prompts))
