"""wire/prom.py: exposition parsing, the vLLM view, and the vLLM-compatible writer."""

from __future__ import annotations

import math
from collections.abc import Iterator

import prometheus_client
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from kvroute.wire.prom import (
    E2E_REQUEST_LATENCY_BUCKETS,
    INTER_TOKEN_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    EngineStats,
    HistogramValues,
    MalformedLine,
    Sample,
    format_float,
    parse_exposition,
    parse_samples,
    parse_vllm_metrics,
    render_vllm_metrics,
    wanted_samples,
)

# A /metrics page as a vLLM 0.32 API server with two data-parallel ranks serves it (names,
# HELP and labels from vllm/v1/metrics/loggers.py), plus a few lines from other libraries.
VLLM_PAGE = r"""# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1234.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 4.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 100.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.75
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 500.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7959491168358e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 640.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 128.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",hash_block_size="None",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="1",hash_block_size="None",prefix_caching_hash_algo="sha256"} 1.0
"""


# ---------------------------------------------------------------------------- generic parser


def test_parse_samples_basic() -> None:
    samples = parse_samples(VLLM_PAGE)
    assert samples[0] == Sample("python_gc_objects_collected_total", {"generation": "0"}, 1234.0)
    assert samples[1] == Sample(
        "vllm:num_requests_running", {"engine": "0", "model_name": "tiny"}, 3.0
    )
    assert len(samples) == 15


def test_help_and_type_are_read() -> None:
    expo = parse_exposition(VLLM_PAGE)
    assert expo.types["vllm:prefix_cache_hits_total"] == "counter"
    assert expo.types["vllm:cache_config_info"] == "gauge"
    assert expo.helps["vllm:kv_cache_usage_perc"] == "KV-cache usage. 1 means 100 percent usage."
    assert expo.num_malformed == 0


def test_label_escapes_special_values_and_timestamps() -> None:
    text = (
        "# HELP m A help with \\\\ backslash and \\n newline\n"
        'm{a="x\\"y",b="line\\nbreak",c="back\\\\slash",d="{},= "} NaN\n'
        'm{a="1",} +Inf 1700000000000\n'
        "m -Inf\n"
        "m{} 1e-3 -5\n"
        'm_total 7 # {trace_id="abc"} 1.0 1700000000.0\n'
        "  m   2.5  \r\n"
        "# EOF\n"
    )
    expo = parse_exposition(text)
    assert expo.num_malformed == 0, expo.malformed
    s = expo.samples
    assert s[0].labels == {"a": 'x"y', "b": "line\nbreak", "c": "back\\slash", "d": "{},= "}
    assert math.isnan(s[0].value)
    assert (s[1].labels, s[1].value, s[1].timestamp_ms) == ({"a": "1"}, math.inf, 1700000000000)
    assert s[2].value == -math.inf
    assert (s[3].labels, s[3].value, s[3].timestamp_ms) == ({}, 0.001, -5)
    assert (s[4].name, s[4].value) == ("m_total", 7.0)
    assert s[5].value == 2.5
    assert expo.helps["m"] == "A help with \\ backslash and \n newline"


@pytest.mark.parametrize(
    "line,reason",
    [
        ("9bad 1", "does not start with a metric name"),
        ('m{a="1" 2', "bad label set"),
        ("m{a=1} 2", "bad label set"),
        ("m", "missing value"),
        ("m abc", "is not a number"),
        ("m 1_000", "is not a number"),
        ("m 1 2 3", "unexpected text"),
        ("m 1 1.5", "timestamp"),
        ('m{a="1"}2', "no whitespace"),
    ],
)
def test_malformed_lines_are_skipped_and_counted(line: str, reason: str) -> None:
    expo = parse_exposition(f"good 1\n{line}\ngood 2\n")
    assert [s.value for s in expo.samples] == [1.0, 2.0]
    assert expo.num_malformed == 1
    (bad,) = expo.malformed
    assert bad.line_number == 2 and bad.text == line
    assert reason in bad.reason


def test_malformed_count_is_complete_but_record_is_capped() -> None:
    expo = parse_exposition("x\n" * 50)
    assert expo.num_malformed == 50
    assert len(expo.malformed) == 20
    assert expo.malformed[0] == MalformedLine(1, "x", "missing value")


