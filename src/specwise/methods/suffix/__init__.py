"""Suffix decoding: the drafter and its bounded index of token texts (this context's and earlier requests')."""
