"""Trainable drafter networks. Each wraps Hugging Face modules built from the target's own config."""