def test_name_filter_skips_other_lines_unvalidated() -> None:
    expo = parse_exposition("other{{{ broken\nvllm:a 1\n", names=["vllm:"])
    assert [s.name for s in expo.samples] == ["vllm:a"]
    assert expo.num_malformed == 0


# ---------------------------------------------------------------------------- vLLM view


def test_vllm_metrics_sum_over_engines() -> None:
    m = parse_vllm_metrics(VLLM_PAGE)
    assert m.num_requests_running == 5.0
    assert m.num_requests_waiting == 5.0, "waiting_by_reason must not leak into waiting"
    assert m.kv_cache_usage_perc == 0.5, "usage is the mean over ranks"
    assert m.kv_cache_usage_by_engine == {"0": 0.25, "1": 0.75}
    assert m.prefix_cache_queries_total == 1500.0
    assert m.prefix_cache_hits_total == 768.0
    assert m.block_size == 32
    assert m.prefix_caching_hash_algo == "sha256"
    assert m.enable_prefix_caching is True
    assert m.cache_config["hash_block_size"] == "None"
    assert m.engines == ("0", "1")
    assert m.model_names == ("tiny",)
    assert m.found and m.num_malformed == 0


def test_vllm_metrics_model_filter() -> None:
    page = VLLM_PAGE + 'vllm:num_requests_running{engine="0",model_name="other"} 10.0\n'
    assert parse_vllm_metrics(page, "tiny").num_requests_running == 5.0
    assert parse_vllm_metrics(page, "other").num_requests_running == 10.0
    assert parse_vllm_metrics(page).num_requests_running == 15.0
    assert parse_vllm_metrics(page).model_names == ("other", "tiny")
    nobody = parse_vllm_metrics(page, "nope")
    assert nobody.num_requests_running is None and not nobody.found
    # cache_config_info has no model_name label in vLLM, so it always applies.
    assert nobody.block_size == 32


def test_vllm_metrics_absent_and_odd_values() -> None:
    m = parse_vllm_metrics("")
    assert m == parse_vllm_metrics("# nothing here\n")
    assert (m.num_requests_running, m.kv_cache_usage_perc, m.block_size) == (None, None, None)
    odd = parse_vllm_metrics(
        'vllm:cache_config_info{block_size="None",enable_prefix_caching="maybe"} 1\n'
        "vllm:num_requests_running oops\n"
        "vllm:num_requests_waiting 2\n"
    )
    assert odd.block_size is None and odd.enable_prefix_caching is None
    assert odd.num_requests_running is None and odd.num_requests_waiting == 2.0
    assert odd.num_malformed == 1


def test_vllm_metrics_legacy_gpu_cache_usage() -> None:
    m = parse_vllm_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.4\n')
    assert m.kv_cache_usage_perc == 0.4
    both = parse_vllm_metrics("vllm:gpu_cache_usage_perc 0.4\nvllm:kv_cache_usage_perc 0.1\n")
    assert both.kv_cache_usage_perc == 0.1


# ---------------------------------------------------------------------------- writer


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_format_float_matches_prometheus_client(value: float) -> None:
    assert format_float(value) == floatToGoString(value)


@pytest.mark.parametrize(
    "value", [0.0, 5.0, 1e16, 1234567.0, 10000000.0, 1795949116.835804, -3.5e9]
)
def test_format_float_examples(value: float) -> None:
    assert format_float(value) == floatToGoString(value)


