"""Entry point of the engine-core process (started with multiprocessing spawn
by `server.engine_client.AsyncEngineClient`).

    engine_core_main(config, input_addr, output_addr, ready_addr)
      1. build_engine_core(config): model, KV cache, runner, scheduler
      2. send EngineReady(info) on ready_addr, or EngineStartupFailed with the
         traceback text so the API process can print it and exit
      3. run_engine_loop until shutdown or the API process dies
"""

from __future__ import annotations

import logging
import os
import signal
import traceback

import msgspec
import zmq

from scheduler.config import EngineConfig
from scheduler.types import EngineReady, EngineStartupFailed

logger = logging.getLogger(__name__)


def _send_startup(ctx: zmq.Context, ready_addr: str, msg: EngineReady | EngineStartupFailed) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)  # make sure it leaves before we exit
    sock.connect(ready_addr)
    sock.send(msgspec.msgpack.encode(msg))
    sock.close()


DEFAULT_ENGINE_BUILDER = "runner.engine:build_engine_core"


def load_engine_builder(spec: str | None):
    """"module:function" -> the function; None -> runner.engine.build_engine_core.
    Tests pass a builder of an engine core around a fake runner."""
    import importlib

    module, _, func = (spec or DEFAULT_ENGINE_BUILDER).partition(":")
    return getattr(importlib.import_module(module), func)


def engine_core_main(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    ready_addr: str,
    engine_builder: str | None = None,
    log_level: int | str | None = None,
) -> None:
    """log_level: the API process's level (its logging setup is not inherited
    across spawn); None -> $SERVAL_LOG_LEVEL or INFO."""
    # Ctrl-C in a terminal reaches the whole process group: let the API
    # process decide (it sends EngineShutdown); SIGTERM exits at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    logging.basicConfig(
        level=log_level if log_level is not None else os.environ.get("SERVAL_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s engine: %(message)s",
    )

    ctx = zmq.Context()
    try:
        build_engine_core = load_engine_builder(engine_builder)
        core, info = build_engine_core(config)
    except BaseException as e:  # report every startup failure, then exit non-zero
        _send_startup(
            ctx,
            ready_addr,
            EngineStartupFailed(message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()),
        )
        ctx.term()
        raise SystemExit(1) from None

    from scheduler.zmq_engine import run_engine_loop

    try:
        run_engine_loop(
            core,
            input_addr,
            output_addr,
            context=ctx,
            on_connected=lambda: _send_startup(ctx, ready_addr, EngineReady(info=info)),
        )
    finally:
        ctx.term()
