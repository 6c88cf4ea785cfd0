"""Every bad input of the README's list, through both ``specwise.generate`` and the CLI.

Each row is one input the user can get wrong. Through the API it raises a :class:`SpecwiseError`
whose message is one sentence; through ``specwise generate`` (on a tiny model directory) it prints
that one sentence on stderr and exits with code 2, never a traceback. The README's bad-input list
names exactly these rows (``test_the_readme_lists_every_row``).
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from unittest import mock

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import specwise
from conftest import make_model, make_tokenizer
from specwise.cli import main
from specwise.errors import ConfigError, PromptError, SpecwiseError, TargetLoadError
from specwise.targets.hf import Target

README = Path(__file__).resolve().parents[1] / "README.md"
PROMPT_TEXT = "t5 t6 t7 t8"
PROMPT_IDS = [5, 6, 7, 8]


@dataclass(frozen=True)
class BadInput:
    name: str  # as the README's bad-input list names it
    error: type[SpecwiseError]
    match: str  # a word the message must contain
    api: Callable[[Target, Path], object]  # the input through the Python API
    cli: list[str] | None  # `specwise generate` flags and prompt, None where the CLI cannot express it
    device_fails: bool = False  # moving the loaded model to its device raises (mocked)


def _generate(**kwargs) -> Callable[[Target, Path], object]:
    prompt = kwargs.pop("prompt", PROMPT_IDS)
    return lambda target, _dir: specwise.generate(target, prompt, max_new_tokens=4, **kwargs)


def _drafter_path_with_ar(target: Target, model_dir: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the old spelling of drafter_path
        return specwise.generate(target, PROMPT_IDS, drafter=str(model_dir), max_new_tokens=4)


ROWS = [
    BadInput("stop=None", ConfigError, "stop", _generate(stop=None), None),
    BadInput("a temperature that is not a number", ConfigError, "temperature", _generate(temperature="0.7"), None),
    BadInput("a top-p that is not a number", ConfigError, "top-p", _generate(top_p="0.9"), None),
    BadInput("a non-finite temperature", ConfigError, "temperature", _generate(temperature=math.inf),
             ["--temperature", "inf", PROMPT_TEXT]),
    BadInput("an absurdly small temperature", ConfigError, "temperature", _generate(temperature=1e-40),
             ["--temperature", "1e-40", PROMPT_TEXT]),
    BadInput("a non-finite repetition penalty", ConfigError, "penalty",
             _generate(repetition_penalty=math.inf, temperature=0.7),
             ["--repetition-penalty", "inf", "--temperature", "0.7", PROMPT_TEXT]),
    BadInput("a seed outside [0, 2**64)", ConfigError, "seed", _generate(seed=2**64, temperature=0.7),
             ["--seed", str(2**64), "--temperature", "0.7", PROMPT_TEXT]),
    BadInput("a prompt that is not valid UTF-8", PromptError, "UTF-8", _generate(prompt="t5 \udcff t6"),
             ["t5 \udcff t6"]),  # what Python makes of invalid UTF-8 in argv (surrogateescape)
    BadInput("an empty prompt", PromptError, "empty", _generate(prompt="  "), ["  "]),
    BadInput("a prompt that is a number", PromptError, "got int", _generate(prompt=5), None),
    BadInput("a prompt of bytes", PromptError, "got bytes", _generate(prompt=b"t5 t6"), None),
    BadInput("a prompt that is a range", PromptError, "got range", _generate(prompt=range(5, 9)), None),
    BadInput("a prompt that is a numpy array", PromptError, ".tolist()", _generate(prompt=np.array(PROMPT_IDS)),
             None),
    BadInput("a prompt that is a dict", PromptError, "got dict", _generate(prompt={"ids": PROMPT_IDS}), None),
    BadInput("a nested list of token ids", PromptError, "batch size 1", _generate(prompt=[PROMPT_IDS]), None),
    BadInput("a float among the token ids", PromptError, "item 1 is a float", _generate(prompt=[5, 6.0, 7]), None),
    BadInput("a bool among the token ids", PromptError, "item 2 is a bool", _generate(prompt=[5, 6, True]), None),
    BadInput("a numpy integer among the token ids", PromptError, "numpy.int64",
             _generate(prompt=[5, np.int64(6)]), None),
    BadInput("a token id outside the vocabulary", PromptError, "vocabulary", _generate(prompt=[5, 10**6]), None),
    BadInput("an empty list of token ids", PromptError, "empty", _generate(prompt=[]), None),
    BadInput("a 0-D prompt tensor", PromptError, "0-D", _generate(prompt=torch.tensor(5)), None),
    BadInput("a 2-D prompt tensor", PromptError, "shape [2, 2]", _generate(prompt=torch.tensor([[5, 6], [7, 8]])),
             None),
    BadInput("a float prompt tensor", PromptError, "float32", _generate(prompt=torch.tensor([5.0, 6.0])), None),
    BadInput("a bool prompt tensor", PromptError, "bool", _generate(prompt=torch.tensor([True, False])), None),
    BadInput("a prediction that is not text or token ids", PromptError, "the prediction",
             _generate(prediction={"text": "t5"}), None),
    BadInput("chat messages for a target without a chat template", PromptError, "chat template",
             lambda target, _dir: specwise.generate(target, messages=[{"role": "user", "content": PROMPT_TEXT}],
                                                    max_new_tokens=4),
             ["--chat", PROMPT_TEXT]),
    BadInput("a drafter path with a method that takes none", ConfigError, "uses no trained drafter", _drafter_path_with_ar,
             ["--drafter", "{model_dir}", PROMPT_TEXT]),
    BadInput("native weights for a target that is not a GGUF file", ConfigError, "GGUF",
             lambda _target, model_dir: specwise.load_target(model_dir, dtype="float32", device="cpu", weights="native"),
             ["--weights", "native", PROMPT_TEXT]),
    BadInput("an unknown weights value", ConfigError, "weights",
             lambda _target, model_dir: specwise.load_target(model_dir, weights="int3"), None),
    BadInput("a device that cannot take the model", TargetLoadError, "out of memory",
             lambda _target, model_dir: specwise.load_target(model_dir, dtype="float32", device="cpu"),
             [PROMPT_TEXT], device_fails=True),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-target")
    make_model("llama").to(torch.float32).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(model_dir) -> Target:
    return specwise.load_target(model_dir, dtype="float32", device="cpu")


@pytest.fixture
def device_fails(request, monkeypatch):
    """When the row asks for it, every loaded model fails to move to its device, as out of memory would."""
    if request.param:
        load = AutoModelForCausalLM.from_pretrained

        def failing(*args, **kwargs):
            model = load(*args, **kwargs)
            model.to = mock.Mock(side_effect=RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"))
            return model

        monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", failing)


def _one_sentence(message: str) -> None:
    assert "\n" not in message and message.rstrip().endswith("."), f"not one sentence: {message!r}"
    assert "Traceback" not in message


@pytest.mark.parametrize("row, device_fails", [(r, r.device_fails) for r in ROWS], ids=[r.name for r in ROWS],
                         indirect=["device_fails"])
def test_bad_input_through_the_api(row, device_fails, target, model_dir):
    with pytest.raises(row.error, match=re.escape(row.match)) as info:
        row.api(target, model_dir)
    _one_sentence(str(info.value))


@pytest.mark.parametrize("row, device_fails", [(r, r.device_fails) for r in ROWS if r.cli],
                         ids=[r.name for r in ROWS if r.cli], indirect=["device_fails"])
def test_bad_input_through_the_cli(row, device_fails, model_dir, capsys):
    flags = [arg.format(model_dir=model_dir) for arg in row.cli]
    code = main(["generate", "--target", str(model_dir), "--dtype", "float32", "--device", "cpu",
                 "--max-new-tokens", "4", *flags])
    captured = capsys.readouterr()
    assert code == 2, captured
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("specwise: error: "), captured.err
    assert row.match in lines[0]
    _one_sentence(lines[0])


def test_the_readme_lists_every_row():
    """The README's bad-input list is this table: one item per row, in order, separated by semicolons."""
    section = README.read_text().split("Bad input, each refused with one sentence", 1)[1].split("\n\n", 1)[0]
    listed = [item.strip().rstrip(".") for item in " ".join(section.split(":", 1)[1].split()).split(";")]
    assert listed == [row.name for row in ROWS]
