"""The server's Prometheus metrics, in a registry of its own (two apps in one process never share one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specwise.drafters.base import held_text_tokens

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)
_BUDGET_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class ServerMetrics:
    """Counters, gauges and histograms of one server (units: seconds, tokens)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specwise_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.generated_tokens = Counter("specwise_generated_tokens", "Tokens committed (counted per step)", registry=r)
        self.draft_tokens = Counter("specwise_draft_tokens", "Draft tokens verified", ["method"], registry=r)
        self.accepted_tokens = Counter("specwise_accepted_tokens", "Draft tokens accepted", ["method"], registry=r)
        self.target_forwards = Counter("specwise_target_forwards", "Target forwards (verification steps and prefills)",
                                       ["method"], registry=r)
        self.prediction_tokens = Counter("specwise_prediction_tokens", "Predicted Outputs tokens, accepted or rejected",
                                         ["outcome"], registry=r)
        self.latency = Histogram("specwise_request_latency_seconds", "Request latency, queueing included",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("specwise_time_to_first_token_seconds",
                                             "Time from the request to its first committed token",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("specwise_queue_depth", "Requests waiting behind the running one", registry=r)
        self.running = Gauge("specwise_running", "Requests generating now (at most --max-batch)", registry=r)
        self.batch_size = Histogram("specwise_batch_size", "Generations in the batch at each capped step",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.draft_budget = Histogram("specwise_draft_budget", "Draft tokens a generation may verify at each "
                                      "capped step (the load rule)", buckets=_BUDGET_BUCKETS, registry=r)
        # a batching target's shared KV pool (read when scraped; see watch_pool)
        self.kv_cells = Gauge("specwise_kv_cells", "Cells of the target's KV pool: its size (total), or held by "
                              "the running generations' reservations (reserved)", ["state"], registry=r)
        self.kv_caches = Gauge("specwise_kv_caches", "Generation caches (sequence ranges) of the KV pool: its "
                               "size (total), or held by running generations (reserved)", ["state"], registry=r)
        self.prefix_kept_tokens = Gauge("specwise_prefix_kept_tokens", "Tokens of finished generations kept in "
                                        "the KV pool for later prompts that share a prefix", registry=r)
        self.suffix_index_tokens = Gauge("specwise_suffix_index_tokens", "Tokens of earlier generations' text "
                                         "the suffix indexes keep, over every tenant", registry=r)
        self.prefix_reused_tokens = Gauge("specwise_prefix_reused_tokens", "Prompt tokens taken from kept "
                                          "sequences instead of decoded, since the server started", registry=r)
        self.batch_rounds = Gauge("specwise_batch_rounds", "Batched rounds (one engine call over every running "
                                  "generation's step) since the server started", registry=r)
        self.batch_seconds = Gauge("specwise_batch_seconds", "Time of the batched rounds since the server started: "
                                   "inside the engine (engine), or from one round's end to the next one's start "
                                   "while generations ran (between: their own work, which each round waits for)",
                                   ["part"], registry=r)

    def watch_index(self, target) -> None:
        """Report the tokens ``target``'s suffix indexes hold (earlier requests' text, every tenant)
        at each scrape."""
        self.suffix_index_tokens.set_function(lambda: held_text_tokens(target))

    def watch_pool(self, target) -> None:
        """Report ``target``'s KV pool (its ``capacity``) and prefix store (``kept_tokens``,
        ``reused_tokens``) at each scrape: a target that batches generations in one pool."""
        capacity = target.capacity
        self.kv_cells.labels("total").set_function(lambda: capacity.cells)
        self.kv_cells.labels("reserved").set_function(lambda: capacity.reserved.cells)
        self.kv_caches.labels("total").set_function(lambda: capacity.caches)
        self.kv_caches.labels("reserved").set_function(lambda: capacity.reserved.caches)
        self.prefix_kept_tokens.set_function(lambda: target.kept_tokens)
        self.prefix_reused_tokens.set_function(lambda: target.reused_tokens)
        times = target.batch_times
        self.batch_rounds.set_function(lambda: times.rounds)
        self.batch_seconds.labels("engine").set_function(lambda: times.engine_s)
        self.batch_seconds.labels("between").set_function(lambda: times.between_s)

    def record_decision(self, batch_size: int, budget: int) -> None:
        """One step's load-rule decision for one generation (:mod:`specwise.engine.load`)."""
        self.batch_size.observe(batch_size)
        self.draft_budget.observe(budget)

    def record_result(self, result) -> None:
        """Add a finished generation's speculation counts."""
        stats = result.stats
        self.draft_tokens.labels(stats.method).inc(stats.drafted_tokens)
        self.accepted_tokens.labels(stats.method).inc(stats.accepted_tokens)
        self.target_forwards.labels(stats.method).inc(stats.target_forwards)
        if stats.prediction_accepted_tokens or stats.prediction_rejected_tokens:
            self.prediction_tokens.labels("accepted").inc(stats.prediction_accepted_tokens)
            self.prediction_tokens.labels("rejected").inc(stats.prediction_rejected_tokens)
