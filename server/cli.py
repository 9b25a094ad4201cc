"""The `serval` command.

    serval serve [--model PATH] [--port 8000] ...   # OpenAI-compatible server

Subcommands live in one argparse tree: a new one (e.g. `serval bench`) adds an
`add_<name>_parser(subparsers)` that sets `func` and registers it in
`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from typing import Any, Awaitable, Callable

from scheduler.config import ConfigError, EngineConfig, ModelSource, resolve_model

logger = logging.getLogger("serval.server")

# (config, chat template text or None) -> a started client with the AsyncEngineClient surface
ClientFactory = Callable[[EngineConfig, "str | None"], Awaitable[Any]]


# ---------------------------------------------------------------------------
# serval serve
# ---------------------------------------------------------------------------


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


def add_serve_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API. Without --model, serves the "
        "embedded SmolLM2-135M-Instruct on the CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help="HF checkpoint directory, .gguf file, or shipped config name (with --load-format dummy); "
                   "default: the embedded SmolLM2-135M-Instruct")
    m.add_argument("--served-model-name", default=None, help="the model name clients use (default: from --model)")
    m.add_argument("--tokenizer", default=None, help="tokenizer directory or .gguf (default: the model's)")
    m.add_argument("--chat-template", default=None, help="chat template: a Jinja file path, or the template text")
    m.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights (benchmarks)")
    m.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    m.add_argument("--max-model-len", type=_int_at_least(1), default=None,
                   help="context length (default: the model's, capped by the KV cache)")
    m.add_argument("--seed", type=int, default=0, help="engine seed for requests without one")

    e = p.add_argument_group("engine")
    e.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    e.add_argument("--max-num-seqs", type=_int_at_least(1), default=256,
                   help="most sequences in one batch")
    e.add_argument("--max-num-batched-tokens", type=_int_at_least(1), default=None,
                   help="token budget per step (default: chosen per device)")
    e.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    e.add_argument("--kv-cache-memory", type=float, default=1.0, help="CPU: GiB of memory for the KV cache")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="GPU: fraction of GPU memory Serval may use")
    e.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    e.add_argument("--enforce-eager", action="store_true", help="GPU: no CUDA graphs")
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the current one runs on the device "
                   "(default: on for CUDA, off on the CPU)")

    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize "
                   "(default: $SERVAL_API_KEY, or no key)")
    s.add_argument("--max-queued-requests", type=_int_at_least(0), default=None,
                   help="sequences allowed to wait beyond --max-num-seqs; more get 429 (default: unlimited)")
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    from server.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS

    s.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=DEFAULT_TOOL_PARSER,
                   help="how the model writes tool calls (tools with tool_choice auto)")
    s.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the engine to load")
    p.set_defaults(func=serve_command)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        tokenizer=args.tokenizer,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_memory_gb=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        seed=args.seed,
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a busy port fails in a second, not
    after a minute of loading."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    sock.set_inheritable(True)
    return sock


def startup_banner(info: Any, source: ModelSource, served_name: str, host: str, port: int, engine_pid: Any) -> str:
    """What is served and how much fits, e.g.
    KV cache 65,536 tokens (4,096 blocks x 16): 32 requests at the full context of 2,048 tokens."""
    capacity = info.kv_capacity_tokens
    full_ctx = capacity // info.max_model_len
    per_seq = capacity // max(1, info.max_num_seqs)
    shown_host = f"[{host}]" if ":" in host else host
    lines = [
        f"Serval serving {served_name} ({source.kind}: {source.path})",
        f"  device {info.device}, dtype {info.dtype}, max_model_len {info.max_model_len:,}, "
        f"max_num_seqs {info.max_num_seqs}",
        f"  KV cache {capacity:,} tokens ({info.num_blocks:,} blocks x {info.block_size}): "
        f"{full_ctx:,} concurrent requests at the full context of {info.max_model_len:,} tokens, "
        f"or {info.max_num_seqs} (--max-num-seqs) at up to {per_seq:,} tokens each",
        f"  engine core pid {engine_pid}",
        f"  listening on http://{shown_host}:{port}  (OpenAI base URL http://{shown_host}:{port}/v1)",
    ]
    return "\n".join(lines)


async def _run(args: argparse.Namespace, config: EngineConfig, source: ModelSource, sock: socket.socket,
               client_factory: ClientFactory, chat_template: str | None) -> None:
    import uvicorn

    from server.app import build_app

    client = await client_factory(config, chat_template)
    try:
        served_name = args.served_model_name or source.name
        port = sock.getsockname()[1]
        print(startup_banner(client.info, source, served_name, args.host, port, client.engine_pid),
              file=sys.stderr, flush=True)
        api_key = args.api_key if args.api_key is not None else os.environ.get("SERVAL_API_KEY") or None
        app = build_app(
            client,
            served_model_name=served_name,
            model_root=source.path,
            api_key=api_key,
            max_queued_requests=args.max_queued_requests,
            tool_call_parser=args.tool_call_parser,
        )
        uv_config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5, lifespan="on")
        server = uvicorn.Server(uv_config)
        await server.serve(sockets=[sock])
    finally:
        await client.shutdown()


def default_client_factory(startup_timeout: float) -> ClientFactory:
    async def create(config: EngineConfig, chat_template: str | None) -> Any:
        from server.engine_client import AsyncEngineClient

        return await AsyncEngineClient.create(config, startup_timeout=startup_timeout, chat_template=chat_template)

    return create


def serve_command(args: argparse.Namespace, client_factory: ClientFactory | None = None) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
        source = resolve_model(config.model, config.load_format)
        chat_template = None
        if args.chat_template is not None:
            from server.tokenizer import load_chat_template

            chat_template = load_chat_template(args.chat_template)
        sock = bind_socket(args.host, args.port)
    except ConfigError as e:
        print(f"serval serve: error: {e}", file=sys.stderr)
        return 2
    from server.engine_client import EngineStartupError

    factory = client_factory or default_client_factory(args.startup_timeout)
    try:
        asyncio.run(_run(args, config, source, sock, factory, chat_template))
    except ConfigError as e:
        print(f"serval serve: error: {e}", file=sys.stderr)
        return 2
    except EngineStartupError as e:
        if e.traceback:
            print(e.traceback, file=sys.stderr)
        print(f"serval serve: error: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0


# ---------------------------------------------------------------------------
# serval bench (bench/offline.py; imported only when run: it needs torch)
# ---------------------------------------------------------------------------


def add_bench_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", add_help=False, help="benchmarks: `serval bench offline --help`")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=bench_command)


def bench_command(args: argparse.Namespace) -> int:
    if not args.bench_args or args.bench_args[0] != "offline":
        print("usage: serval bench offline [--help] ...", file=sys.stderr)
        return 2
    from bench.offline import bench_main

    return bench_main(args.bench_args[1:])


# ---------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------

SUBCOMMANDS: list[Callable[[Any], None]] = [add_serve_parser, add_bench_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="serval", description="Serval: an OpenAI-compatible LLM inference server.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
