"""The API process's handle on the engine-core process.

    client = await AsyncEngineClient.create(EngineConfig(...))
    async for delta in client.generate("req-1", prompt_ids, SamplingParams(max_tokens=32)):
        print(delta.text, end="")
    await client.shutdown()

`create` spawns the engine core (multiprocessing spawn, never fork) with
three IPC sockets in a private temp dir, loads the tokenizer meanwhile, and
waits for the engine's EngineReady. A background task reads the engine's
outputs, runs them through the OutputProcessor (detokenizer, stop strings)
and feeds one asyncio queue per request. A monitor task polls the process:
if it dies, `is_healthy()` turns False and every pending and later
`generate()` raises EngineDeadError.

This module and everything it imports stay torch-free: the engine process
imports `runner` (and torch) on its own side of the spawn.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import weakref
from typing import AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from scheduler.config import EngineConfig, ModelSource, resolve_model
from scheduler.types import (
    EngineAbortRequests,
    EngineAddRequests,
    EngineCoreOutputs,
    EngineFatalError,
    EngineInfo,
    EngineNotice,
    EngineReady,
    EngineRequestRejected,
    EngineShutdown,
    EngineStartup,
    SamplingParams,
    SchedulerStats,
)
from scheduler.zmq_engine import NOTICE_FRAME, OUTPUTS_FRAME
from server.output_processor import OutputProcessor, make_engine_request
from server.outputs import RequestDelta
from server.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

HEALTH_POLL_INTERVAL_S = 0.2


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing more will come from it."""


class EngineStartupError(RuntimeError):
    """The engine core failed to start. `message` is one line; `traceback`
    the engine-side traceback text (empty when the process just died)."""

    def __init__(self, message: str, traceback: str = ""):
        super().__init__(message)
        self.message = message
        self.traceback = traceback


class RequestRejectedError(ValueError):
    """The request cannot run (e.g. the prompt does not fit max_model_len)."""


def _engine_process_entry(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    ready_addr: str,
    engine_builder: str | None,
    log_level: int,
) -> None:
    # runs in the spawned child: the only place runner (and torch) is imported
    from runner.engine_proc import engine_core_main

    engine_core_main(config, input_addr, output_addr, ready_addr, engine_builder, log_level)


def _stop_process(proc: multiprocessing.process.BaseProcess, tmp_dir: str) -> None:
    """Last-resort cleanup (shutdown() not called, or at interpreter exit)."""
    if proc.is_alive():
        proc.terminate()
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    shutil.rmtree(tmp_dir, ignore_errors=True)


