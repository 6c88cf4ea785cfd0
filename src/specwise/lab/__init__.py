"""Lab tools built on the public API: the benchmark harness, the speedup analysis and its plots,
the demo, and the CLI's stats tables. The engine, drafters and training never import them."""
