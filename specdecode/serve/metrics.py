"""Prometheus metrics of the server (prometheus-client), named so a vLLM dashboard reads them.

vLLM's series keep their names and labels under our prefix ``specdecode:`` (vLLM's is
``vllm:``): the speculative-decoding counters ``spec_decode_num_drafts``,
``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` and
``spec_decode_num_accepted_tokens_per_pos{position}``, and the request series
``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
``e2e_request_latency_seconds`` (vLLM's bucket boundaries), ``num_requests_running``,
``num_requests_waiting``, ``prompt_tokens``, ``generation_tokens``,
``request_success{finished_reason}``, the per-request histograms (prompt and generation
tokens, max_tokens, queue, prefill, decode and inference time, time per output token),
``time_per_output_token_seconds`` and ``kv_cache_usage_perc``; every series carries
``model_name``. vLLM's Grafana dashboard reads ours after replacing ``vllm:`` with
``specdecode:`` (docs/serving.md).

Ours, by task type (the router's label): acceptance, mean accepted length, seconds saved
against plain decoding (estimated from the cost profile), and acceptance drift: over the
last drafted steps, the steps whose first draft was accepted divided by the number the
calibrated first-draft acceptance of each step's drafter expected, so a domain shift that
collapses acceptance shows as a drop below 1.
"""

from __future__ import annotations

import threading
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.metrics_core import Metric

disable_created_metrics()  # as vLLM does: no *_created series beside every counter

PREFIX = "specdecode:"
# vLLM's boundaries (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
REQUEST_LATENCY_BUCKETS = E2E_BUCKETS  # vLLM's for queue, prefill, decode and inference time
TPOT_BUCKETS = ITL_BUCKETS
DRIFT_WINDOW = 512  # drafted steps per task in the drift window


