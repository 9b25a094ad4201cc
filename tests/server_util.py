"""Helpers for the server tests: a tiny chat model with a real tokenizer, and
the real `serval serve` run as a subprocess on a free loopback port.

    model_dir = make_tiny_chat_model(tmp_path / "tiny")
    with ServerProcess(["--model", str(model_dir), "--kv-cache-memory", "0.01"]) as server:
        httpx.get(server.url("/health"))
        server.engine_pid  # from the start-up banner
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Serval is a wild cat of Africa.\n"
    "Hello world! How are you today? I am fine, thank you. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100.\n"
    "Once upon a time there was a small model that answered every question with a story.\n"
)
TINY_VOCAB = 384


def make_tiny_tokenizer(path: str | os.PathLike) -> Path:
    """A byte-level BPE tokenizer of TINY_VOCAB tokens (ChatML special tokens
    at 0..2, EOS = <|im_end|> = 2) with a ChatML chat template, saved as
    tokenizer.json + tokenizer_config.json. Built in well under a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((_CORPUS * 20).splitlines(), trainer)
    assert tok.get_vocab_size() == TINY_VOCAB, tok.get_vocab_size()
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "bos_token": None,
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def make_tiny_chat_model(path: str | os.PathLike, **overrides: Any) -> Path:
    """A tiny random Llama checkpoint whose vocabulary is the tiny tokenizer's."""
    from models_util import make_tiny_checkpoint

    values = dict(vocab_size=TINY_VOCAB, bos_token_id=1, eos_token_id=2, max_position_embeddings=1024)
    values.update(overrides)
    path = make_tiny_checkpoint("LlamaForCausalLM", path, **values)
    make_tiny_tokenizer(path)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m server.cli serve ARGS --host 127.0.0.1 --port <free>`,
    waited for until /health answers 200; output goes to a log file that a
    failing start shows."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, startup_timeout: float = 180.0):
        self.port = free_port()
        self.host = "127.0.0.1"
        self.args = [sys.executable, "-m", "server.cli", "serve", *args, "--host", self.host, "--port", str(self.port)]
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.startup_timeout = startup_timeout
        self.log = tempfile.NamedTemporaryFile(prefix="serval-server-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None
        self.engine_pid: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.args, cwd=REPO_ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.output()}")
            try:
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        else:
            self.stop()
            raise RuntimeError(f"server did not become healthy in {self.startup_timeout} s:\n{self.output()}")
        m = re.search(r"engine core pid (\d+)", self.output())
        self.engine_pid = int(m.group(1)) if m else None
        return self

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        if exc[0] is None:
            os.unlink(self.log.name)


def metrics(server: ServerProcess) -> dict[str, float]:
    """/metrics as {"name{label=value,...}": value} (labels sorted, model_name dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    text = httpx.get(server.url("/metrics"), timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
