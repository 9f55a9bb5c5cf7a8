"""Model runners: one per device kind, behind ``base.ModelRunner``."""

from __future__ import annotations

import torch

from inference.config import EngineConfig
from inference.device import default_device
from inference.kernels.cpu import build
from inference.runner.base import ModelRunner, RunnerOutput


def make_runner(config: EngineConfig) -> ModelRunner:
    """The runner for the configured device (CUDA where torch sees one, else the CPU)."""
    device = torch.device(config.device) if config.device else default_device()
    if device.type == "cuda":
        from inference.runner.cuda_runner import CUDARunner

        return CUDARunner(config, device)
    if device.type != "cpu":
        raise ValueError(f"no runner for device {device}: docqa runs on cpu or cuda")
    from inference.runner.cpu_runner import CPURunner

    return CPURunner(config)


def prebuild_kernels(device: str | None = None) -> None:
    """Start building the compiled kernels the device runs where this machine lacks them
    (CPU kernels, each in a thread of its own); returns at once."""
    if (torch.device(device) if device else default_device()).type == "cpu":
        build.prebuild()


__all__ = ["ModelRunner", "RunnerOutput", "make_runner", "prebuild_kernels"]
