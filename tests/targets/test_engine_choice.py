"""``engine=None`` / ``--engine auto``: the faster engine for a GGUF target, measured once per
machine and file and recorded (:mod:`specwise.targets.engine_choice`); a method that cannot run on
llama.cpp keeps the torch engine."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from specwise.api import engine_for
from specwise.errors import ConfigError
from specwise.methods.draft.drafter import DraftModelConfig
from specwise.targets.engine_choice import check_engine_name, faster_engine


class _Cache:
    def __init__(self) -> None:
        self.length = 0

    def rollback(self, length: int) -> None:
        self.length = min(self.length, length)


class _Timed:
    """A stand-in target whose forward takes ``ms`` milliseconds per call."""

    vocab_size = 32

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def new_cache(self) -> _Cache:
        return _Cache()

    def forward(self, ids, cache, num_logits=None):
        time.sleep(self.ms / 1e3)
        cache.length += ids.numel()
        return SimpleNamespace(logits=torch.zeros(num_logits or 1, self.vocab_size))


def test_the_faster_engine_is_measured_once_and_recorded(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    targets = {"torch": _Timed(4.0), "llamacpp": _Timed(1.0)}
    loaded = []

    def load(engine):
        loaded.append(engine)
        return targets[engine]

    engine, target = faster_engine(gguf, torch.bfloat16, tmp_path, load)
    assert engine == "llamacpp" and target is targets["llamacpp"] and sorted(loaded) == ["llamacpp", "torch"]
    record = json.loads((tmp_path / "engines.json").read_text())
    (timings,) = record.values()
    assert timings["faster"] == "llamacpp" and timings["torch"][0] > timings["llamacpp"][0]
    # the next load reads the record: nothing is loaded to measure
    assert faster_engine(gguf, torch.bfloat16, tmp_path, lambda engine: pytest.fail("measured again")) == ("llamacpp", None)
    # another dtype (or a changed file) is measured anew
    engine, _ = faster_engine(gguf, torch.float32, tmp_path, load)
    assert engine == "llamacpp" and len(loaded) == 4


def test_engine_names():
    assert check_engine_name("auto") is None and check_engine_name(None) is None
    assert check_engine_name("llamacpp") == "llamacpp"
    with pytest.raises(ConfigError, match="unknown engine 'ggml'; choose auto or one of torch, llamacpp"):
        check_engine_name("ggml")


def test_auto_keeps_the_torch_engine_for_a_trained_draft_lm():
    """Gemma-3-270M's shipped ``draft`` drafter is a draft-LM checkpoint (it shares the torch
    target's layers); a GGUF draft model runs on llama.cpp, and other methods are left to measurement."""
    assert engine_for("auto", "draft", DraftModelConfig(), "gemma-3-270m") == "torch"
    assert engine_for("auto", "draft", DraftModelConfig(drafter_path="small.gguf"), "gemma-3-270m") == "auto"
    assert engine_for("auto", "eagle", None, "gemma-3-270m") == "auto"
    assert engine_for("llamacpp", "draft", DraftModelConfig(), "gemma-3-270m") == "llamacpp"
