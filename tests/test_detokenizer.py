"""Incremental detokenization, stop strings and hold-back, on the embedded
SmolLM2 tokenizer (byte-level BPE: multi-byte characters span tokens)."""

from __future__ import annotations

import pytest

from scheduler.config import ConfigError, resolve_model
from scheduler.types import EngineCoreOutput, FinishReason, Logprob, SamplingParams
from server.detokenizer import IncrementalDetokenizer
from server.output_processor import OutputProcessor
from server.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    try:
        source = resolve_model(None)
    except ConfigError as e:
        pytest.skip(str(e))
    return load_tokenizer(source)


PROMPT = "<|im_start|>assistant\n"


def stream(tok, text, stop_terminated_id=None, prompt=PROMPT, **params):
    """Feed `text`'s tokens one at a time; return (deltas, detokenizer)."""
    detok = IncrementalDetokenizer(tok, SamplingParams(**params), tok.encode(prompt))
    ids = tok.encode(text, add_special_tokens=False)
    deltas = []
    for i, t in enumerate(ids):
        deltas.append(detok.update([t]))
        if detok.stop_string is not None:
            break
    if stop_terminated_id is not None and detok.stop_string is None:
        deltas.append(detok.update([stop_terminated_id], stop_terminated=True))
    elif detok.stop_string is None:
        deltas.append(detok.flush())
    return deltas, detok


def test_incremental_matches_full_decode_multibyte(tok):
    text = "Grüße, 日本語のテキスト 🙂🦊 naïve — ok!\n  indented"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 4  # some characters span several tokens
    deltas, _ = stream(tok, text)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    # a token that is half a character yields nothing until the rest comes
    assert "" in deltas


def test_unfinished_character_comes_out_at_the_end(tok):
    # the tokens of " 日" without the last byte, then the sequence ends
    ids = tok.encode(" 日本", add_special_tokens=False)[:2]
    detok = IncrementalDetokenizer(tok, SamplingParams(), tok.encode(PROMPT))
    assert [detok.update([t]) for t in ids] == ["", ""]
    assert detok.flush() == tok.decode(ids)  # " \ufffd": the bytes are not lost


def test_invalid_bytes_do_not_stall_the_stream(tok):
    # continuation bytes that can never form a character: emitted, not held forever
    cont = tok.encode("日", add_special_tokens=False)[1]
    detok = IncrementalDetokenizer(tok, SamplingParams(), tok.encode(PROMPT))
    deltas = [detok.update([cont]) for _ in range(12)] + [detok.flush()]
    assert "".join(deltas) == tok.decode([cont] * 12)
    assert sum(1 for d in deltas if d) > 1


def test_first_token_keeps_leading_space(tok):
    deltas, _ = stream(tok, " Hello there")
    assert "".join(deltas) == " Hello there"


def test_stop_string_across_tokens_is_cut_and_never_leaks(tok):
    text = "The answer is 42.</stop> trailing"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "</stop>"
    # the stop string spans several tokens
    assert len(tok.encode(stop, add_special_tokens=False)) > 1
    deltas, detok = stream(tok, text, stop=[stop])
    assert detok.stop_string == stop
    assert "".join(deltas) == "The answer is 42."
    released = ""
    for d in deltas:
        released += d
        assert "The answer is 42.".startswith(released)  # no "<", "</s"... ever shown
    assert detok.num_output_tokens < len(ids)  # stopped before " trailing"


def test_include_stop_str_in_output(tok):
    deltas, detok = stream(tok, "abc STOP def", stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(deltas) == "abc STOP"
    assert detok.stop_string == "STOP"


def test_holdback_is_released_when_the_stop_string_breaks(tok):
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["</answer>"]), tok.encode(PROMPT))
    shown = ""
    for t in tok.encode("x </", add_special_tokens=False):
        shown += detok.update([t])
    assert shown == "x "  # "</" could still become "</answer>"
    for t in tok.encode("ans", add_special_tokens=False):
        shown += detok.update([t])
    assert shown == "x "
    for t in tok.encode("wer2 done", add_special_tokens=False):
        shown += detok.update([t])
    shown += detok.flush()
    assert shown == "x </answer2 done"
    assert detok.stop_string is None