def test_histogram_values() -> None:
    h = HistogramValues((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.counts == [2, 1, 1] and h.count == 4 and h.total == pytest.approx(3.65)
    with pytest.raises(ValueError, match="increasing"):
        HistogramValues((1.0, 0.5))
    with pytest.raises(ValueError, match="3 counts"):
        HistogramValues((0.1, 1.0), counts=[1])


def _engine(idx: int) -> EngineStats:
    e = EngineStats(
        engine=idx, num_requests_running=3 + idx, num_requests_waiting=2, num_requests_waiting_deferred=1,
        kv_cache_usage_perc=0.125 * (idx + 1), prefix_cache_queries=1000, prefix_cache_hits=640,
        num_preemptions=idx, prompt_tokens=5000, prompt_tokens_cached=640, generation_tokens=300,
        request_success={"stop": 7, "length": 2},
    )  # fmt: skip
    for v in (0.003, 0.2, 9.0):
        e.time_to_first_token_seconds.observe(v)
    for v in (0.02, 0.02, 0.3):
        e.inter_token_latency_seconds.observe(v)
    e.e2e_request_latency_seconds.observe(1.2)
    return e


CACHE_CONFIG = {
    "block_size": "16",
    "enable_prefix_caching": "True",
    "prefix_caching_hash_algo": "sha256",
    "cache_dtype": "auto",
}


def _reference_registry(engines: list[EngineStats]) -> CollectorRegistry:
    """The same page built with prometheus_client and vLLM's declarations (loggers.py)."""
    r = CollectorRegistry()
    ln = ["model_name", "engine"]

    def gauge(name: str, doc: str, extra: list[str] | None = None) -> Gauge:
        return Gauge(name, doc, labelnames=ln + (extra or []), registry=r)

    def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
        return Counter(name, doc, labelnames=ln + (extra or []), registry=r)

    running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
    waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
    by_reason = gauge(
        "vllm:num_requests_waiting_by_reason",
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
        "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
        "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
        ["reason"],
    )
    sleep = gauge(
        "vllm:engine_sleep_state",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
        "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        ["sleep_state"],
    )
    usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
    queries = counter(
        "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
    )
    hits = counter(
        "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
    )
    preempt = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
    prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
    cached = counter(
        "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
    )
    gen = counter("vllm:generation_tokens", "Number of generation tokens processed.")
    success = counter(
        "vllm:request_success", "Count of successfully processed requests.", ["finished_reason"]
    )
    ttft = Histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        labelnames=ln,
        buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
        registry=r,
    )
    itl = Histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        labelnames=ln,
        buckets=INTER_TOKEN_LATENCY_BUCKETS,
        registry=r,
    )
    e2e = Histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        labelnames=ln,
        buckets=E2E_REQUEST_LATENCY_BUCKETS,
        registry=r,
    )
    info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                 labelnames=[*CACHE_CONFIG, "engine"], registry=r)  # fmt: skip
    for e in engines:
        lv = ("tiny", str(e.engine))
        running.labels(*lv).set(e.num_requests_running)
        waiting.labels(*lv).set(e.num_requests_waiting)
    for e in engines:
        lv = ("tiny", str(e.engine))
        by_reason.labels(*lv, "capacity").set(
            e.num_requests_waiting - e.num_requests_waiting_deferred
        )
        by_reason.labels(*lv, "deferred").set(e.num_requests_waiting_deferred)
    for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
        for e in engines:
            sleep.labels("tiny", str(e.engine), state).set(value)
    for e in engines:
        lv = ("tiny", str(e.engine))
        usage.labels(*lv).set(e.kv_cache_usage_perc)
        queries.labels(*lv).inc(e.prefix_cache_queries)
        hits.labels(*lv).inc(e.prefix_cache_hits)
        preempt.labels(*lv).inc(e.num_preemptions)
        prompt.labels(*lv).inc(e.prompt_tokens)
        cached.labels(*lv).inc(e.prompt_tokens_cached)
        gen.labels(*lv).inc(e.generation_tokens)
    for reason in ("stop", "length", "abort", "error"):
        for e in engines:
            success.labels("tiny", str(e.engine), reason).inc(e.request_success.get(reason, 0))
    for e in engines:
        lv = ("tiny", str(e.engine))
        for v in (0.003, 0.2, 9.0):
            ttft.labels(*lv).observe(v)
        for v in (0.02, 0.02, 0.3):
            itl.labels(*lv).observe(v)
        e2e.labels(*lv).observe(1.2)
    for e in engines:
        info.labels(**CACHE_CONFIG, engine=str(e.engine)).set(1)
    return r


@pytest.fixture
def no_created_series() -> Iterator[None]:
    prometheus_client.disable_created_metrics()
    try:
        yield
    finally:
        prometheus_client.enable_created_metrics()


