"""What the bench scripts share: a description of the host for a result's
"host" field, and writing a result file."""

from __future__ import annotations

import json
import os
import platform


def cpu_name(fallback: str) -> str:
    """The CPU's model name from /proc/cpuinfo ("AMD EPYC 9654 96-Core
    Processor"), or `fallback` where there is none (no /proc, or an ARM
    cpuinfo without a "model name" line)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), fallback)
    except OSError:
        return fallback


def cpu_description() -> str:
    """'AMD EPYC 9654 96-Core Processor, 16 cores'."""
    return f"{cpu_name(platform.machine())}, {os.cpu_count()} cores"


def cpu_python_description() -> str:
    """'AMD EPYC 9654 96-Core Processor, 16 cores, Python 3.12.3, Linux': the
    host of a pure-Python timing (the scheduler, the runner's host overhead)."""
    cpu = cpu_name(platform.processor() or platform.machine())
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()}"


def write_result(path: str, result: dict) -> None:
    """Write `result` as indented JSON with a final newline, creating the
    folder if needed, and say where."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {path}")
