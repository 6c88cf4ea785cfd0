"""A trained method is one folder: ``tests/methods/method_folders/bigram`` (a test-only method) is found by
the method registry, ``specwise train``'s recipes, ``specwise export``'s formats and format
detection once its directory joins ``specwise.methods.__path__``; nothing else is edited."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import specwise
import specwise.methods
from conftest import make_target, random_prompt
from specwise.discovery import method_modules
from specwise.drafters.base import METHODS
from specwise.drafters.export import export_drafter, export_formats
from specwise.interop.formats import detect
from specwise.methods.auto.drafter import default_candidates
from specwise.prompts import PromptRecord
from specwise.training.corpus import CorpusConfig, build_corpus
from specwise.training.pipeline import TrainingJob
from specwise.training.recipes import RECIPES, get_recipe, recipe_names

FOLDERS = Path(__file__).parent / "method_folders"


@pytest.fixture
def bigram_folder():
    """The folder joined for one test, and what it registered taken back after it (only that: the
    lookups inside the test register the package's own methods and recipes too, and those stay)."""
    specwise.methods.__path__.append(str(FOLDERS))
    try:
        yield
    finally:
        specwise.methods.__path__.remove(str(FOLDERS))
        METHODS._specs.pop("bigram", None)
        RECIPES._specs.pop("bigram", None)
        for name in [name for name in sys.modules if name.startswith("specwise.methods.bigram")]:
            del sys.modules[name]


def test_the_package_has_a_folder_per_trained_method_and_a_module_per_other():
    drafters = method_modules("drafter")
    for name in ("draft", "eagle", "medusa", "dflash", "auto"):
        assert f"specwise.methods.{name}.drafter" in drafters
    for name in ("autoregressive", "prompt_lookup", "lookahead"):
        assert f"specwise.methods.{name}" in drafters
    assert method_modules("recipe") == [f"specwise.methods.{name}.recipe" for name in ("dflash", "draft", "eagle", "medusa")]
    assert export_formats() == {"dflash": ("speculators",), "eagle": ("speculators", "eagle3"), "medusa": ("medusa",)}


def test_a_trained_method_is_one_folder(bigram_folder, tmp_path):
    assert "bigram" in METHODS.names() and METHODS.get("bigram").needs_weights
    assert "bigram" in recipe_names() and "bigram" not in default_candidates()  # registered auto_candidate=False
    assert export_formats()["bigram"] == ("bigram-json",)

    target = make_target("llama")
    records = [PromptRecord(f"c/p{i}", "c", " ".join(f"t{int(x)}" for x in random_prompt(6, seed=i))) for i in range(6)]
    build_corpus(target, records, tmp_path / "corpus", CorpusConfig(new_tokens=12, batch_size=3))
    trained = get_recipe("bigram").train(TrainingJob("bigram", target, tmp_path / "corpus", tmp_path / "bigram", print),
                                         get_recipe("bigram").options_cls())
    prompt = random_prompt(8, seed=1)
    reference = specwise.generate(target, prompt, method="ar", max_new_tokens=16)
    result = specwise.generate(target, prompt, method="bigram", drafter_path=str(trained), max_new_tokens=16)
    assert result.token_ids == reference.token_ids
    assert result.stats.drafted_tokens > 0

    exported = export_drafter(target, tmp_path / "export", "bigram-json", path=trained)
    assert detect(exported.path).method == "bigram"
    again = specwise.generate(target, prompt, method="bigram", drafter_path=str(exported.path), max_new_tokens=16)
    assert again.token_ids == reference.token_ids and again.stats.accepted_tokens == result.stats.accepted_tokens


def test_a_folder_that_left_takes_its_method_with_it(bigram_folder):
    assert "bigram" in METHODS.names()


def test_and_the_registries_are_as_before_without_it():
    assert "bigram" not in METHODS.names() and "bigram" not in recipe_names()
