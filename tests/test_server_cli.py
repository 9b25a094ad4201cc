"""`serval serve` start-up: flag errors name the flag and stop before
anything loads; the API process never loads torch (its engine child does)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from server.cli import build_parser, main
from server_util import REPO_ROOT


@pytest.mark.parametrize("argv,flag", [
    (["--block-size", "3"], "--block-size"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-num-seqs", "many"], "--max-num-seqs"),
    (["--max-model-len", "-1"], "--max-model-len"),
    (["--kv-cache-memory", "0"], "--kv-cache-memory"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--dtype", "int3"], "--dtype"),
    (["--device", "tpu"], "--device"),
    (["--load-format", "pickle"], "--load-format"),
    (["--port", "70000"], "--port"),
    (["--max-queued-requests", "-1"], "--max-queued-requests"),
    (["--model", "/nonexistent/model"], "--model"),
    (["--chat-template", "/nonexistent/template.jinja"], "--chat-template"),
    (["--log-level", "loud"], "--log-level"),
])
def test_bad_flag_fails_naming_it(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["serve", *argv]))
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_busy_port_fails_naming_it(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert "--port" in capsys.readouterr().err


def test_defaults_serve_the_embedded_model_on_localhost_8000():
    args = build_parser().parse_args(["serve"])
    assert (args.model, args.host, args.port) == (None, "127.0.0.1", 8000)


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    assert "serve" in capsys.readouterr().out


def test_api_modules_do_not_import_torch():
    code = ("import sys, server.cli, server.app, server.engine_client, server.serving_chat, "
            "server.serving_completions, server.metrics, server.tokenizer; "
            "from server.cli import build_parser; build_parser(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_running_api_process_has_no_torch(tiny_server):
    # the engine process (the check's positive control) maps libtorch; the API process must not
    assert "libtorch" in _maps(tiny_server.engine_pid)
    assert "libtorch" not in _maps(tiny_server.proc.pid)
