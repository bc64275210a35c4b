"""Prometheus metrics, named like vLLM's with a `hybridkv:` prefix so dashboards carry over.

Per-request figures (tokens, finish reasons, latencies) are counted on the event loop as
outputs arrive; engine-wide ones (running, waiting, KV usage, prefix cache, preemptions)
are read from the engine thread's latest snapshot at scrape time. Each app has its own
registry, so several servers can live in one process (the tests start several).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridkv.engine.outputs import RequestOutput
from hybridkv.server.async_engine import EngineSnapshot, RequestStream
from hybridkv.server.host_memory import HostHolder
from hybridkv.server.replicas import read_status

P = "hybridkv:"
# No `*_created` series next to each counter (vLLM turns them off too). Process-wide.
disable_created_metrics()  # type: ignore[no-untyped-call]
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# Structured output: a grammar compiles in ~1 ms (a schema) to seconds (a huge grammar); a
# step's token masks take tens of microseconds a row.
GRAMMAR_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EngineCollector(Collector):
    """The engine snapshot as gauges and counters, read when scraped."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str,
                 group_names: Sequence[str], cache_info: dict[str, str] | None = None,
                 kv_events: Any = None) -> None:
        self._snapshot = snapshot
        self._model = model_name
        self._groups = list(group_names)
        self._cache_info = cache_info or {}
        self._kv_events = kv_events  # the engine's KVEventPublisher, if any

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        yield from self._vllm(s)
        if self._kv_events is not None:
            dropped = CounterMetricFamily(
                P + "kv_events_dropped", "KV event batches dropped: the publisher queue was "
                "full.", labels=["model_name"])
            dropped.add_metric([self._model], self._kv_events.num_dropped)
            yield dropped
        labels = ["model_name"]
        for name, doc, value in (
                ("num_requests_running", "Requests in the running batch.", s.num_running),
                ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
                ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                 s.kv_usage)):
            gauge = GaugeMetricFamily(P + name, doc, labels=labels)
            gauge.add_metric([self._model], value)
            yield gauge
        for name, doc, value in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 s.prefix_queried_tokens),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 s.prefix_hit_tokens),
                ("num_preemptions", "Requests preempted (recomputed later).",
                 s.num_preemptions),
                ("follow_up_holds", "Steps held after a request ended, for that client's "
                 "next request.", s.follow_up_holds),
                ("follow_up_hits", "Follow-up holds that a request arrived within.",
                 s.follow_up_hits)):
            counter = CounterMetricFamily(P + name, doc, labels=labels)
            counter.add_metric([self._model], value)
            yield counter
        # Beyond vLLM: per KV cache group, labelled by its kind.
        usage = GaugeMetricFamily(P + "kv_cache_usage_perc_per_group",
                                  "Fraction of the arena's blocks a KV cache group holds.",
                                  labels=[*labels, "group"])
        hits = CounterMetricFamily(P + "prefix_cache_hits_per_group",
                                   "Prompt tokens each KV cache group allowed to reuse.",
                                   labels=[*labels, "group"])
        for name, u, h in zip(self._groups, s.kv_usage_per_group, s.hit_tokens_per_group,
                              strict=False):
            usage.add_metric([self._model, name], u)
            hits.add_metric([self._model, name], h)
        yield usage
        yield hits
        if s.offload is not None:
            yield from self._offload(s.offload)

    def _vllm(self, s: EngineSnapshot) -> Iterator[Metric]:
        """The series schedulers written for vLLM scrape (llm-d's inference scheduler, the
        Gateway API inference extension), under vLLM's own names."""
        labels = ["model_name"]
        for name, value in (("num_requests_running", s.num_running),
                            ("num_requests_waiting", s.num_waiting),
                            ("kv_cache_usage_perc", s.kv_usage),
                            ("gpu_cache_usage_perc", s.kv_usage)):  # vLLM < 0.10's name
            gauge = GaugeMetricFamily("vllm:" + name, f"vLLM's {name}.", labels=labels)
            gauge.add_metric([self._model], value)
            yield gauge
        for name, value in (("prefix_cache_queries", s.prefix_queried_tokens),
                            ("prefix_cache_hits", s.prefix_hit_tokens),
                            ("num_preemptions", s.num_preemptions)):
            counter = CounterMetricFamily("vllm:" + name, f"vLLM's {name}.", labels=labels)
            counter.add_metric([self._model], value)
            yield counter
        if self._cache_info:
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache "
                                     "configuration (the value is 1).",
                                     labels=sorted(self._cache_info))
            info.add_metric([self._cache_info[k] for k in sorted(self._cache_info)], 1.0)
            yield info

    def _offload(self, stats: dict[str, Any]) -> Iterator[Metric]:
        """Per offload tier (label `tier`: cpu, disk, remote...), every counter the tier
        keeps, as `hybridkv:kv_offload_<counter>`; the connector's own totals beside them."""
        labels = ["model_name", "tier"]
        tiers = [t for t in stats.get("tiers", []) if isinstance(t, dict)]
        names = sorted({k for t in tiers for k, v in t.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
        for name in names:
            family = CounterMetricFamily(P + "kv_offload_" + name,
                                         f"Offload tier {name.replace('_', ' ')}.",
                                         labels=labels)
            for tier in tiers:
                family.add_metric([self._model, str(tier["tier"])], float(tier.get(name, 0)))
            yield family
        for name, value in sorted(stats.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                family = CounterMetricFamily(P + "kv_offload_connector_" + name,
                                             f"KV offload connector: {name.replace('_', ' ')}.",
                                             labels=["model_name"])
                family.add_metric([self._model], float(value))
                yield family


class ReplicaCollector(Collector):
    """The `--data-parallel-size` launcher's view of its replicas, from the status file it
    keeps (server/replicas.py), read when scraped: any live replica reports a dead one."""

    def __init__(self, status_path: str, model_name: str) -> None:
        self._path = status_path
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        replicas = read_status(self._path)
        if not replicas:
            return
        labels = ["model_name", "replica"]
        up = GaugeMetricFamily(P + "data_parallel_replica_up",
                               "1 while the replica serves; 0 while it starts, waits to be "
                               "restarted, or is left out (as the launcher sees it).",
                               labels=labels)
        restarts = CounterMetricFamily(P + "data_parallel_replica_restarts",
                                       "Times the launcher restarted the replica after it "
                                       "died.", labels=labels)
        for r in replicas:
            if not isinstance(r, dict):
                continue
            replica = str(r.get("replica"))
            up.add_metric([self._model, replica], 1.0 if r.get("state") == "serving" else 0.0)
            restarts.add_metric([self._model, replica], float(r.get("restarts") or 0))
        yield up
        yield restarts


def scheduler_loads(s: EngineSnapshot, capacity_tokens: int,
                    max_running: int) -> dict[str, Any]:
    """The engine's load as SGLang's `/v1/loads` reports it: what SGLang's gateway (`smg`)
    polls from a backend to balance load and to judge overload under cache-aware routing.
    One data-parallel rank per process (`--data-parallel-size` starts one process each).
    `num_waiting_uncached_tokens` is not reported: the snapshot does not count the waiting
    requests' uncached tokens (the gateway reads the missing field as 0, "not reported")."""
    used = round(s.kv_usage * capacity_tokens)
    rank = {"dp_rank": 0, "num_running_reqs": s.num_running,
            "num_waiting_reqs": s.num_waiting, "num_total_reqs": s.num_running + s.num_waiting,
            "num_used_tokens": used, "max_total_num_tokens": capacity_tokens,
            "token_usage": s.kv_usage, "max_running_requests": max_running,
            "cache_hit_rate": (s.prefix_hit_tokens / s.prefix_queried_tokens
                               if s.prefix_queried_tokens else 0.0)}
    return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "dp_rank_count": 1, "loads": [rank]}


class HostMemoryCollector(Collector):
    """server/host_memory.py's holders: what each holds now and its cap."""

    def __init__(self, holders: list[HostHolder], model_name: str) -> None:
        self._holders = holders
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "holder", "unit"]
        used = GaugeMetricFamily(P + "host_cache_used", "What a host-memory holder outside "
                                 "the KV arena holds now.", labels=labels)
        limit = GaugeMetricFamily(P + "host_cache_limit", "Its cap (the startup log names "
                                  "the flag that sets it).", labels=labels)
        for h in self._holders:
            used.add_metric([self._model, h.name, h.unit], float(h.used()))
            limit.add_metric([self._model, h.name, h.unit], float(h.limit))
        yield used
        yield limit


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot],
                 group_names: Sequence[str], cache_info: dict[str, str] | None = None,
                 kv_events: Any = None, replica_status: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefill tokens processed.",
                                     labels, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.",
                                         labels, registry=r)
        self.request_success = Counter(P + "request_success", "Requests finished, by reason.",
                                       [*labels, "finished_reason"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between tokens.",
                             labels, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token.",
                             labels, buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds",
                                    "Arrival to first scheduled.", labels,
                                    buckets=LATENCY_BUCKETS, registry=r)
        # Observed from the grammar threads and the engine thread (prometheus_client's
        # histograms take a lock).
        self.grammar_compile = Histogram(
            P + "structured_output_compile_seconds",
            "Time to compile a structured-output grammar (cache misses only).", labels,
            buckets=GRAMMAR_BUCKETS, registry=r)
        self.grammar_mask = Histogram(
            P + "structured_output_mask_seconds",
            "Time to build one step's token masks for its structured-output rows.", labels,
            buckets=GRAMMAR_BUCKETS, registry=r)
        # Speculative decoding, under vLLM's names: steps that scored drafts, drafts scored,
        # drafts accepted, and accepted drafts by their position in the step's drafts.
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Steps of a request that "
                                   "scored draft tokens.", labels, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens",
                                         "Draft tokens scored.", labels, registry=r)
        self.spec_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted.", labels, registry=r)
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by their "
            "position among the step's drafts.", [*labels, "position"], registry=r)
        self._spec_seen: dict[str, tuple[int, int]] = {}  # per sample: (drafts, accepted)
        r.register(EngineCollector(snapshot, model_name, group_names, cache_info, kv_events))
        if replica_status is not None:
            r.register(ReplicaCollector(replica_status, model_name))
        self._last_token: dict[str, float] = {}

    def observe_output(self, stream: RequestStream, out: RequestOutput) -> None:
        """Called on the event loop for each output the engine delivers."""
        now = time.monotonic()
        m = self.model_name
        rid = f"{out.request_id}/{out.index}"  # one sample of the request
        if out.new_token_ids:
            last = self._last_token.get(rid)
            if last is None:
                self.ttft.labels(m).observe(now - stream.arrival)
                if out.index == 0:  # n samples share one prompt
                    self.prompt_tokens.labels(m).inc(stream.num_prompt_tokens)
            else:
                self.itl.labels(m).observe(now - last)
            self._last_token[rid] = now
            self.generation_tokens.labels(m).inc(len(out.new_token_ids))
        if out.num_draft_tokens:
            self._observe_drafts(rid, out)
        if out.finished:
            self.finish(rid, out.finish_reason or "stop", stream)

    def _observe_drafts(self, rid: str, out: RequestOutput) -> None:
        """An output's totals grew by one step's drafts (a step brings one output per
        request): its accepted drafts are the first ones, position 0 on."""
        drafts, accepted = self._spec_seen.get(rid, (0, 0))
        new_drafts = out.num_draft_tokens - drafts
        new_accepted = out.num_accepted_tokens - accepted
        self._spec_seen[rid] = (out.num_draft_tokens, out.num_accepted_tokens)
        if new_drafts <= 0:
            return
        m = self.model_name
        self.spec_drafts.labels(m).inc()
        self.spec_draft_tokens.labels(m).inc(new_drafts)
        self.spec_accepted_tokens.labels(m).inc(new_accepted)
        for position in range(new_accepted):
            self.spec_accepted_per_pos.labels(m, str(position)).inc()

    def finish(self, rid: str, reason: str, stream: RequestStream) -> None:
        """A sample ended (`rid` "{request}/{index}"), or a whole request because its client
        went away ("abort", `rid` the request's)."""
        self._last_token.pop(rid, None)
        self._spec_seen.pop(rid, None)
        if rid == stream.request_id:
            for i in range(stream.n):
                self._last_token.pop(f"{rid}/{i}", None)
                self._spec_seen.pop(f"{rid}/{i}", None)
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(time.monotonic() - stream.arrival)

    def observe_grammar_compile(self, seconds: float) -> None:
        self.grammar_compile.labels(self.model_name).observe(seconds)

    def observe_grammar_mask(self, seconds: float) -> None:
        self.grammar_mask.labels(self.model_name).observe(seconds)

    def observe_queue_time(self, seconds: float) -> None:
        self.queue_time.labels(self.model_name).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
