"""GPU-only tests (run by bench/gpu/run_device_checks.sh, never by CI: this folder is not in
pyproject's testpaths). Without CUDA the run refuses to start instead of skipping. Every
test's outcome and the figures tests record go to $OUT/gpu_checks.json."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import pytest
import torch

RESULTS: dict[str, Any] = {"started_unix_s": time.time(), "tests": {}, "figures": {}}


def pytest_configure(config: pytest.Config) -> None:
    if not torch.cuda.is_available() and not config.option.collectonly:
        raise pytest.UsageError("tests_gpu/ needs a CUDA device: run bench/gpu/run_device_checks.sh on a GPU machine")
    RESULTS["env"] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                      "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        entry: dict[str, Any] = {"outcome": report.outcome, "when": report.when, "duration_s": round(report.duration, 3)}
        if report.failed:
            entry["error"] = str(report.longrepr)[-3000:]
        RESULTS["tests"][report.nodeid] = entry


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    RESULTS["exit_status"] = int(exitstatus)
    out = Path(os.environ.get("OUT") or "/tmp/kvstore-gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_checks.json").write_text(json.dumps(RESULTS, indent=2, default=str))


@pytest.fixture
def figures() -> dict[str, Any]:
    """Figures a test measured (units in the names), written to the JSON."""
    return RESULTS["figures"]
