"""Tiny random GGUF models, written by the tests themselves with the ``gguf`` package (F32 weights,
a few hundred KB), for the llama.cpp engine's tests. They carry no tokenizer of their own
(``no_vocab``): the tests give token ids.

The LM head's weights are ``N(0, output_scale / sqrt(hidden))``, so a step's top logit stands clear
of the second (typically by more than 0.1, against F32 rounding of ~1e-5 between a batched and a
one-token forward): greedy choices do not flip between kernels.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def _write(path: Path, arch: str, *, seed: int, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
           ffn: int, context: int, output_scale: float, norm_std: float, layer_norms: tuple[str, ...],
           head_norms: bool, metadata) -> Path:
    """One model of ``arch``: the shared metadata and tensors; ``metadata(writer)`` adds the arch's own keys."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def normal(*shape, std=0.08):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(size):
        return np.ones(size, dtype=np.float32) if norm_std == 0 else normal(size, std=norm_std)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("no_vocab")
    metadata(writer, head_dim)
    writer.add_tensor("token_embd.weight", normal(vocab, hidden, std=1.0 if norm_std == 0 else 0.3))
    for i in range(layers):
        for name in layer_norms:
            writer.add_tensor(f"blk.{i}.{name}.weight", norm(hidden))
        if head_norms:
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", norm(head_dim))
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", norm(head_dim))
        writer.add_tensor(f"blk.{i}.attn_q.weight", normal(heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_k.weight", normal(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_v.weight", normal(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_output.weight", normal(hidden, heads * head_dim))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", normal(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", normal(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", normal(hidden, ffn))
    writer.add_tensor("output_norm.weight", norm(hidden))
    writer.add_tensor("output.weight", normal(vocab, hidden, std=output_scale / hidden ** 0.5))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_llama(path: Path, *, seed: int = 0, vocab: int = 128, hidden: int = 64, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, ffn: int = 128, context: int = 1024,
                     output_scale: float = 6.0) -> Path:
    """A random Llama-shaped model (unit RMS-norm weights). Returns ``path``."""

    def metadata(writer, head_dim):
        writer.add_rope_dimension_count(head_dim)
        writer.add_layer_norm_rms_eps(1e-5)

    return _write(path, "llama", seed=seed, vocab=vocab, hidden=hidden, layers=layers, heads=heads,
                  kv_heads=kv_heads, ffn=ffn, context=context, output_scale=output_scale, norm_std=0.0,
                  layer_norms=("attn_norm", "ffn_norm"), head_norms=False, metadata=metadata)


def write_tiny_gemma3(path: Path, *, seed: int = 0, vocab: int = 128, hidden: int = 64, layers: int = 6,
                      heads: int = 4, kv_heads: int = 1, ffn: int = 128, context: int = 1024, sliding_window: int = 8,
                      output_scale: float = 6.0) -> Path:
    """A random Gemma-3-shaped model: q/k norms, post-attention and post-FFN norms, and sliding-window
    layers (every layer but each sixth attends to the last ``sliding_window`` positions only), so a
    context longer than the window, and a rollback past it, are exercised; a separate ``output``
    tensor (not tied). Returns ``path``."""

    def metadata(writer, head_dim):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_sliding_window(sliding_window)

    return _write(path, "gemma3", seed=seed, vocab=vocab, hidden=hidden, layers=layers, heads=heads,
                  kv_heads=kv_heads, ffn=ffn, context=context, output_scale=output_scale, norm_std=0.1,
                  layer_norms=("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"), head_norms=True,
                  metadata=metadata)