class AsyncEngineClient:
    """Use `await AsyncEngineClient.create(config)`; see the module docstring."""

    info: EngineInfo
    tokenizer: Tokenizer | None  # None: a dummy-weights model without a tokenizer
    latest_stats: SchedulerStats
    engine_pid: int

    def __init__(self) -> None:
        raise TypeError("use `await AsyncEngineClient.create(config)`")

    @classmethod
    async def create(
        cls,
        config: EngineConfig,
        startup_timeout: float = 600.0,
        chat_template: str | None = None,
        engine_builder: str | None = None,
    ) -> AsyncEngineClient:
        """Start the engine core and wait until it is ready.

        Raises ConfigError for a bad model/tokenizer (before spawning
        anything) and EngineStartupError if the engine fails to start or does
        not report ready within `startup_timeout` seconds.
        engine_builder: "module:function" building (EngineCore, EngineInfo)
        from the config in the engine process; default runner.engine.build_engine_core.
        """
        source = resolve_model(config.model, config.load_format)
        self = object.__new__(cls)
        self._init_state(config, source)
        try:
            await self._start(startup_timeout, chat_template, engine_builder)
        except BaseException:
            await self._close(kill=True)
            raise
        return self

    def _init_state(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.model_source = source
        self.latest_stats = SchedulerStats()
        self.tokenizer = None
        self.output_processor = OutputProcessor(None)
        self._queues: dict[str, asyncio.Queue[RequestDelta | BaseException]] = {}
        self._stats_callbacks: list[Callable[[SchedulerStats], None]] = []
        self._dead_error: EngineDeadError | None = None
        self._closed = False
        self._tasks: list[asyncio.Task] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._notice_decoder = msgspec.msgpack.Decoder(EngineNotice)
        self._tmp_dir = tempfile.mkdtemp(prefix="serval-ipc-")
        self._zmq = zmq.Context()
        self._azmq = zmq.asyncio.Context()
        self._proc: multiprocessing.process.BaseProcess | None = None
        self.engine_pid = -1

    async def _start(self, startup_timeout: float, chat_template: str | None, engine_builder: str | None) -> None:
        addr = lambda name: f"ipc://{os.path.join(self._tmp_dir, name)}"  # noqa: E731
        input_addr, output_addr, ready_addr = addr("input"), addr("output"), addr("ready")
        self._input_sock = self._zmq.socket(zmq.PUSH)
        self._input_sock.setsockopt(zmq.SNDHWM, 0)  # never block the event loop
        self._input_sock.setsockopt(zmq.LINGER, 0)
        self._input_sock.setsockopt(zmq.SNDTIMEO, 500)  # see _send
        self._input_sock.bind(input_addr)
        self._output_sock = self._azmq.socket(zmq.PULL)
        self._output_sock.setsockopt(zmq.RCVHWM, 0)
        self._output_sock.setsockopt(zmq.LINGER, 0)
        self._output_sock.bind(output_addr)
        ready_sock = self._azmq.socket(zmq.PULL)
        ready_sock.setsockopt(zmq.LINGER, 0)
        ready_sock.bind(ready_addr)

        proc = multiprocessing.get_context("spawn").Process(
            target=_engine_process_entry,
            args=(
                self.config,
                input_addr,
                output_addr,
                ready_addr,
                engine_builder,
                logging.getLogger().getEffectiveLevel(),
            ),
            name="serval-engine-core",
        )
        proc.start()
        self._proc = proc
        self.engine_pid = proc.pid
        self._finalizer = weakref.finalize(self, _stop_process, proc, self._tmp_dir)
        logger.info("engine core starting (pid %d)", proc.pid)

        try:
            # the tokenizer loads (or converts, the first time) while the engine starts
            tokenizer_task = asyncio.get_running_loop().run_in_executor(None, self._load_tokenizer, chat_template)
            self.info = await self._wait_ready(ready_sock, startup_timeout)
            self.tokenizer = await tokenizer_task
        finally:
            ready_sock.close(linger=0)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._tasks = [
            asyncio.create_task(self._read_outputs(), name="serval-engine-outputs"),
            asyncio.create_task(self._monitor_process(), name="serval-engine-monitor"),
        ]

    def _load_tokenizer(self, chat_template: str | None) -> Tokenizer | None:
        source = self.model_source
        if source.kind == "config_dir" and self.config.tokenizer is None:
            try:
                return load_tokenizer(source, None, chat_template)
            except Exception:
                logger.warning("%s has no tokenizer: token-id prompts only, no text", source.name)
                return None
        return load_tokenizer(source, self.config.tokenizer, chat_template)

    async def _wait_ready(self, ready_sock: zmq.asyncio.Socket, timeout: float) -> EngineInfo:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if await ready_sock.poll(timeout=int(HEALTH_POLL_INTERVAL_S * 1000)):
                msg = msgspec.msgpack.decode(await ready_sock.recv(), type=EngineStartup)
                if isinstance(msg, EngineReady):
                    logger.info(
                        "engine core ready: %s on %s, %d KV blocks of %d tokens",
                        msg.info.model,
                        msg.info.device,
                        msg.info.num_blocks,
                        msg.info.block_size,
                    )
                    return msg.info
                raise EngineStartupError(f"engine core failed to start: {msg.message}", msg.traceback)
            if not self._proc.is_alive():
                raise EngineStartupError(
                    f"engine core process exited with code {self._proc.exitcode} during startup"
                )
            if time.monotonic() > deadline:
                raise EngineStartupError(f"engine core did not become ready within {timeout:.0f} s")

    # -- requests ----------------------------------------------------------

    async def generate(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Run one sequence; yields deltas until one with finish_reason set.

        n > 1 is the caller's to fan out (one generate() per sequence, with
        its own req_id and seed). Leaving the loop early (break, cancellation,
        client disconnect) aborts the request in the engine. Raises
        EngineDeadError if the engine dies, RequestRejectedError if the
        request cannot run.
        """
        self._check_alive()
        if params.n != 1:
            raise ValueError("generate() runs one sequence: fan out n > 1 into n requests")
        if req_id in self._queues:
            raise ValueError(f"request id {req_id!r} is already running")
        if not prompt_token_ids:
            raise RequestRejectedError("the prompt is empty")
        if len(prompt_token_ids) >= self.info.max_model_len:
            raise RequestRejectedError(
                f"the prompt has {len(prompt_token_ids)} tokens; the model's context is "
                f"{self.info.max_model_len} tokens including the output"
            )
        request = make_engine_request(req_id, prompt_token_ids, params, self.tokenizer)
        queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self.output_processor.add_request(req_id, prompt_token_ids, params, request.arrival_time)
        self._queues[req_id] = queue
        finished = False
        try:
            self._send(EngineAddRequests([request]))
            pending: RequestDelta | BaseException | None = None
            while True:
                item = pending if pending is not None else await queue.get()
                pending = None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                # a slow consumer gets the backlog as one delta
                while not item.finished and not queue.empty():
                    later = queue.get_nowait()
                    if isinstance(later, BaseException):
                        pending = later
                        break
                    item.merge(later)
                finished = item.finished
                if finished:  # free the id now, even if the consumer never resumes us
                    self._queues.pop(req_id, None)
                yield item
                if finished:
                    return
        finally:
            if self._queues.get(req_id) is queue:
                del self._queues[req_id]
            if not finished:
                self._abort_now([req_id])

    async def abort(self, req_id: str | list[str]) -> None:
        """Stop requests; a consumer still iterating gets a final "abort" delta."""
        req_ids = [req_id] if isinstance(req_id, str) else list(req_id)
        for delta in self.output_processor.abort_requests(req_ids):
            queue = self._queues.get(delta.req_id)
            if queue is not None:
                queue.put_nowait(delta)
        self._abort_now(req_ids)

    def _abort_now(self, req_ids: list[str]) -> None:
        """Abort from a `finally` (consumer gone): never raises."""
        self.output_processor.abort_requests(req_ids)
        if self._dead_error is None and not self._closed:
            try:
                self._send(EngineAbortRequests(req_ids))
            except EngineDeadError:
                pass

    def _send(self, msg: EngineAddRequests | EngineAbortRequests | EngineShutdown) -> None:
        """Send without blocking the event loop for good: a PUSH socket with
        no peer (the engine died, not yet noticed) would wait forever."""
        data = self._encoder.encode(msg)
        try:
            self._input_sock.send(data, zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            pass
        if self._proc is not None and self._proc.is_alive():
            try:  # connected a moment ago or reconnecting: a short, bounded wait
                self._input_sock.send(data, copy=False)
                return
            except zmq.Again:
                pass
        self._set_dead(EngineDeadError("the engine core is not reachable"))
        assert self._dead_error is not None
        raise self._dead_error

    # -- health and stats --------------------------------------------------

    def is_healthy(self) -> bool:
        return self._dead_error is None and not self._closed

    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if self._closed:
            raise EngineDeadError("the engine client is shut down")

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._queues)

    def add_stats_callback(self, callback: Callable[[SchedulerStats], None]) -> None:
        """Call `callback(stats)` on the event loop whenever the engine sends
        SchedulerStats (every step while busy, every ~1 s while idle)."""
        self._stats_callbacks.append(callback)

    # -- background tasks --------------------------------------------------

    async def _read_outputs(self) -> None:
        try:
            while True:
                kind, payload = await self._output_sock.recv_multipart(copy=False)
                if kind.bytes == OUTPUTS_FRAME:
                    self._handle_outputs(self._outputs_decoder.decode(payload.buffer))
                elif kind.bytes == NOTICE_FRAME:
                    self._handle_notice(self._notice_decoder.decode(payload.buffer))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("engine output reader failed")
            self._set_dead(EngineDeadError(f"engine output reader failed: {e!r}"))

    def _handle_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.outputs:
            for out in outputs.outputs:
                if out.error is not None:  # could not run (e.g. a grammar that does not compile)
                    self._reject(out.req_id, out.error)
            processed = self.output_processor.process_outputs(outputs.outputs)
            for delta in processed.deltas:
                queue = self._queues.get(delta.req_id)
                if queue is not None:
                    queue.put_nowait(delta)
            if processed.reqs_to_abort and self._dead_error is None:
                self._send(EngineAbortRequests(processed.reqs_to_abort))
        if outputs.scheduler_stats is not None:
            self.latest_stats = outputs.scheduler_stats
            for callback in self._stats_callbacks:
                try:
                    callback(outputs.scheduler_stats)
                except Exception:
                    logger.exception("stats callback failed")

    def _handle_notice(self, notice: EngineRequestRejected | EngineFatalError) -> None:
        if isinstance(notice, EngineRequestRejected):
            self._reject(notice.req_id, notice.message)
        else:
            logger.error("engine core crashed: %s\n%s", notice.message, notice.traceback)
            self._set_dead(EngineDeadError(f"engine core crashed: {notice.message}"))

    def _reject(self, req_id: str, message: str) -> None:
        self.output_processor.abort_requests([req_id])
        queue = self._queues.get(req_id)
        if queue is not None:
            queue.put_nowait(RequestRejectedError(message))

    async def _monitor_process(self) -> None:
        assert self._proc is not None
        while self._proc.is_alive():
            await asyncio.sleep(HEALTH_POLL_INTERVAL_S)
        if not self._closed:
            logger.error("engine core process died (exit code %s)", self._proc.exitcode)
            self._set_dead(EngineDeadError(f"engine core process died (exit code {self._proc.exitcode})"))

    def _set_dead(self, error: EngineDeadError) -> None:
        if self._dead_error is not None:
            return
        self._dead_error = error
        self.output_processor.abort_requests(list(self.output_processor.requests))
        for queue in self._queues.values():
            queue.put_nowait(error)

    # -- shutdown ----------------------------------------------------------

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine core (gracefully, then by signal) and free everything.
        Pending generate() calls raise EngineDeadError."""
        await self._close(kill=False, timeout=timeout)

    async def _close(self, kill: bool, timeout: float = 5.0) -> None:
        if self._closed:
            return
        proc = self._proc
        if proc is not None and proc.is_alive() and not kill:
            try:
                self._send(EngineShutdown())
            except (zmq.ZMQError, EngineDeadError):
                pass
            deadline = time.monotonic() + timeout
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self._closed = True
        self._set_dead(EngineDeadError("the engine client is shut down"))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if proc is not None:
            await asyncio.get_running_loop().run_in_executor(None, _stop_process, proc, self._tmp_dir)
            self._finalizer.detach()
        for sock in (getattr(self, "_input_sock", None), getattr(self, "_output_sock", None)):
            if sock is not None:
                sock.close(linger=0)
        self._zmq.term()
        self._azmq.term()
        shutil.rmtree(self._tmp_dir, ignore_errors=True)
