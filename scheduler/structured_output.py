"""Guided decoding, engine-core side (no torch): compiled grammars and the
requests that wait for theirs.

A guided request (SamplingParams.structured_output set) does not enter the
scheduler until its grammar is compiled:

    EngineCore.add_request(req)       -> GuidedRequests.add: compile submitted, req held
    EngineCore.step()                 -> GuidedRequests.pop_ready: compiled ones go to the
                                         scheduler, failed ones become ERROR outputs
    ModelRunner (same process)        -> GrammarCache.get_or_compile(spec): the compiled
                                         grammar, to build the request's matcher

Compilation runs on a thread pool (xgrammar releases the GIL), so a slow
schema never stalls the step loop, and each distinct spec is compiled once:
`GrammarCache` keeps compiled grammars in an LRU with a bound, and a spec
already being compiled is not compiled again (its requests share the future).

The grammar backend, the one thing that knows a grammar library, is injected
by the runner side (runner.structured_output.XgrammarBackend), so this
package stays torch-free; tests inject a fake backend.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Iterable, Protocol

from scheduler.types import EngineCoreOutput, EngineCoreRequest, FinishReason, StructuredOutputSpec

logger = logging.getLogger(__name__)

# A held request whose grammar has not compiled after this long finishes with
# an ERROR output. The compile itself cannot be stopped (a thread): it keeps
# its worker until it returns, and requests for the same spec share it (and
# time out too) rather than starting another.
GRAMMAR_COMPILE_TIMEOUT_S = 60.0


class GrammarCompileError(ValueError):
    """The spec is invalid (bad schema, regex or grammar); the message says
    why, for the user."""


class GrammarBackend(Protocol):
    """Compiles specs into grammar objects the runner understands.

    `compile` runs on worker threads (several at once): it must be
    thread-safe. It raises GrammarCompileError for an invalid spec.
    """

    def compile(self, spec: StructuredOutputSpec) -> Any: ...


class GrammarCache:
    """Compiled grammars by spec key (kind, value), LRU-bounded, compiled off
    the caller's thread.

    cache = GrammarCache(backend, max_entries=2)
    f = cache.submit(spec_a)        # compiling on a worker
    f.result()                      # the grammar (or raises GrammarCompileError)
    cache.submit(spec_a)            # a finished future: no second compile
    cache.submit(b); cache.submit(c)  # spec_a, least recently used, is evicted

    Failures are cached too, so a client repeating an invalid schema costs
    one compile. Entries evicted while a request still uses the grammar stay
    alive through that request's matcher; only a later `get_or_compile`
    (a resumed request) compiles again.
    """

    def __init__(self, backend: GrammarBackend, *, max_entries: int = 256, max_workers: int = 2):
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.backend = backend
        self.max_entries = max_entries
        self._lock = threading.Lock()
        # key -> finished future (result or exception), most recently used last
        self._done: OrderedDict[tuple[str, str], cf.Future] = OrderedDict()
        self._in_flight: dict[tuple[str, str], cf.Future] = {}
        self._executor = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="serval-grammar")
        self.num_compiles = 0  # compiles started (hits and shared in-flight compiles excluded)
        self.num_hits = 0

    def submit(self, spec: StructuredOutputSpec) -> cf.Future:
        """A future of the compiled grammar; finished already on a cache hit."""
        key = spec.key
        with self._lock:
            done = self._done.get(key)
            if done is not None:
                self._done.move_to_end(key)
                self.num_hits += 1
                return done
            future = self._in_flight.get(key)
            if future is not None:
                self.num_hits += 1
                return future
            self.num_compiles += 1
            future = self._executor.submit(self.backend.compile, spec)
            self._in_flight[key] = future
        future.add_done_callback(lambda f, key=key: self._finished(key, f))
        return future

    def _finished(self, key: tuple[str, str], future: cf.Future) -> None:
        with self._lock:
            self._in_flight.pop(key, None)
            self._done[key] = future
            self._done.move_to_end(key)
            while len(self._done) > self.max_entries:
                self._done.popitem(last=False)

    def get_or_compile(self, spec: StructuredOutputSpec) -> Any:
        """The compiled grammar, compiling on this thread if it was evicted.
        Raises GrammarCompileError for an invalid spec."""
        key = spec.key
        with self._lock:
            future = self._done.get(key)
            if future is not None:
                self._done.move_to_end(key)
            else:
                future = self._in_flight.get(key)
        if future is not None:
            return future.result()
        grammar = self.backend.compile(spec)
        done: cf.Future = cf.Future()
        done.set_result(grammar)
        self._finished(key, done)
        return grammar

    def __len__(self) -> int:
        with self._lock:
            return len(self._done)

    def __contains__(self, spec: StructuredOutputSpec) -> bool:
        with self._lock:
            return spec.key in self._done

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def compile_error_message(exc: BaseException) -> str:
    if isinstance(exc, ValueError):
        return str(exc)
    return f"the grammar could not be compiled ({type(exc).__name__}: {exc})"


class GuidedRequests:
    """Guided requests held outside the scheduler while their grammar compiles.

    add() submits the compile; pop_ready() hands back, in arrival order, the
    requests whose compile finished (for the scheduler) and an ERROR output
    for each whose compile failed or took longer than compile_timeout_s;
    abort() drops held requests (ABORT outputs).
    """

    def __init__(self, cache: GrammarCache, compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S):
        self.cache = cache
        self.compile_timeout_s = compile_timeout_s
        # req_id -> (request, compile future, time.monotonic() when held), arrival order
        self._held: dict[str, tuple[EngineCoreRequest, cf.Future, float]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._held

    def add(self, request: EngineCoreRequest) -> None:
        spec = request.sampling_params.structured_output
        assert spec is not None
        if request.req_id in self._held:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        self._held[request.req_id] = (request, self.cache.submit(spec), time.monotonic())

    def wait(self, timeout: float) -> None:
        """Block until some held compile finishes, at most `timeout` seconds."""
        if self._held:
            cf.wait([f for _, f, _ in self._held.values()], timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def pop_ready(self) -> tuple[list[EngineCoreRequest], list[EngineCoreOutput]]:
        ready: list[EngineCoreRequest] = []
        errors: list[EngineCoreOutput] = []
        now = time.monotonic()
        for req_id, (request, future, held_since) in list(self._held.items()):
            if not future.done():
                if now - held_since > self.compile_timeout_s:
                    del self._held[req_id]
                    logger.error("the grammar of request %s did not compile in %.0f s", req_id, self.compile_timeout_s)
                    errors.append(error_output(
                        req_id, f"the grammar did not compile within {self.compile_timeout_s:g} s; simplify the schema"
                    ))
                continue
            del self._held[req_id]
            exc = future.exception()
            if exc is None:
                ready.append(request)
                continue
            if not isinstance(exc, ValueError):
                logger.error("compiling the grammar of request %s failed", req_id, exc_info=exc)
            errors.append(error_output(req_id, compile_error_message(exc)))
        return ready, errors

    def abort(self, req_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = []
        for req_id in req_ids:
            if self._held.pop(req_id, None) is not None:
                outputs.append(EngineCoreOutput(req_id=req_id, new_token_ids=[], finish_reason=FinishReason.ABORT))
        return outputs


def error_output(req_id: str, message: str) -> EngineCoreOutput:
    return EngineCoreOutput(req_id=req_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=message)
