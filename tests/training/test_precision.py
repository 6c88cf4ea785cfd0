"""The training process's measured choices: matmul precision and freed-memory reuse."""

import subprocess
import sys

import pytest
import torch

from specwise.errors import ConfigError
from specwise.training.precision import PRECISIONS, choose_precision


@pytest.mark.parametrize("requested", ["bf16", "fp32"])
def test_an_explicit_precision_is_kept(requested):
    assert choose_precision(requested, "cpu") == requested


def test_auto_picks_a_precision_by_measurement_on_cpu_and_bf16_on_cuda():
    assert choose_precision("auto", "cpu") in ("bf16", "fp32")
    assert choose_precision("auto", torch.device("cuda")) == "bf16"  # no CUDA needed: nothing runs there
    assert set(PRECISIONS) == {"auto", "bf16", "fp32"}


def test_an_unknown_precision_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="auto, bf16, fp32"):
        choose_precision("fp8", "cpu")


def test_keep_freed_memory_applies_in_a_fresh_process_and_leaves_torch_working():
    # a subprocess: the setting lasts for the process, and the test process should keep its own
    code = ("from specwise.training.precision import keep_freed_memory; import torch; "
            "ok = keep_freed_memory(); x = torch.ones(1 << 24); del x; y = torch.ones(1 << 24); "
            "print(ok, float(y.sum()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    applied, total = out.stdout.split()
    assert float(total) == 1 << 24
    if sys.platform.startswith("linux"):  # glibc
        assert applied == "True"
