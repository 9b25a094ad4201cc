"""The engine-core side of the ZMQ process boundary.

    API process                      engine-core process (run_engine_loop)
    PUSH input  ── EngineInput ──▶   PULL: add / abort / shutdown
    PULL output ◀── frames ───────   PUSH: [b"O", EngineCoreOutputs] each step
                                           [b"N", EngineNotice] rejections, crash

Between steps every pending input message is drained without blocking, so
new requests join the next step; when no request is unfinished the loop
blocks on the input socket, waking every `stats_interval_s` to send the
scheduler's stats (gauges stay fresh while idle) and to check that the API
process is still alive (the engine exits when its parent is gone).
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Callable

import msgspec
import zmq

from scheduler.engine_core import EngineCore, freeze_gc_after_startup
from scheduler.types import (
    EngineAbortRequests,
    EngineAddRequests,
    EngineCoreOutputs,
    EngineFatalError,
    EngineInput,
    EngineRequestRejected,
    EngineShutdown,
)

logger = logging.getLogger(__name__)

OUTPUTS_FRAME = b"O"
NOTICE_FRAME = b"N"


class _ParentGone(Exception):
    pass


class _EngineLoop:
    def __init__(self, core: EngineCore, input_sock: zmq.Socket, output_sock: zmq.Socket, stats_interval_s: float):
        self.core = core
        self.input_sock = input_sock
        self.output_sock = output_sock
        self.stats_interval_s = stats_interval_s
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.parent_pid = os.getppid()
        self.last_stats_time = 0.0
        self.last_parent_check = time.monotonic()
        self.shutdown = False

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.input_sock, zmq.POLLIN)
        while not self.shutdown:
            if not self.core.has_unfinished_requests():
                # idle: block on input, waking up for stats and the parent check
                if not poller.poll(timeout=self.stats_interval_s * 1000):
                    if self._parent_gone():
                        return
                    self._send_stats()
                    continue
            self._drain_input()
            if self.shutdown:
                return
            if self.core.has_unfinished_requests():
                outputs = self.core.step()
                now = time.monotonic()
                if outputs.outputs or now - self.last_stats_time >= self.stats_interval_s:
                    self._send_outputs(outputs, now)
                if now - self.last_parent_check >= self.stats_interval_s:
                    self.last_parent_check = now
                    if self._parent_gone():
                        return

    def _parent_gone(self) -> bool:
        if os.getppid() == self.parent_pid:
            return False
        logger.warning("the API process is gone; the engine core exits")
        return True

    def _drain_input(self) -> None:
        while True:
            try:
                frame = self.input_sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self.decoder.decode(frame.buffer))

    def _handle(self, msg: EngineAddRequests | EngineAbortRequests | EngineShutdown) -> None:
        if isinstance(msg, EngineAddRequests):
            for request in msg.requests:
                try:
                    self.core.add_request(request)
                except ValueError as e:
                    notice = EngineRequestRejected(req_id=request.req_id, message=str(e))
                    self._send([NOTICE_FRAME, self.encoder.encode(notice)])
        elif isinstance(msg, EngineAbortRequests):
            self.core.abort_requests(msg.req_ids)
        else:
            self.shutdown = True

    def _send_outputs(self, outputs: EngineCoreOutputs, now: float) -> None:
        if outputs.scheduler_stats is not None:
            self.last_stats_time = now
        self._send([OUTPUTS_FRAME, self.encoder.encode(outputs)])

    def _send(self, frames: list[bytes]) -> None:
        """A PUSH socket blocks while it has no peer: never block for good.
        No peer and no parent -> stop the loop."""
        flags = zmq.NOBLOCK
        while True:
            try:
                self.output_sock.send_multipart(frames, flags=flags, copy=False)
                return
            except zmq.Again:
                if self._parent_gone():
                    raise _ParentGone from None
                flags = 0  # the API process is there but not connected (yet): wait, SNDTIMEO-bounded

    def _send_stats(self) -> None:
        stats = EngineCoreOutputs(scheduler_stats=self.core.make_stats(), timestamp=time.time())
        self._send_outputs(stats, time.monotonic())


def run_engine_loop(
    core: EngineCore,
    input_addr: str,
    output_addr: str,
    stats_interval_s: float = 1.0,
    context: zmq.Context | None = None,
    on_connected: Callable[[], None] | None = None,
) -> None:
    """Serve `core` until an EngineShutdown message arrives or the parent
    process dies. The API process binds both addresses; we connect, then
    call `on_connected()` (the engine process reports ready there, so the
    API process never sends before our input socket is connected).

    A crash inside the loop is reported as an EngineFatalError notice (so the
    API process can show the traceback) and then re-raised.
    """
    ctx = context or zmq.Context()
    input_sock = ctx.socket(zmq.PULL)
    input_sock.setsockopt(zmq.RCVHWM, 0)
    input_sock.connect(input_addr)
    output_sock = ctx.socket(zmq.PUSH)
    output_sock.setsockopt(zmq.SNDHWM, 0)
    output_sock.setsockopt(zmq.LINGER, 2000)
    output_sock.setsockopt(zmq.SNDTIMEO, 1000)
    output_sock.connect(output_addr)
    try:
        freeze_gc_after_startup()  # the core is built: its objects stay for good
        if on_connected is not None:
            on_connected()
        _EngineLoop(core, input_sock, output_sock, stats_interval_s).run()
    except _ParentGone:
        logger.warning("the API process is gone; the engine core exits")
    except BaseException as e:
        if not isinstance(e, (KeyboardInterrupt, SystemExit)):
            notice = EngineFatalError(message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            try:
                output_sock.send_multipart([NOTICE_FRAME, msgspec.msgpack.encode(notice)], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        raise
    finally:
        input_sock.close(linger=0)
        output_sock.close()
        if context is None:
            ctx.term()
