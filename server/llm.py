"""The offline API: batch generation with the engine in this process.

    llm = LLM()                                   # embedded SmolLM2-135M-Instruct
    llm = LLM("path/to/hf_dir", max_model_len=4096, dtype="bfloat16")
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0))

Keyword arguments are EngineConfig fields. The engine core runs in-process
(InprocClient), stepped until every request of a call is done; the same
OutputProcessor as the server turns its token ids into text.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from typing import Any, Callable, Sequence

import msgspec

from scheduler.config import EngineConfig, resolve_model
from scheduler.engine_core import InprocClient
from scheduler.types import EngineInfo, SamplingParams
from server.output_processor import OutputProcessor, make_engine_request
from server.outputs import CompletionOutput, RequestOutput
from server.tokenizer import Tokenizer, load_tokenizer

# one prompt: text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}
PromptType = str | list[int] | dict[str, Any]
Message = dict[str, Any]

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def _log(msg: str) -> None:
    print(f"[serval] {msg}", file=sys.stderr, flush=True)


class LLM:
    """An engine in this process. See the module docstring."""

    def __init__(
        self,
        model: str | None = None,
        *,
        chat_template: str | None = None,
        engine_builder: Callable[[EngineConfig], tuple[Any, EngineInfo]] | None = None,
        **engine_kwargs: Any,
    ):
        unknown = sorted(set(engine_kwargs) - _ENGINE_FIELDS)
        if unknown:
            raise TypeError(
                f"LLM() got unexpected keyword argument(s) {', '.join(unknown)}; "
                f"engine options are: {', '.join(sorted(_ENGINE_FIELDS - {'model'}))}"
            )
        config = EngineConfig(model=model, **engine_kwargs)
        source = resolve_model(config.model, config.load_format)  # ConfigError says how to fix
        self.config = config
        start = time.perf_counter()
        _log(f"loading {source.name} ({source.kind}: {source.path})")
        if engine_builder is None:
            from runner.engine import build_engine_core as engine_builder  # torch lives there
        core, self.info = engine_builder(config)
        _log(
            f"engine ready in {time.perf_counter() - start:.1f} s: {self.info.device}, {self.info.dtype}, "
            f"max_model_len {self.info.max_model_len}, KV cache {self.info.kv_capacity_tokens} tokens"
        )
        # after the engine: torch is loaded, so a GGUF tokenizer converts in-process
        self.tokenizer: Tokenizer = load_tokenizer(source, config.tokenizer, chat_template)
        self.engine = InprocClient(core)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    # -- generation --------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        prompts: a string, a list of token ids, a dict {"prompt": ...} or
        {"prompt_token_ids": ...}, or a list of those. sampling_params: one
        for all prompts or one per prompt. n > 1 runs n sequences per prompt
        (seeded seed, seed+1, ... when a seed is given).
        """
        items = self._normalize_prompts(prompts)
        return self._run(items, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation (a list of messages) or
        to a list of conversations, then generate."""
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)
        items = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                tokenize=False,
                chat_template=chat_template,
                **(chat_template_kwargs or {}),
            )
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(items, sampling_params, use_tqdm)

    # -- internals ---------------------------------------------------------

    def _normalize_prompts(self, prompts: PromptType | Sequence[PromptType]) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]  # one prompt
        items: list[tuple[str | None, list[int]]] = []
        for i, p in enumerate(prompts):
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    items.append((p.get("prompt"), list(p["prompt_token_ids"])))
                    continue
                p = p["prompt"]
            if isinstance(p, str):
                items.append((p, self.tokenizer.encode(p)))
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
                items.append((None, list(p)))
            else:
                raise TypeError(f"prompt {i}: expected a string or a list of token ids, got {type(p).__name__}")
        return items

    def _check_prompt(self, i: int, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError(f"prompt {i} is empty")
        if len(prompt_ids) >= self.info.max_model_len:
            raise ValueError(
                f"prompt {i} has {len(prompt_ids)} tokens; max_model_len is {self.info.max_model_len} "
                "(prompt plus at least one output token)"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary (size {self.info.vocab_size})")

    def _run(
        self,
        items: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(f"{len(params_list)} sampling params for {len(items)} prompts")
        for i, (_, ids) in enumerate(items):
            self._check_prompt(i, ids)

        results: list[RequestOutput] = []
        children: dict[str, tuple[RequestOutput, int]] = {}  # engine req_id -> (output, index)
        try:
            for (text, ids), params in zip(items, params_list):
                request_id = str(next(self._request_counter))
                result = RequestOutput(
                    request_id=request_id,
                    prompt=text,
                    prompt_token_ids=ids,
                    outputs=[CompletionOutput(index=j) for j in range(params.n)],
                )
                results.append(result)
                for j in range(params.n):
                    child_id = request_id if params.n == 1 else f"{request_id}-{j}"
                    seed = None if params.seed is None else params.seed + j
                    child_params = msgspec.structs.replace(params, n=1, seed=seed)
                    request = make_engine_request(child_id, ids, child_params, self.tokenizer)
                    self.output_processor.add_request(child_id, ids, child_params, request.arrival_time)
                    children[child_id] = (result, j)
                    self.engine.add_request(request)
            self._step_until_done(results, children, use_tqdm)
        except BaseException:  # Ctrl-C or an engine error: leave the engine clean
            unfinished = [r for r in children if r in self.output_processor.requests]
            self.output_processor.abort_requests(unfinished)
            self.engine.abort_requests(unfinished)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return results

    def _step_until_done(
        self, results: list[RequestOutput], children: dict[str, tuple[RequestOutput, int]], use_tqdm: bool
    ) -> None:
        pbar = None
        if use_tqdm and results:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(results), desc="Processed prompts", dynamic_ncols=True)
        num_output_tokens = 0
        start = time.perf_counter()
        while self.output_processor.has_unfinished_requests():
            outputs = self.engine.step()
            for out in outputs.outputs:
                if out.error is not None:  # e.g. a structured output whose grammar does not compile
                    raise ValueError(f"request {out.req_id}: {out.error}")
            processed = self.output_processor.process_outputs(outputs.outputs)
            if processed.reqs_to_abort:
                self.engine.abort_requests(processed.reqs_to_abort)
            for delta in processed.deltas:
                result, index = children[delta.req_id]
                result.add(index, delta)
                num_output_tokens += len(delta.token_ids)
                if pbar is not None and result.finished and delta.finished:
                    pbar.update(1)
                    elapsed = time.perf_counter() - start
                    pbar.set_postfix_str(f"output {num_output_tokens / max(elapsed, 1e-9):.1f} tok/s", refresh=False)
        # let the engine free what stop strings ended (their abort notices)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        if pbar is not None:
            pbar.close()
