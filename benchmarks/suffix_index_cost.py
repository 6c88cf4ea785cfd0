"""What the suffix index costs: memory per token held, time to add a token, time per lookup, on
262,144 tokens of Zipf-distributed text over a 150k vocabulary in 300-token texts.

    python benchmarks/suffix_index_cost.py
"""

import random
import time
import tracemalloc

from specwise.methods.suffix.index import SuffixIndex

random.seed(0)
weights = [1 / (rank + 1) for rank in range(150_000)]
tokens = random.choices(range(150_000), weights=weights, k=300_000)
tracemalloc.start()
index = SuffixIndex(262_144)
start = time.perf_counter()
for first in range(0, len(tokens), 300):
    index.add(tokens[first:first + 300])
took = time.perf_counter() - start
size, peak = tracemalloc.get_traced_memory()
print(f"{index.size} tokens held, {size / 2**20:.1f} MiB ({size / index.size:.0f} B/token), peak {peak / 2**20:.1f} MiB, "
      f"{took / len(tokens) * 1e6:.2f} us/token added (dropping included)")
query = tokens[:2] + tokens[-50:-40]
start = time.perf_counter()
for _ in range(1000):
    index.longest_match(query, 2, 32, 16)
print(f"lookup {(time.perf_counter() - start) / 1000 * 1e6:.0f} us")