def one_two_five_buckets(largest: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``largest``."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > largest:
                return buckets
            buckets.append(value)
        exponent += 1


class ServerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, positions: int = 0,
                 max_model_len: int = 8192):
        """``positions``: the most draft tokens a step may score; their per-position series
        exist from the start, at 0, as vLLM creates them. ``max_model_len`` bounds the
        token-count histograms' buckets, as vLLM's."""
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self.constant_labels: dict[str, str] = {}  # on every sample of the exposition (a replica's name)
        r, m = self.registry, ["model_name"]

        def counter(name, doc, labels=()):
            return Counter(PREFIX + name, doc, m + list(labels), registry=r)

        def gauge(name, doc, labels=()):
            return Gauge(PREFIX + name, doc, m + list(labels), registry=r)

        self.num_drafts = counter("spec_decode_num_drafts", "Steps that scored at least one draft token")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens scored")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by draft position (0-based)", ["position"])
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token", m, buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens (a step's tokens "
                             "share its gap)", m, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to finish", m,
                             buckets=E2E_BUCKETS, registry=r)
        self.running = gauge("num_requests_running", "Sequences in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests queued for a batch row")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.success = counter("request_success", "Finished requests", ["finished_reason"])
        # per finished request, vLLM's histograms (its names, buckets and meanings)
        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, m, buckets=buckets, registry=r)

        tokens = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request", tokens)
        self.request_generation_tokens = histogram("request_generation_tokens", "Tokens generated per request", tokens)
        self.request_max_generation = histogram("request_max_num_generation_tokens", "Tokens generated per request "
                                                "(vLLM: the most over its n sequences; here each choice is one)", tokens)
        self.request_max_tokens = histogram("request_params_max_tokens", "The max_tokens request parameter", tokens)
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting for a batch row",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from getting a row to the first token",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Time from the first token to the last",
                                     REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Time from getting a row to the last token",
                                         REQUEST_LATENCY_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds", "Decode time per output token after "
                                      "the first, per request", TPOT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "The inter-token gaps again, under vLLM's deprecated "
                              "name (its dashboard reads it)", TPOT_BUCKETS)
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of the KV cache's token slots the running sequences hold "
                              "(0 to 1)")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache")
        # ours, by task type
        task = ["task_type"]
        self.task_drafted = counter("task_draft_tokens", "Draft tokens scored, by task type", task)
        self.task_accepted = counter("task_accepted_tokens", "Draft tokens accepted, by task type", task)
        self.task_acceptance = gauge("task_acceptance_rate", "Accepted / drafted since start, by task type", task)
        self.task_tau = gauge("task_mean_accepted_length", "Tokens per target pass that scored a draft (1 + "
                              "accepted / drafts, as vLLM's mean acceptance length), by task type",
                              task)
        self.task_saved = gauge("task_seconds_saved", "Estimated decode seconds saved against plain decoding "
                                  "(cost profile), by task type, over requests decoded alone (a batch's saving is "
                                  "batching's); negative when speculation lost", task)
        self.decode_threads = gauge("decode_kernel_threads", "Kernel threads decode passes run on, as measured "
                                    "fastest, by kind of pass (alone: one sequence, one token; drafts: one sequence scoring drafts; batch)", ["kind"])
        self.drift = gauge("acceptance_drift", "First-draft acceptance over the last drafted steps / calibrated "
                           "first-draft acceptance, by task type (1 = as calibrated)", task)
        self.audit_checked = counter("audit_requests", "Requests re-run with plain decoding and compared (greedy, and sampled with the seed they drew)")
        self.audit_mismatch = counter("audit_mismatches", "Audited requests whose output differed from plain decoding")
        self.audit_pending = gauge("audit_pending", "Audits waiting for an idle engine or re-running now")
        self._lock = threading.Lock()
        self._task_totals: dict[str, list[float]] = {}  # task -> [drafted, accepted, drafted steps]
        self._windows: dict[str, deque] = {}
        for reason in ("stop", "length", "abort"):  # every reason's series from the start, at 0, as vLLM
            self.labels(self.success, finished_reason=reason)
        for position in range(positions):
            self.labels(self.accepted_per_pos, position=str(position))
        # every series at 0 from the start, as vLLM creates them: a rate over them reads 0 rather
        # than nothing, and the first interval's increase is not lost (found in review: the
        # drafting counters, the gauges, the cache counters and the histograms were missing)
        for metric in (self.audit_checked, self.audit_mismatch, self.prompt_tokens, self.generation_tokens,
                       self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.prefix_queries,
                       self.prefix_hits, self.running, self.waiting, self.kv_usage,
                       *(value for value in vars(self).values() if isinstance(value, Histogram))):
            self.labels(metric)

    def labels(self, metric, **labels):
        return metric.labels(model_name=self.model_name, **labels)

    def step(self, drafted: int, accepted: int, task: str | None, prior: float | None = None) -> None:
        """One verification pass of one sequence; ``prior``: its drafter's calibrated
        first-draft acceptance (None: not calibrated, the step stays out of the drift)."""
        if drafted:
            self.labels(self.num_drafts).inc()
            self.labels(self.num_draft_tokens).inc(drafted)
            self.labels(self.num_accepted_tokens).inc(accepted)
            for position in range(accepted):
                self.labels(self.accepted_per_pos, position=str(position)).inc()
        if not drafted:  # a plain pass: nothing to count for acceptance (vLLM's definitions)
            return
        task = task or "unknown"
        with self._lock:
            totals = self._task_totals.setdefault(task, [0.0, 0.0, 0.0])
            totals[0] += drafted
            totals[1] += accepted
            totals[2] += 1
            # the drift window holds whether each step's first draft was accepted: the
            # calibrated prior it is compared with is the first draft's rate (a window of
            # every drafted token read about 0.8 where nothing had changed, found in review),
            # beside that step's own prior: a task drafted by two drafters (the configured one
            # and ngram, which every server offers) was divided by the prior of whichever
            # finished last (found in review: 1.86 and 0.58 for one window)
            if prior:
                self._windows.setdefault(task, deque(maxlen=DRIFT_WINDOW)).append((1 if accepted else 0, prior))
            acceptance = totals[1] / totals[0]
            tau = 1 + totals[1] / totals[2]
        self.labels(self.task_drafted, task_type=task).inc(drafted)
        self.labels(self.task_accepted, task_type=task).inc(accepted)
        self.labels(self.task_acceptance, task_type=task).set(acceptance)
        self.labels(self.task_tau, task_type=task).set(tau)

    def drift_ratio(self, task: str) -> float | None:
        """The task's window: first drafts accepted / first drafts its steps' priors expected."""
        with self._lock:
            window = list(self._windows.get(task or "unknown", ()))
        if not window:
            return None
        ratio = sum(hit for hit, _ in window) / sum(prior for _, prior in window)
        self.labels(self.drift, task_type=task or "unknown").set(ratio)
        return ratio

    def first_token(self, prompt_tokens: int, ttft: float) -> None:
        """A request's prefill is done and its first token out: its prompt tokens and its
        time to first token are counted then, as vLLM counts them (a request aborted while it
        waited for a row adds neither)."""
        self.labels(self.prompt_tokens).inc(prompt_tokens)
        self.labels(self.ttft).observe(ttft)

    def generated(self, tokens: int) -> None:
        """Tokens a step added to a request, counted at that step, as vLLM counts them."""
        if tokens:
            self.labels(self.generation_tokens).inc(tokens)

    def finished(self, reason: str, e2e: float, task: str | None, saved_seconds: float | None,
                 cached_tokens: int = 0, looked_up: int = 0) -> None:
        self.labels(self.success, finished_reason=reason).inc()
        self.labels(self.prefix_queries).inc(looked_up)  # requests that never got a row looked nothing up
        self.labels(self.prefix_hits).inc(cached_tokens)
        self.labels(self.e2e).observe(e2e)
        if saved_seconds is not None:
            self.labels(self.task_saved, task_type=task or "unknown").inc(saved_seconds)

    def token_gap(self, seconds: float) -> None:
        """The gap before a step's tokens reached the request: one observation per step,
        however many tokens it brought, as vLLM records inter-token latency (one per
        token, each a share of the gap, read lower than vLLM's quantiles)."""
        self.labels(self.itl).observe(seconds)
        self.labels(self.tpot).observe(seconds)

    def request_done(self, prompt_tokens: int, generated: int, max_tokens: int, arrival: float,
                     scheduled: float | None, first_token: float | None, finish: float) -> None:
        """A finished request's sizes and phases, as vLLM records them (the phases it
        reached: a request aborted while it waited has a queue time only)."""
        self.labels(self.request_prompt_tokens).observe(prompt_tokens)
        self.labels(self.request_generation_tokens).observe(generated)
        self.labels(self.request_max_generation).observe(generated)
        self.labels(self.request_max_tokens).observe(max_tokens)
        self.labels(self.queue_time).observe((scheduled if scheduled is not None else finish) - arrival)
        if scheduled is None:
            return
        self.labels(self.inference_time).observe(finish - scheduled)
        if first_token is None:
            return
        self.labels(self.prefill_time).observe(first_token - scheduled)
        self.labels(self.decode_time).observe(finish - first_token)
        if generated > 1:
            self.labels(self.request_tpot).observe((finish - first_token) / (generated - 1))

    def queue(self, running: int, waiting: int, kv_usage: float | None = None) -> None:
        self.labels(self.running).set(running)
        self.labels(self.waiting).set(waiting)
        if kv_usage is not None:
            self.labels(self.kv_usage).set(kv_usage)

    def kernel_threads(self, preferred: dict[str, int]) -> None:
        """The thread count decode passes prefer now, per kind of pass (``ThreadChoice.preferred``)."""
        for kind, threads in preferred.items():
            self.labels(self.decode_threads, kind=kind).set(threads)


class LabelledRegistry:
    """A registry's samples with constant labels added to each (``generate_latest`` reads
    any object with ``collect``): a replica's series behind Ray's proxy, which answers each
    scrape from one replica, carry its name, so they are one series per replica and not one
    series that jumps between replicas' counts (found in review: counters went backwards)."""

    def __init__(self, registry, labels: dict[str, str]):
        self.registry, self.labels = registry, labels

    def collect(self):
        for metric in self.registry.collect():
            labelled = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            labelled.samples = [sample._replace(labels={**sample.labels, **self.labels}) for sample in metric.samples]
            yield labelled

