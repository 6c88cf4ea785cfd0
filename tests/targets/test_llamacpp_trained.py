"""The trained methods on the llama.cpp engine (:mod:`specwise.targets.llamacpp`), on the tiny GGUF
files of :mod:`tiny_gguf`: the tapped hidden states and the parts read from the file equal the torch
engine's on the same file, and EAGLE-3, Medusa and DFlash (random modules, float32) give the
engine's own plain-decoding tokens; a final-layer feature tap, which ggml computes only at logit
rows, is refused.
"""

from __future__ import annotations

import pytest
import torch

import specwise
from conftest import make_tokenizer
from specwise.errors import ConfigError

llamacpp = pytest.importorskip("specwise.targets.llamacpp")
llamacpp_backend = pytest.importorskip("specwise.targets.llamacpp_backend")
if not llamacpp_backend.available():
    pytest.skip("llama-cpp-python is not installed (the [llamacpp] extra)", allow_module_level=True)

from test_llamacpp import NEW, PROMPT, VOCAB, plain_greedy  # noqa: E402
from tiny_gguf import write_tiny_gemma3, write_tiny_llama  # noqa: E402

VOCAB_D = 96


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def files(request, tmp_path_factory, monkeypatch_module):
    write = write_tiny_llama if request.param == "llama" else write_tiny_gemma3
    path = write(tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf")
    return path, llamacpp.LlamaCppTarget(path, make_tokenizer(VOCAB), f"tiny-{request.param}", threads=1)


@pytest.fixture(scope="module")
def monkeypatch_module(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("SPECWISE_CACHE", str(tmp_path_factory.mktemp("cache")))  # the GGUF metadata cache
    yield patch
    patch.undo()


def inner_layers(target) -> tuple[int, ...]:
    """Feature taps below the final state: the embeddings and each inner layer."""
    return tuple(range(0, target.final_layer))


def test_hidden_states_and_borrowed_parts_equal_the_torch_engines(files):
    from transformers import AutoModelForCausalLM

    path, target = files
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    prompt = torch.tensor(PROMPT)
    layers = tuple(range(target.final_layer + 1))
    out = target.forward(prompt, target.new_cache(), num_logits=3, hidden_layers=layers)
    with torch.no_grad():
        ref = reference(prompt[None], output_hidden_states=True)
    for layer in layers:
        ours, theirs = out.hidden_states[layer], ref.hidden_states[layer][0]
        assert ours.shape == theirs.shape
        rows = slice(-3, None) if layer == target.final_layer else slice(None)  # the final state: logit rows only
        assert torch.allclose(ours[rows], theirs[rows], atol=2e-3 * float(theirs.abs().max()), rtol=0), layer
    assert torch.isnan(out.hidden_states[target.final_layer][:-3]).all()
    assert target.text_config.num_hidden_layers == reference.config.num_hidden_layers
    ids = torch.tensor([[3, 7], [11, 2]])
    assert torch.allclose(target.input_embeddings()(ids), reference.get_input_embeddings()(ids), atol=1e-5)
    assert torch.allclose(target.output_rows(torch.tensor([4, 0, 9])),
                          reference.get_output_embeddings().weight[[4, 0, 9]].detach(), atol=1e-6)


def _eagle(target):
    from specwise.methods.eagle.drafter import EagleDrafter, EagleDrafterConfig
    from specwise.methods.eagle.network import EagleConfig, EagleHead

    torch.manual_seed(0)
    vocab = torch.randperm(target.vocab_size)[:VOCAB_D]
    config = EagleConfig(feature_layers=inner_layers(target), draft_vocab_size=VOCAB_D, num_heads=2, head_dim=16,
                         intermediate_size=64)
    head = EagleHead(target, config, vocab).to(target.dtype).eval().requires_grad_(False)
    return EagleDrafter(target, EagleDrafterConfig(min_path_prob=0.0), head=head)


def _medusa(target):
    from specwise.methods.medusa.drafter import MedusaDrafter, MedusaDrafterConfig
    from specwise.methods.medusa.network import MedusaConfig, MedusaHeads

    torch.manual_seed(0)
    vocab = torch.randperm(target.vocab_size)[:VOCAB_D]
    heads = MedusaHeads(target, MedusaConfig(num_heads=3, draft_vocab_size=VOCAB_D), vocab)
    heads = heads.to(target.dtype).eval().requires_grad_(False)
    return MedusaDrafter(target, MedusaDrafterConfig(min_path_prob=0.0), heads=heads)


def _dflash(target):
    from specwise.methods.dflash.drafter import DFlashDrafter, DFlashDrafterConfig
    from specwise.methods.dflash.network import DFlashConfig, DFlashModel

    torch.manual_seed(0)
    vocab = torch.randperm(target.vocab_size)[:VOCAB_D]
    config = DFlashConfig(feature_layers=inner_layers(target), draft_vocab_size=VOCAB_D, block_size=4, num_layers=1,
                          num_heads=2, head_dim=16, intermediate_size=64)
    model = DFlashModel(target, config, vocab).to(target.dtype).eval().requires_grad_(False)
    return DFlashDrafter(target, DFlashDrafterConfig(min_path_prob=0.0, tree_top_k=2), model=model)


@pytest.mark.parametrize("make", [_eagle, _medusa, _dflash], ids=["eagle", "medusa", "dflash"])
def test_trained_methods_are_greedy_exact(files, make):
    _, target = files
    truth, gap = plain_greedy(target, PROMPT, NEW)
    result = specwise.generate(target, PROMPT, drafter=make(target), max_new_tokens=NEW)
    assert result.token_ids == truth, f"smallest top-two gap {gap:.3f}"
    assert result.stats.drafted_tokens > 0


def test_auto_switching_into_a_trained_drafter_recomputes_its_hidden_states(files):
    """On llama.cpp ``auto`` asks for no taps while a candidate that reads none runs; probing
    pld -> eagle -> medusa -> ar (2 steps each) recomputes them at the switch to EAGLE, and the
    output is still the engine's own plain decoding."""
    from specwise.methods.auto.drafter import AutoConfig, AutoDrafter
    from specwise.methods.auto.profile import AutoProfile
    from specwise.methods.autoregressive import AutoregressiveConfig, AutoregressiveDrafter
    from specwise.methods.prompt_lookup import PromptLookupConfig, PromptLookupDrafter

    _, target = files
    truth, gap = plain_greedy(target, PROMPT, NEW)
    candidates = {"pld": PromptLookupDrafter(target, PromptLookupConfig()), "eagle": _eagle(target),
                  "medusa": _medusa(target), "ar": AutoregressiveDrafter(target, AutoregressiveConfig())}
    auto = AutoDrafter(target, AutoConfig(remember=False, probe_steps=2, decide_every=2), candidates=candidates,
                       profile=AutoProfile(None))
    assert auto.skip_taps
    result = specwise.generate(target, PROMPT, drafter=auto, max_new_tokens=NEW)
    assert result.token_ids == truth, f"smallest top-two gap {gap:.3f}"
    assert [m for m, _ in result.stats.method_steps[:4]] == ["pld", "eagle", "medusa", "ar"]


def test_tree_budgets_default_by_engine_and_a_given_one_is_kept(files):
    """``min_path_prob`` left unset takes the engine's default (a verified row costs ggml a pass over
    the LM head, so fewer nodes pay); a value the user gives is used as given."""
    from specwise.methods.eagle.drafter import EagleDrafterConfig
    from specwise.methods.medusa.drafter import MedusaDrafterConfig

    _, target = files
    for config_cls in (MedusaDrafterConfig, EagleDrafterConfig):
        by_engine = config_cls.ENGINE_DEFAULTS["min_path_prob"]
        assert config_cls().min_path_prob is None
        assert config_cls().for_engine("llamacpp").min_path_prob == by_engine["llamacpp"] > by_engine["torch"]
        assert config_cls().for_engine("an engine not listed").min_path_prob == by_engine["torch"]
        assert config_cls(min_path_prob=0.05).for_engine("llamacpp").min_path_prob == 0.05
    assert _medusa(target).config.min_path_prob == 0.0
    assert _medusa_default(target).config.min_path_prob == MedusaDrafterConfig.ENGINE_DEFAULTS["min_path_prob"]["llamacpp"]


def _medusa_default(target):
    from specwise.methods.medusa.drafter import MedusaDrafter, MedusaDrafterConfig
    from specwise.methods.medusa.network import MedusaConfig, MedusaHeads

    heads = MedusaHeads(target, MedusaConfig(num_heads=3, draft_vocab_size=VOCAB_D), torch.arange(VOCAB_D))
    return MedusaDrafter(target, MedusaDrafterConfig(), heads=heads.to(target.dtype).eval().requires_grad_(False))


def test_a_final_layer_feature_is_refused_in_one_sentence(files):
    from specwise.methods.eagle.network import EagleConfig, EagleHead

    _, target = files
    config = EagleConfig(feature_layers=(target.final_layer,), draft_vocab_size=VOCAB_D)
    with pytest.raises(ConfigError, match="final hidden state") as info:
        EagleHead(target, config, torch.arange(VOCAB_D))
    assert "\n" not in str(info.value)


def test_the_file_is_read_once_then_from_the_cache(files, monkeypatch):
    from specwise.targets import gguf_parts

    path, _ = files
    first = gguf_parts.metadata_dir(path)
    monkeypatch.setattr(gguf_parts, "GGUFReader", None)  # a second read of the file would fail
    assert gguf_parts.metadata_dir(path) == first and (first / "tensors.json").exists()
    assert gguf_parts.GGUFParts(path).text_config.hidden_size == 64