@pytest.mark.usefixtures("no_created_series")
def test_render_is_byte_identical_to_prometheus_client() -> None:
    engines = [_engine(0), _engine(1)]
    expected = generate_latest(_reference_registry(engines)).decode()
    got = render_vllm_metrics(engines, model_name="tiny", cache_config=CACHE_CONFIG)
    assert got.splitlines() == expected.splitlines()


def test_render_with_created_series_matches_except_timestamps() -> None:
    engines = [_engine(0)]
    expected = generate_latest(_reference_registry(engines)).decode().splitlines()
    got = render_vllm_metrics(
        engines, model_name="tiny", cache_config=CACHE_CONFIG, created_s=1795949116.5
    ).splitlines()
    assert len(got) == len(expected)
    for mine, ref in zip(got, expected, strict=True):
        if "_created{" in ref:
            assert mine.rsplit(" ", 1)[0] == ref.rsplit(" ", 1)[0]
            assert mine.endswith(" 1.7959491165e+09")
        else:
            assert mine == ref


def test_rendered_page_round_trips_through_both_parsers() -> None:
    engines = [_engine(0), _engine(1)]
    page = render_vllm_metrics(engines, model_name="tiny", cache_config=CACHE_CONFIG, created_s=1.0)
    m = parse_vllm_metrics(page, "tiny")
    assert m.num_requests_running == 7.0
    assert m.num_requests_waiting == 4.0
    assert m.kv_cache_usage_perc == pytest.approx(0.1875)
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (2000.0, 1280.0)
    assert (m.block_size, m.prefix_caching_hash_algo, m.enable_prefix_caching) == (
        16,
        "sha256",
        True,
    )
    assert m.engines == ("0", "1") and m.num_malformed == 0
    families = {f.name: f for f in text_string_to_metric_families(page)}
    assert families["vllm:prefix_cache_hits"].type == "counter"
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    ttft = [s for s in families["vllm:time_to_first_token_seconds"].samples
            if s.name.endswith("_count") and s.labels["engine"] == "0"]  # fmt: skip
    assert [s.value for s in ttft] == [3.0]


_WANTED = ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:cache_config_info")
_line = st.one_of(
    st.sampled_from([
        "", "   ", "# HELP vllm:num_requests_running Requests running.",
        "# TYPE vllm:num_requests_running gauge", "# EOF", "#vllm:num_requests_running 1",
        'vllm:num_requests_running{model_name="m",engine="0"} 3',
        "  vllm:num_requests_running 4\r", "\tvllm:kv_cache_usage_perc 0.25",
        'vllm:cache_config_info{block_size="16",prefix_caching_hash_algo="sha256"} 1.0',
        "vllm:num_requests_running_total 9", "vllm:num_requests_running", "vllm:kv_cache_usage_perc x",
        'vllm:num_requests_running{model_name="m" 1', "process_cpu_seconds_total 1.5",
        'vllm:time_to_first_token_seconds_bucket{le="0.1"} 7', "vllm:num_requests_waiting 2",
    ]),
    st.builds(lambda name, value, pad: f"{pad}{name} {value}",
              st.sampled_from([*_WANTED, "vllm:other", "vllm:num_requests_runningX"]),
              st.one_of(st.floats(allow_nan=False).map(repr), st.sampled_from(["NaN", "+Inf", "1e3", "bad"])),
              st.sampled_from(["", " ", "\t", "\r", "\x0b"])),
)


@given(st.lists(_line, max_size=40), st.sampled_from(["\n", "\r\n"]))
def test_wanted_samples_agree_with_the_line_by_line_parse(lines: list[str], newline: str) -> None:
    text = newline.join(lines)
    full = parse_exposition(text, names=_WANTED)
    samples, num_malformed = wanted_samples(text, _WANTED)

    def key(s: Sample) -> tuple[object, ...]:
        return (s.name, sorted(s.labels.items()), repr(s.value), s.timestamp_ms)

    assert [key(s) for s in samples] == [key(s) for s in full.samples]
    assert num_malformed == full.num_malformed
