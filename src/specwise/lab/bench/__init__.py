"""Benchmarks: methods and Hugging Face peers side by side, interleaved in one process."""

from specwise.lab.bench.contenders import Contender, hf_contender, parse_contender, specwise_contender
from specwise.lab.bench.runner import BenchResult, RunRecord, run_benchmark

__all__ = ["BenchResult", "Contender", "RunRecord", "hf_contender", "parse_contender", "run_benchmark",
           "specwise_contender"]