def test_earliest_of_several_stop_strings_wins(tok):
    deltas, detok = stream(tok, "one two three four", stop=["four", "two t"])
    assert detok.stop_string == "two t"
    assert "".join(deltas) == "one "


def test_stop_string_inside_one_token(tok):
    deltas, detok = stream(tok, "Hello world", stop=["ell"])
    assert "".join(deltas) == "H"
    assert detok.stop_string == "ell"


def test_stop_strings_ignored_before_min_tokens(tok):
    deltas, detok = stream(tok, "a b a b c", stop=["a"], min_tokens=2)
    # tokens "a"," b"," a": the first "a" is within min_tokens; the second ends it
    assert detok.stop_string == "a"
    assert "".join(deltas) == "a b "


def test_skip_special_tokens(tok):
    ids = tok.encode("Hi", add_special_tokens=False) + [tok.eos_token_id] + tok.encode(" there", add_special_tokens=False)
    for skip, expected in [(True, "Hi there"), (False, "Hi<|im_end|> there")]:
        detok = IncrementalDetokenizer(tok, SamplingParams(skip_special_tokens=skip), tok.encode(PROMPT))
        text = "".join(detok.update([t]) for t in ids) + detok.flush()
        assert text == expected


def test_eos_text_is_not_output(tok):
    deltas, _ = stream(tok, "Done.", stop_terminated_id=tok.eos_token_id, skip_special_tokens=False)
    assert "".join(deltas) == "Done."


def test_output_processor_stop_string_aborts_and_truncates(tok):
    op = OutputProcessor(tok)
    prompt_ids = tok.encode(PROMPT)
    op.add_request("r1", prompt_ids, SamplingParams(stop=["END"], logprobs=1))
    op.add_request("r2", prompt_ids, SamplingParams(max_tokens=3))
    ids = tok.encode("ok END more", add_special_tokens=False)
    lps = [Logprob(token_ids=[t, 7], logprobs=[-0.5, -0.1], rank=2) for t in ids]
    r2_ids = tok.encode(" fine", add_special_tokens=False)
    res = op.process_outputs(
        [
            EngineCoreOutput("r1", ids, new_logprobs=lps, num_cached_tokens=16),
            EngineCoreOutput("r2", r2_ids, finish_reason=FinishReason.LENGTH),
        ]
    )
    assert res.reqs_to_abort == ["r1"]
    d1, d2 = res.deltas
    assert (d1.text, d1.finish_reason, d1.stop_reason) == ("ok ", "stop", "END")
    end_pos = len(tok.encode("ok END", add_special_tokens=False))
    assert d1.token_ids == ids[:end_pos] and len(d1.logprobs) == end_pos
    assert d1.logprobs[0][ids[0]].rank == 2 and d1.logprobs[0][7].rank == 1
    assert d1.logprobs[0][7].decoded_token == tok.decode([7])
    assert d1.cumulative_logprob == pytest.approx(-0.5 * end_pos)
    assert d1.num_cached_tokens == 16 and d1.num_prompt_tokens == len(prompt_ids)
    assert (d2.text, d2.finish_reason, d2.num_output_tokens) == (" fine", "length", len(r2_ids))
    # later outputs of the stopped request are ignored
    assert op.process_outputs([EngineCoreOutput("r1", [5])]).deltas == []
    assert not op.has_unfinished_requests()


def test_output_processor_eos_and_abort(tok):
    op = OutputProcessor(tok)
    op.add_request("a", [1, 2], SamplingParams())
    op.add_request("b", [1, 2], SamplingParams(stop=["zz"]))
    (d,) = op.process_outputs(
        [EngineCoreOutput("a", tok.encode("Yes", add_special_tokens=False) + [tok.eos_token_id], finish_reason=FinishReason.STOP)]
    ).deltas
    assert (d.text, d.finish_reason, d.stop_reason) == ("Yes", "stop", None)
    (d,) = op.process_outputs([EngineCoreOutput("b", tok.encode("hi z", add_special_tokens=False))]).deltas
    assert d.text == "hi "  # "z" held back
    (d,) = op.abort_requests(["b", "unknown"])
    assert (d.finish_reason, d.text, d.num_output_tokens) == ("abort", "", 2)
