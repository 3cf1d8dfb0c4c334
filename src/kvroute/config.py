"""kvroute's configuration: one YAML file → a frozen, validated dataclass tree.

Owns the schema of ``kvroute.yaml`` (see ``examples/kvroute.yaml``), its defaults, and the
checks run once at start-up. Every error is a ``ConfigError`` whose message names the key
(as a path such as ``pools.small.replicas[1].url``), the value found, and the fix. Unknown
keys are errors with a did-you-mean: a typo such as ``max_inflight`` must not silently fall
back to a default.

What is read from the environment, and when:

* ``KVROUTE_WARM_AHEAD=0|1`` overrides ``warm_ahead.enabled`` (read by ``load_config`` /
  ``parse_config`` from the ``env`` mapping passed in, ``os.environ`` by default);
* secrets (tenants' API keys, the admin key, the salt secret) are *named* in the file by
  their environment variables and resolved separately by ``resolve_secrets``, so a config
  object never holds a secret and can be logged or shown by ``/admin/state``.

The config is data only: the composition root (``shell/app.py``, ``shell/runtime.py``) turns
it into ``RouterCore`` pools, policies, clients and tasks. Core objects never see it.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import hmac
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Literal
from urllib.parse import urlsplit

import yaml  # type: ignore[import-untyped]  # types-PyYAML is not a dependency

from kvroute.core.cache_drift import CacheDriftSettings
from kvroute.core.disagg import ROLES, SPLIT_MODES, DisaggSpec, Role, check_role
from kvroute.core.errors import ConfigError
from kvroute.core.load import DEFAULT_DECODE_TIMING, DecodeTiming
from kvroute.core.peer_policies import POLICY_NAMES, policy_parameters
from kvroute.core.pseudonyms import MIN_SECRET_BYTES
from kvroute.core.scenarios import (
    NO_SCENARIOS,
    AbArm,
    AbSplitSettings,
    FailoverSettings,
    RouteScenarios,
    UpgradeSettings,
)
from kvroute.core.tokens import IMAGE_FAMILIES, IMAGE_PRESETS, ImageCost
from kvroute.core.transcript_sample import SampleSettings
from kvroute.core.types import PoolName, ReplicaId, TenantName
from kvroute.wire.dp_rank import DpRankError, offset_endpoint_port
from kvroute.wire.reasoning import THINK_SWITCHES, ReasoningSettings

__all__ = [
    "DEFAULT_TENANT",
    "AdmissionConfig",
    "ClusterConfig",
    "DiscoveryConfig",
    "DpRankClash",
    "ExternalConfig",
    "GateConfig",
    "HttpLimitsConfig",
    "KubernetesSource",
    "KvStreamConfig",
    "ListenConfig",
    "PolicyConfig",
    "PoolConfig",
    "ReplicaConfig",
    "RetryConfig",
    "RouteConfig",
    "RouterConfig",
    "Secrets",
    "StateConfig",
    "TenantConfig",
    "TimeoutsConfig",
    "TokenizerConfig",
    "TranscriptSampleConfig",
    "WarmAheadConfig",
    "derive_cache_salt",
    "expand_dp_ranks",
    "load_config",
    "parse_config",
    "resolve_cluster_secret",
    "resolve_provider_keys",
    "resolve_secrets",
]

DEFAULT_TENANT: Final = TenantName("default")
"""The tenant every request belongs to when no tenants are configured (no auth)."""

WARM_AHEAD_ENV: Final = "KVROUTE_WARM_AHEAD"

_LOG_LEVELS: Final = ("debug", "info", "warning", "error")
_ZMQ_SCHEMES: Final = ("tcp://", "ipc://", "inproc://")


# --------------------------------------------------------------------------------------------
# The tree
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ListenConfig:
    """Where the router's HTTP server listens. ``port: 0`` picks a free port (tests)."""

    host: str = "127.0.0.1"
    port: int = 8000


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """One engine replica.

    Attributes:
        name: unique across all pools (``s0``); used in headers, metrics and logs.
        url: the engine's base URL, ``http(s)://host:port`` with no trailing slash.
        kv_events: the engine's KV-event PUB endpoint (``tcp://host:5557``); None = no
            events, so this replica is only routed on predictions and load.
        kv_replay: the engine's replay ROUTER endpoint; None = gaps reset the replica's index.
        kv_topic: the SUB topic filter (vLLM's default topic is ``""``).
        kv_events_bind: the router *binds* ``kv_events`` instead of connecting to it. vLLM
            binds its PUB socket only for wildcard (``tcp://*:5557``), ipc and inproc
            endpoints; an engine started with a concrete ``tcp://127.0.0.1:5601`` connects
            to that address, so the router must bind it (one router per engine then).
        prefill_rate_tps: the starting prefill speed of the cost model, learned afterwards.
        dp_rank: the data-parallel rank of ``engine`` this entry routes to, or None for an
            engine without ranks. A YAML replica with ``data_parallel_size: N`` becomes N
            entries named ``<name>.dp<r>``, one per rank, each its own routing target (its
            own index, load and cost), sharing ``url``; each reads its rank's event stream
            (``kv_events``/``kv_replay`` at vLLM's per-rank offset,
            ``wire/dp_rank.offset_endpoint_port``) and every request sent to it carries
            ``X-data-parallel-rank: r`` (docs/data-parallel.md).
        engine: the YAML replica's own name (the engine behind the API server) when
            ``dp_rank`` is set; its ranks share it.
        dp_size: the engine's rank count this entry belongs to (1: no ranks).
        dp_auto: the rank count is read from the engine's ``/metrics`` (``engine`` labels)
            rather than fixed by the config: a YAML replica without ``data_parallel_size``, or
            with ``data_parallel_size: auto``. Discovery expands it into ranks, or folds the
            ranks back, when the engine's count changes (``shell/dp_discovery.py``).
        role: ``both``, ``prefill`` or ``decode`` in a pool with ``disaggregation``
            (``core/disagg.py``, docs/disaggregation.md).
    """

    name: ReplicaId
    url: str
    kv_events: str | None = None
    kv_replay: str | None = None
    kv_topic: str = ""
    kv_events_bind: bool = False
    prefill_rate_tps: float = 10_000.0
    dp_rank: int | None = None
    engine: str | None = None
    role: Role = "both"
    dp_size: int = 1
    dp_auto: bool = False


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """How the router gets a pool's exact prompt tokens.

    ``engine``: the engines' ``/tokenize`` (exact, one loopback call per request);
    ``auto``: the engines' ``/tokenize`` until the directory their model cards name as
    ``root`` is found on this host and gives the same ids on probe prompts, then that
    directory in-process (exact, no round trip), checked again every minute;
    ``local``: a Hugging Face tokenizer directory (``path``), loaded at start, run on the
    event loop, checked against the engines' ``/tokenize`` once one is healthy and every
    minute after (a mismatch switches the pool to the engines until one matches again);
    ``none``: no tokenizer; the pool routes in the declared *approximate* mode (text chunks).
    """

    mode: Literal["engine", "auto", "local", "none"] = "auto"
    path: str | None = None


@dataclass(frozen=True, slots=True)
class ExternalConfig:
    """An external OpenAI-compatible provider standing as a pool (``pools.<name>.external``).

    A request escalates to it only when its model maps into the provider's catalog; otherwise
    it stays local and the ``[CONTEXT-ROUTE]`` log says why (``core/tiers.eligibility``).

    Attributes:
        urls: the provider's base URLs (one or more endpoints, no ``/v1`` suffix); requests
            go to the least-loaded healthy one. No KV index, events or tokenizer are kept
            for them, and they are never warmed ahead.
        api_key_env: the environment variable holding the provider's API key, sent as
            ``Authorization: Bearer``; None = no key (a provider without auth).
        catalog: route (client) model → provider model. None = not configured: the model
            is sent under its own name and must appear on the provider's ``/v1/models``.
        catalog_from_models: read the provider's ``/v1/models`` (cached with
            ``discovery.window_ttl_s``) and require the mapped model to be listed there.
            Defaults to true when ``catalog`` is not configured, false when it is.

    Invariant: ``catalog is not None or catalog_from_models`` (checked at build).
    """

    urls: tuple[str, ...]
    api_key_env: str | None = None
    catalog: Mapping[str, str] | None = None
    catalog_from_models: bool = True


@dataclass(frozen=True, slots=True)
class KubernetesSource:
    """A pool's engines read from the Kubernetes API instead of listed (``docs/kubernetes.md``).

    Attributes:
        namespace: where the engines' EndpointSlices are.
        label_selector: which slices (``kubernetes.io/service-name=vllm``).
        http_port: the name of the engines' OpenAI port on the slices.
        kv_events_port: the name of their ZMQ KV-event port; None: no events.
        kubeconfig: a kubeconfig path; None: in-cluster (the pod's service account).
        prefill_rate_tps: every discovered engine's starting prefill speed.
    """

    namespace: str
    label_selector: str
    http_port: str = "http"
    kv_events_port: str | None = "kv-events"
    kubeconfig: str | None = None
    prefill_rate_tps: float = 10_000.0


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """A pool of interchangeable replicas serving one model.

    Attributes:
        name: the pool's name (the key under ``pools:``).
        model: the model name the engines serve (``/v1/models`` id); the router rewrites a
            route name to it in the forwarded body. Empty for an external pool (its
            catalog gives the provider's model per route).
        replicas: at least one, unless ``kubernetes`` is set (then none: they come and go
            at run time). For an external pool, one per endpoint URL, named ``<pool>-ext<i>``.
        tokenizer: see ``TokenizerConfig`` (``none`` for an external pool).
        block_size / hash_algo / hash_seed: overrides of what discovery reads from the
            engines; leave unset unless the engines cannot report them.
        external: set when the pool is an external OpenAI-compatible provider.
        decode_timing: the engines' decode step (``core/load.DecodeTiming``: ``fixed_s``,
            ``seq_s``, ``context_token_s``); the cost policy prices decodes with it. The
            default is Llama-3.1-8B on an H100; ``kvroute sim calibrate`` fits it to an
            engine, and the router corrects it per replica from the answers it relays.
        report_hits: add vLLM's ``"vllm_xargs": {"kv_cache_report_mode": "full"}`` to every
            request sent to this pool, so its engines publish a ``BlockStored`` for every
            prefix hit too and the index follows their LRU order (``docs/visible-hits.md``:
            more events, same hit rate).
        lora_adapters: LoRA adapters the router may load on this pool's engines on demand
            ({name: path the engines can read}), through vLLM's ``/v1/load_lora_adapter``
            (the engines need ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), when a request
            names one no replica lists (``docs/lora.md``).
        policy_params: this pool's own values of the policy's parameters, over
            ``policy.params`` (e.g. ``{decode_weight: 1.5, harm_weight: 1}`` for a pool that
            serves coding agents, whose turns are long decodes over long contexts); checked
            against the policy's parameters when the config loads.
        disaggregation: prefill/decode disaggregation (``core/disagg.DisaggSpec``: the split
            mode and the link's seconds per token of KV); None: every request colocated
            (docs/disaggregation.md).
    """

    name: PoolName
    model: str
    replicas: tuple[ReplicaConfig, ...]
    tokenizer: TokenizerConfig = TokenizerConfig()
    block_size: int | None = None
    hash_algo: str | None = None
    hash_seed: str | None = None
    external: ExternalConfig | None = None
    decode_timing: DecodeTiming = DEFAULT_DECODE_TIMING
    report_hits: bool = False
    lora_adapters: Mapping[str, str] = field(default_factory=dict)
    kubernetes: KubernetesSource | None = None
    policy_params: Mapping[str, float | int | bool] = field(
        default_factory=lambda: MappingProxyType({}))
    disaggregation: DisaggSpec | None = None


@dataclass(frozen=True, slots=True)
class RouteConfig:
    """A model name clients send, and the pools (tiers) behind it, smallest window first.

    Attributes:
        name: the model name clients send.
        pools: the tiers, smallest window first (``core/tiers.py`` picks among them).
        output_floor: the least output a placement must leave room for (``plan_tier``); a
            route that must always get the full requested output sets it to its usual
            ``max_tokens``.
        tokenize_margin: how far below the under-estimate a window may lie and still be
            worth an exact ``/tokenize`` count, in [0, 1).
        proactive: choose the tier from the prompt's estimate before sending (default).
            ``false`` is reactive-only: every request goes to the first pool (or the one
            its session already escalated to) with the client's ``max_tokens`` untouched,
            and only an engine's overflow rejection clamps or escalates it. It exists to
            measure what the proactive estimate saves (``kvroute bench tiers-live``).
        image_tokens: what one image costs the route's model family in prompt tokens
            (``core/tokens.ImageCost``; default Qwen-VL's 28-px grid). Per route, not per
            pool: the estimate is made before the pool is chosen, and a route's tiers serve
            one model family.
        reasoning: the route's think switch and thinking budget
            (``wire/reasoning.ReasoningSettings``, ``docs/reasoning.md``); None: the bodies'
            own.
        scenarios: the model-bound cache scenarios (``upgrade``, ``ab_split``,
            ``failover``, ``version_salt``; ``core/scenarios.py``,
            docs/model-bound-caches.md).
    """

    name: str
    pools: tuple[PoolName, ...]
    output_floor: int = 256
    tokenize_margin: float = 0.2
    proactive: bool = True
    image_tokens: ImageCost = field(default_factory=ImageCost)
    reasoning: ReasoningSettings | None = None
    scenarios: RouteScenarios = NO_SCENARIOS


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """The replica-selection policy (``core.peer_policies.POLICY_NAMES``) and its parameters."""

    name: str = "kvroute"
    params: Mapping[str, float | int | bool] = field(default_factory=lambda: MappingProxyType({}))
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class StateConfig:
    """Where session pins and warm-ahead cooldowns live (``shell/state.py`` reads this).

    ``memory`` is per process; ``redis`` is shared by several router processes.

    Attributes:
        backend: ``memory`` or ``redis``.
        url: the Redis URL (``redis`` only).
        namespace: prefix of every Redis key.
        timeout_s: per Redis call (a pin lookup sits on the request path).
        session_ttl_s: a pin's lifetime, refreshed on every request of the session.
        max_pins: bound of the in-memory pin map (LRU).
        max_warm: bound of the warm-ahead cooldown map (LRU).
        max_chain_tokens: bound, in prompt tokens over all sessions, of the per-session
            block-hash chains a growing conversation reuses (``core/hashing_chains.py``;
            about 6.8 bytes a token: the default 4M tokens is ~27 MB, ~30 sessions of 128K
            tokens; 0 turns them off). Per process, whatever the backend.
    """

    backend: Literal["memory", "redis"] = "memory"
    url: str | None = None
    namespace: str = "kvroute"
    timeout_s: float = 0.25
    session_ttl_s: float = 3600.0
    max_pins: int = 100_000
    max_warm: int = 256
    max_chain_tokens: int = 4_000_000


@dataclass(frozen=True, slots=True)
class KvStreamConfig:
    """The durable KV-event stream in NATS JetStream (``shell/kv_stream.py`` reads this).

    A router with this section rebuilds each replica's index from the stream when it starts
    (snapshot plus tail), then follows the engines' ZMQ feeds; one with ``relay: true``
    also mirrors every batch its subscribers deliver into the stream. One relay per fleet.

    Attributes:
        url: the NATS server (``nats://host:4222``).
        name: the JetStream stream of the events; the snapshots live in the object store
            bucket ``<name>_SNAPSHOTS``.
        subject_prefix: events go to ``<prefix>.events.<replica>``.
        relay: this router mirrors its engines' events into the stream.
        max_age_s: the stream drops batches older than this.
        max_bytes: the stream drops its oldest batches beyond this size (and so does the
            snapshot bucket).
        snapshot_every: batches of one replica between two snapshots of its blocks (the
            most a restarting router reads from the stream's tail, about).
        connect_timeout_s: how long start-up (and each background retry) waits for NATS
            before going on without it.
    """

    url: str = "nats://127.0.0.1:4222"
    name: str = "KVROUTE_KV_EVENTS"
    subject_prefix: str = "kvroute.kv"
    relay: bool = False
    max_age_s: float = 86_400.0
    max_bytes: int = 1 << 30
    snapshot_every: int = 5_000
    connect_timeout_s: float = 2.0


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Several routers in front of one fleet sharing what each has just placed
    (``shell/cluster.py`` reads this; off by default).

    Each router announces, on a NATS subject, the requests it sends (replica, prompt size,
    the predicted blocks it wrote) and when they produce a first token and end; each merges
    its peers' announcements into its own index overlay and load view. A peer silent for
    ``peer_expiry_s`` is dropped with everything it had in flight.

    Attributes:
        bus: ``none`` (one router, the default) or ``nats``.
        url: the NATS server (``nats`` only), e.g. ``nats://127.0.0.1:4222``.
        subject: the subject the fleet's routers share (one per fleet).
        router_id: this router's name on the bus; empty: ``<hostname>-<pid>``.
        heartbeat_s: how often a router says it is alive when it has nothing to announce.
        peer_expiry_s: a peer silent this long is gone (its load vanishes).
        secret_env: the environment variable holding the cluster secret (the default
            ``KVROUTE_CLUSTER_SECRET``): the key of the pseudonyms that replace tenant,
            session and request ids on the bus and in Redis (``core/pseudonyms.py``). The
            same on every router of the fleet; required with ``bus: nats`` or
            ``state.backend: redis`` (``resolve_secrets``).
        secret: the secret written in the file instead (``secret_env`` is then not read);
            never shown (``repr``) nor logged. Prefer the environment.
    """

    bus: Literal["none", "nats"] = "none"
    url: str | None = None
    subject: str = "kvroute.cluster"
    router_id: str = ""
    heartbeat_s: float = 0.5
    peer_expiry_s: float = 3.0
    secret_env: str = "KVROUTE_CLUSTER_SECRET"
    secret: str | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """A tenant: its API key's environment variable, whether its cache is salted, and
    whether it is shown the routing headers.

    ``cache_salt`` is on unless the file says ``cache_salt: false`` (the router logs every
    tenant so opted out): an unsalted tenant's prompt is a prefix-cache hit for any other
    unsalted tenant's, a timing side channel. ``routing_headers`` (off unless set) sends the
    tenant ``x-kvroute-replica``, ``-pool``, ``-cached-tokens`` and ``-approximate``; they
    tell which replica holds which prefix, so only trusted clients (a benchmark, an
    operator's own tenant) should see them. With no tenants configured every client sees
    them.
    """

    name: TenantName
    api_key_env: str
    cache_salt: bool = True
    routing_headers: bool = False


@dataclass(frozen=True, slots=True)
class HttpLimitsConfig:
    """Limits on client connections (``http/server.py``), defaults from nginx and Envoy.

    Attributes:
        max_header_bytes: request line plus headers (431 beyond); Envoy's
            ``max_request_headers_kb`` default, 60 KiB.
        header_timeout_s: a request head must be complete this long after its first byte,
            or after the connection opened (408 beyond); nginx's ``client_header_timeout``.
        body_timeout_s: longest pause while a body arrives (408); nginx's
            ``client_body_timeout``.
        send_timeout_s: longest a client may read nothing of its answer before it is dropped;
            nginx's ``send_timeout``.
        idle_timeout_s: a keep-alive connection idle this long is closed; nginx's
            ``keepalive_timeout``.
        max_connections: open client connections (503 and close beyond). nginx allows 512
            per worker by default; one router process is one worker and admission alone may
            hold 1,280 requests (``admission``), so the default is 4,096.
    """

    max_header_bytes: int = 60 * 1024
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    send_timeout_s: float = 60.0
    idle_timeout_s: float = 75.0
    max_connections: int = 4096


@dataclass(frozen=True, slots=True)
class TimeoutsConfig:
    """Upstream timeouts in seconds.

    ``connect_s`` bounds opening a connection; ``first_byte_s`` bounds the wait for the first
    body byte of a *streamed* answer (a failure inside it is retried elsewhere);
    ``total_s`` bounds a whole upstream exchange (a non-streamed answer arrives in one piece
    at the end, so it only has this one).
    """

    connect_s: float = 2.0
    first_byte_s: float = 60.0
    total_s: float = 600.0
    stall_s: float = 60.0
    """A started stream silent this long is ended with an error event and its engine
    request aborted (a stalled engine); nginx's ``proxy_read_timeout``."""


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """Retries of a request that failed before its first byte, on the next-best replica."""

    max_retries: int = 2


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """In-flight bound, wait queue and wait timeout; beyond them a 429 with ``Retry-After``."""

    max_in_flight: int = 256
    max_queue: int = 1024
    queue_timeout_s: float = 30.0
    retry_after_s: int = 1


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """How often and how patiently each replica's ``/v1/models``, ``/metrics``, ``/health``
    are polled, and how long a discovered window is trusted."""

    models_interval_s: float = 30.0
    metrics_interval_s: float = 2.0
    health_interval_s: float = 2.0
    timeout_s: float = 2.0
    window_ttl_s: float = 900.0
    unhealthy_after: int = 2


@dataclass(frozen=True, slots=True)
class WarmAheadConfig:
    """Warm-ahead (``core/warm.py``): switch, trigger fraction, per-session cooldown.

    The cooldown map's bound is ``state.max_warm``. ``KVROUTE_WARM_AHEAD=0`` in the
    environment switches warm-ahead off whatever the file says (``=1`` forces it on).
    ``rewarm_fraction`` is the growth (share of the window) after which a growing session
    may be warmed again within the cooldown (``core/warm.py``'s growth stages; 1 = once per
    cooldown). ``timeout_s`` bounds one warm-up request (it runs in the background; a warm-up that
    takes longer is abandoned and counted as failed); ``max_in_flight`` bounds how many
    sessions have warm-up work at once (beyond it a warm-up is skipped, reason ``busy``);
    ``max_in_flight_per_replica`` bounds the warm-ups sent to one target replica and not yet
    answered (beyond it a warm-up waits for a slot within ``timeout_s``, then is skipped,
    reason ``replica_busy``): the engine schedules FCFS, so an escalated request queues
    behind every warm-up there (``shell/warm.py``). ``chunk_tokens`` splits a warm-up whose
    exact token ids are known into growing prefixes that each compute at most that many
    tokens (whole blocks), so an escalated request waits behind at most one chunk, not a
    whole first warm-up (``core/warm.py``, ``chunk_bounds``); 0 sends one request. The
    default, 512, kept the worst escalated turn lowest on the live tiers bench
    (``shell/warm.py``, guard 4; ``docs/benchmarks.md#warm-up-chunk-size``): the wait it
    bounds is about ``512 × the engine's prefill time per token``.
    """

    enabled: bool = True
    fraction: float = 0.6
    cooldown_s: float = 300.0
    rewarm_fraction: float = 0.1
    timeout_s: float = 30.0
    max_in_flight: int = 16
    max_in_flight_per_replica: int = 1
    chunk_tokens: int = 512


@dataclass(frozen=True, slots=True)
class AuditSampleConfig:
    """The router's opt-in sample of request bodies for ``kvroute audit``.

    Every ``every``-th request's body (as the client sent it, re-encoded on one line, with its
    session id) is appended to ``path`` as ``{"body": ..., "session": ...}``. Bodies hold
    prompts: turn it on only where writing them to disk is allowed.
    """

    path: str
    every: int = 100


@dataclass(frozen=True, slots=True)
class GateConfig:
    """Where the router reads the fidelity gate's verdicts (docs/model-bound-caches.md).

    ``verdicts``: the JSON file ``kvroute gate`` writes (``--store``); re-read whenever its
    modification time or size changes (checked after every discovery round). None: no file,
    no verdict: every path that would serve state other weights computed recomputes.
    """

    verdicts: str | None = None
    sample: TranscriptSampleConfig | None = None
    """``gate.sample``: the opt-in sample of live conversations for the shadow replay; None
    (the default): nothing is sampled."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TranscriptSampleConfig(SampleSettings):
    """``gate.sample``: finished multi-turn conversations of opted-in tenants, written as
    shadow-replay transcripts (``core/transcript_sample.py``; docs/model-bound-caches.md).

    Off unless configured. Each tenant in ``tenants`` gets ``<directory>/<tenant>.jsonl``;
    the other fields bound the sample. They are ``core.transcript_sample.SampleSettings``'
    own (this class adds only ``directory``), so the sampler takes the config as it is and
    a bound is declared, with its default, in one place. The files hold prompts: turn it on
    only for tenants whose prompts may be written to disk.
    """

    directory: str


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The whole configuration. Built by ``parse_config``/``load_config``; never mutated.

    Invariants (checked at build): at least one pool and one route; replica names unique
    across pools; every route's pools exist; tenant names unique; ``routes`` keys never
    collide with admin paths.
    """

    pools: Mapping[PoolName, PoolConfig]
    routes: Mapping[str, RouteConfig]
    listen: ListenConfig = ListenConfig()
    policy: PolicyConfig = PolicyConfig()
    state: StateConfig = StateConfig()
    cluster: ClusterConfig = ClusterConfig()
    tenants: tuple[TenantConfig, ...] = ()
    admin_key_env: str | None = None
    salt_secret_env: str = "KVROUTE_SALT_SECRET"
    timeouts: TimeoutsConfig = TimeoutsConfig()
    retries: RetryConfig = RetryConfig()
    admission: AdmissionConfig = AdmissionConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    warm_ahead: WarmAheadConfig = WarmAheadConfig()
    cache_drift: CacheDriftSettings = field(default_factory=CacheDriftSettings)
    predicted_ttl_s: float = 2.0
    approx_predicted_ttl_s: float = 120.0
    max_body_bytes: int = 16 * 1024 * 1024
    http: HttpLimitsConfig = HttpLimitsConfig()
    log_level: str = "info"
    log_format: Literal["json", "kv"] = "json"
    audit_sample: AuditSampleConfig | None = None
    kv_stream: KvStreamConfig | None = None
    gate: GateConfig = GateConfig()

    def replicas(self) -> list[tuple[PoolConfig, ReplicaConfig]]:
        """Every replica with its pool, in file order."""
        return [(pool, rep) for pool in self.pools.values() for rep in pool.replicas]

    def replica(self, name: ReplicaId) -> ReplicaConfig:
        for _, rep in self.replicas():
            if rep.name == name:
                return rep
        raise KeyError(name)


# --------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------


def _fail(key: str, value: Any, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{key}: {problem} (got {value!r}). {fix}")


def _check_keys(section: str, data: Mapping[str, Any], allowed: Sequence[str]) -> None:
    for key in data:
        if key in allowed:
            continue
        where = f"{section}.{key}" if section else str(key)
        close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"{where}: unknown key {key!r}. {hint}Allowed keys here: {', '.join(allowed)}."
        )


def _mapping(key: str, value: Any, example: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _fail(key, value, "must be a mapping", f"Write it as e.g. {example}.")
    return value


def _str(key: str, value: Any, *, example: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(key, value, "must be a non-empty string", f"Write e.g. {key.rsplit('.', 1)[-1]}: {example}.")
    return value


def _opt_str(key: str, value: Any, *, example: str) -> str | None:
    return None if value is None else _str(key, value, example=example)


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(key, value, "must be true or false", "Write true or false (no quotes).")
    return value


def _num(key: str, value: Any, *, minimum: float = 0.0, strict: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(key, value, "must be a number", "Write a plain number such as 2.5.")
    if value < minimum or (strict and value == minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise _fail(key, value, f"must be {bound}", f"Use a value {bound}.")
    return float(value)


def _int(key: str, value: Any, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(key, value, "must be an integer", f"Write a whole number >= {minimum}.")
    if value < minimum:
        raise _fail(key, value, f"must be >= {minimum}", f"Use a whole number >= {minimum}.")
    return value


def _name(key: str, value: Any) -> str:
    text = _str(key, value, example="s0")
    if any(ch.isspace() for ch in text) or "/" in text:
        raise _fail(key, value, "must not contain spaces or '/'", "Use letters, digits, '-', '_' or '.'.")
    return text


def _http_url(key: str, value: Any) -> str:
    text = _str(key, value, example='"http://127.0.0.1:8101"')
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _fail(
            key, value, "must be an http(s) URL with a host",
            'Write the engine\'s base URL, e.g. "http://10.0.0.5:8000" (no /v1 suffix).',
        )
    if parts.path.rstrip("/") in ("/v1",):
        raise _fail(key, value, "must not end in /v1", "Give the base URL; kvroute adds /v1/... itself.")
    if parts.query or parts.fragment:
        raise _fail(key, value, "must not carry a query or fragment", "Remove the part after '?' or '#'.")
    return text.rstrip("/")


def _zmq_endpoint(key: str, value: Any) -> str | None:
    if value is None:
        return None
    text = _str(key, value, example='"tcp://127.0.0.1:5557"')
    if not text.startswith(_ZMQ_SCHEMES):
        raise _fail(
            key, value, "must be a ZMQ endpoint",
            'Write e.g. "tcp://10.0.0.5:5557" (the engine\'s kv-events endpoint, host reachable from the router).',
        )
    return text


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------

_TOP_KEYS: Final = (
    "listen", "pools", "routes", "policy", "state", "cluster", "tenants", "admin_key_env",
    "salt_secret_env", "timeouts", "retries", "admission", "discovery", "warm_ahead",
    "cache_drift", "predicted_ttl_s", "approx_predicted_ttl_s", "max_body_bytes", "log_level", "log_format",
    "audit_sample",
    "http", "kv_stream", "gate",
)


def _listen(data: Any) -> ListenConfig:
    d = _mapping("listen", data, "{host: 127.0.0.1, port: 8000}")
    _check_keys("listen", d, ("host", "port"))
    port = _int("listen.port", d.get("port", 8000), minimum=0)
    if port > 65535:
        raise _fail("listen.port", port, "must be <= 65535", "Pick a TCP port between 1 and 65535 (0 = any free port).")
    return ListenConfig(host=_str("listen.host", d.get("host", "127.0.0.1"), example="127.0.0.1"), port=port)


def _tokenizer(key: str, value: Any) -> TokenizerConfig:
    if value is None or value == "auto":
        return TokenizerConfig("auto")
    if value == "engine":
        return TokenizerConfig("engine")
    if value == "none":
        return TokenizerConfig("none")
    if isinstance(value, Mapping):
        _check_keys(key, value, ("local",))
        path = _str(f"{key}.local", value.get("local"), example="/models/qwen3-8b")
        return TokenizerConfig("local", path)
    raise _fail(
        key, value, "must be engine, auto, none, or {local: DIR}",
        "Write tokenizer: engine (the engines' /tokenize), tokenizer: auto (the engines' model "
        "directory when it is on this host, else /tokenize), tokenizer: {local: /path/to/hf-dir}, "
        "or tokenizer: none (approximate routing on text).",
    )


def _replica(key: str, data: Any) -> tuple[ReplicaConfig, ...]:
    """One YAML replica: one entry, or one per data-parallel rank (``data_parallel_size``)."""
    d = _mapping(key, data, '{name: s0, url: "http://127.0.0.1:8101"}')
    _check_keys(key, d, ("name", "url", "kv_events", "kv_replay", "kv_topic", "kv_events_bind",
                         "prefill_rate_tps", "data_parallel_size", "role"))
    if "name" not in d:
        raise _fail(f"{key}.name", None, "is required", "Give every replica a unique name, e.g. name: s0.")
    if "url" not in d:
        raise _fail(f"{key}.url", None, "is required", 'Give the engine\'s base URL, e.g. url: "http://127.0.0.1:8101".')
    replay = _zmq_endpoint(f"{key}.kv_replay", d.get("kv_replay"))
    events = _zmq_endpoint(f"{key}.kv_events", d.get("kv_events"))
    if replay is not None and events is None:
        raise _fail(f"{key}.kv_replay", replay, "is set without kv_events", "Set kv_events too, or remove kv_replay.")
    topic = d.get("kv_topic", "")
    if not isinstance(topic, str):
        raise _fail(f"{key}.kv_topic", topic, "must be a string", 'Write kv_topic: "" (vLLM\'s default) or the engine\'s topic.')
    bind = d.get("kv_events_bind", False)
    if not isinstance(bind, bool):
        raise _fail(f"{key}.kv_events_bind", bind, "must be true or false",
                    "Write kv_events_bind: true when the engine connects to the router.")
    if bind and events is None:
        raise _fail(f"{key}.kv_events_bind", bind, "is set without kv_events",
                    "Set kv_events to the address the engine publishes to.")
    one = ReplicaConfig(
        name=ReplicaId(_name(f"{key}.name", d["name"])),
        url=_http_url(f"{key}.url", d["url"]),
        kv_events=events,
        kv_replay=replay,
        kv_topic=topic,
        kv_events_bind=bind,
        prefill_rate_tps=_num(f"{key}.prefill_rate_tps", d.get("prefill_rate_tps", 10_000.0)),
        role=_role(f"{key}.role", d.get("role", "both")),
    )
    size_value = d.get("data_parallel_size", "auto")
    if size_value == "auto":  # unset too: read from the engine's /metrics by discovery
        return (dataclasses.replace(one, dp_auto=True),)
    size = _int(f"{key}.data_parallel_size", size_value, minimum=1)
    if size == 1:
        return (one,)
    try:
        return expand_dp_ranks(one, size)
    except DpRankClash as exc:
        raise _fail(f"{key}.kv_replay", one.kv_replay, str(exc),
                    f"Rank r uses kv_events' port + r and kv_replay's port + r: leave "
                    f"{size} ports after each, e.g. kv_replay on kv_events' port + {size}.",
                    ) from None
    except DpRankError as exc:
        raise _fail(f"{key}.kv_events", one.kv_events, str(exc),
                    'Give a tcp endpoint with a concrete port, e.g. "tcp://10.0.0.5:5557": '
                    "rank r publishes on port + r.") from None


class DpRankClash(DpRankError):
    """Two ranks of one engine would read the same endpoint (events on a replay port)."""


def expand_dp_ranks(engine: ReplicaConfig, size: int) -> tuple[ReplicaConfig, ...]:
    """The ``size`` rank entries of the engine ``engine`` describes (``<name>.dp<r>``), each
    with its own event endpoints at vLLM's per-rank offset; ``engine.dp_auto`` is kept.

    Raises:
        DpRankClash: a rank's events would share an endpoint with another rank's replay.
        DpRankError: the event endpoint cannot be offset per rank (``ipc``, no port).
    """
    ranks = tuple(_dp_rank_entry(engine, rank, size) for rank in range(size))
    endpoints = [e for rank in ranks for e in (rank.kv_events, rank.kv_replay) if e is not None]
    clash = sorted({e for e in endpoints if endpoints.count(e) > 1})
    if clash:
        raise DpRankClash(f"puts a rank's events and another rank's replay on {clash[0]}")
    return ranks


def _dp_rank_entry(engine: ReplicaConfig, rank: int, size: int) -> ReplicaConfig:
    """Rank ``rank`` of a data-parallel engine: its own name and its own event endpoints."""
    events = None if engine.kv_events is None else offset_endpoint_port(engine.kv_events, rank)
    replay = None if engine.kv_replay is None else offset_endpoint_port(engine.kv_replay, rank)
    return dataclasses.replace(engine, name=ReplicaId(f"{engine.name}.dp{rank}"),
                               kv_events=events, kv_replay=replay, dp_rank=rank,
                               engine=engine.name, dp_size=size)


def _role(key: str, value: Any) -> Role:
    try:
        return check_role(value, key)
    except ValueError:
        raise _fail(key, value, f"must be one of {', '.join(ROLES)}",
                    "Write role: prefill or role: decode for a disaggregated pool's replicas "
                    "(both: an ordinary engine).") from None


_DISAGG_EXAMPLE: Final = "{mode: auto, link_gbps: 12.5, kv_bytes_per_token: 131072}"


def _disaggregation(key: str, data: Any) -> DisaggSpec:
    """``pools.<name>.disaggregation``: the split mode and the P→D link."""
    d = _mapping(key, data, _DISAGG_EXAMPLE)
    _check_keys(key, d, ("mode", "link_gbps", "kv_bytes_per_token"))
    mode = d.get("mode", "auto")
    if mode not in SPLIT_MODES:
        raise _fail(f"{key}.mode", mode, f"must be one of {', '.join(SPLIT_MODES)}",
                    "Write mode: auto (split when the cost model says it pays), always or never.")
    gbps = _num(f"{key}.link_gbps", d.get("link_gbps", 12.5))
    per_token = _num(f"{key}.kv_bytes_per_token", d.get("kv_bytes_per_token", 131_072))
    return DisaggSpec(mode, per_token / (gbps * 1e9))


_EXTERNAL_EXAMPLE: Final = (
    '{external: {url: "https://api.example.com", api_key_env: PROVIDER_KEY, '
    'catalog: {assistant: provider-model-name}}}'
)


def _external(name: str, data: Any) -> PoolConfig:
    """``pools.<name>: {external: {...}}``: an OpenAI-compatible provider as a pool."""
    key = f"pools.{name}.external"
    d = _mapping(key, data, _EXTERNAL_EXAMPLE)
    _check_keys(key, d, ("url", "api_key_env", "catalog", "catalog_from_models"))
    raw_urls = d.get("url")
    if raw_urls is None:
        raise _fail(f"{key}.url", None, "is required",
                    'Give the provider\'s base URL, e.g. url: "https://api.example.com" '
                    "(or a list of endpoint URLs).")
    if isinstance(raw_urls, str):
        raw_urls = [raw_urls]
    if not isinstance(raw_urls, list) or not raw_urls:
        raise _fail(f"{key}.url", raw_urls, "must be a URL or a non-empty list of URLs",
                    'Write url: "https://api.example.com" or url: ["http://a:8000", "http://b:8000"].')
    urls = tuple(_http_url(f"{key}.url[{i}]" if len(raw_urls) > 1 else f"{key}.url", u)
                 for i, u in enumerate(raw_urls))
    if len(set(urls)) != len(urls):
        raise _fail(f"{key}.url", list(raw_urls), "lists an endpoint twice", "List each endpoint URL once.")
    env_name = d.get("api_key_env")
    api_key_env = None if env_name is None else _env_name(f"{key}.api_key_env", env_name)
    raw_catalog = d.get("catalog")
    catalog: Mapping[str, str] | None = None
    if raw_catalog is not None:
        if not isinstance(raw_catalog, Mapping) or not raw_catalog:
            raise _fail(f"{key}.catalog", raw_catalog, "must be a non-empty mapping of route model to provider model",
                        "Write catalog: {assistant: provider-model-name}, or catalog: null to read the provider's /v1/models.")
        entries: dict[str, str] = {}
        for route_model, provider_model in raw_catalog.items():
            entries[_str(f"{key}.catalog", route_model, example="assistant")] = _str(
                f"{key}.catalog.{route_model}", provider_model, example="provider-model-name")
        catalog = MappingProxyType(entries)
    from_models = _bool(f"{key}.catalog_from_models", d.get("catalog_from_models", catalog is None))
    if catalog is None and not from_models:
        raise _fail(f"{key}.catalog_from_models", False, "is false and no catalog is configured",
                    "Configure catalog: {route_model: provider_model, ...}, or set catalog_from_models: true "
                    "to read the provider's /v1/models.")
    replicas = tuple(ReplicaConfig(name=ReplicaId(f"{name}-ext{i}"), url=url)
                     for i, url in enumerate(urls))
    return PoolConfig(
        name=PoolName(name), model="", replicas=replicas, tokenizer=TokenizerConfig("none"),
        external=ExternalConfig(urls=urls, api_key_env=api_key_env, catalog=catalog,
                                catalog_from_models=from_models),
    )


def _pool(name: str, data: Any) -> PoolConfig:
    key = f"pools.{name}"
    d = _mapping(key, data, "{model: qwen3-8b, replicas: [...]}")
    if "external" in d:
        others = sorted(k for k in d if k != "external")
        if others:
            raise _fail(f"{key}.{others[0]}", d[others[0]], "cannot be set on an external pool",
                        f"An external pool is only {_EXTERNAL_EXAMPLE}; its models come from the catalog, "
                        "its endpoints from url.")
        return _external(_name("pools", name), d["external"])
    _check_keys(key, d, ("model", "replicas", "tokenizer", "block_size", "hash_algo", "hash_seed",
                         "external", "decode_timing", "report_hits", "lora_adapters",
                         "kubernetes", "policy_params", "disaggregation"))
    model = _str(f"{key}.model", d.get("model"), example="qwen3-8b")
    reps = d.get("replicas")
    kubernetes = None if d.get("kubernetes") is None else _kubernetes(f"{key}.kubernetes",
                                                                       d["kubernetes"])
    if kubernetes is not None:
        if reps is not None:
            raise _fail(f"{key}.replicas", reps, "cannot be set with kubernetes",
                        "Remove replicas: the pool's engines are read from the Kubernetes API.")
        reps = []
    elif not isinstance(reps, list) or not reps:
        raise _fail(
            f"{key}.replicas", reps, "must be a non-empty list",
            'List the engines, e.g. replicas: [{name: s0, url: "http://127.0.0.1:8101"}], '
            "or read them from the Kubernetes API with kubernetes: {namespace: ..., label_selector: ...}.",
        )
    replicas = tuple(entry for i, r in enumerate(reps)
                     for entry in _replica(f"{key}.replicas[{i}]", r))
    block_size = d.get("block_size")
    if block_size is not None:
        block_size = _int(f"{key}.block_size", block_size, minimum=1)
    roled = [r for r in replicas if r.role != "both"]
    if roled and d.get("disaggregation") is None:
        raise _fail(f"{key}.disaggregation", None,
                    f"is needed: replica {roled[0].name!r} has role {roled[0].role!r}",
                    f"Add disaggregation: {_DISAGG_EXAMPLE} to the pool, or make every "
                    "replica's role both.")
    return PoolConfig(
        name=PoolName(_name("pools", name)),
        model=model,
        replicas=replicas,
        tokenizer=_tokenizer(f"{key}.tokenizer", d.get("tokenizer")),
        block_size=block_size,
        hash_algo=_opt_str(f"{key}.hash_algo", d.get("hash_algo"), example="sha256"),
        hash_seed=_opt_str(f"{key}.hash_seed", d.get("hash_seed"), example='"0"'),
        decode_timing=_decode_timing(f"{key}.decode_timing", d.get("decode_timing")),
        report_hits=_bool(f"{key}.report_hits", d.get("report_hits", False)),
        lora_adapters=_lora_adapters(f"{key}.lora_adapters", d.get("lora_adapters"), model),
        kubernetes=kubernetes,
        policy_params=_policy_params(f"{key}.policy_params", d.get("policy_params")),
        disaggregation=None if d.get("disaggregation") is None else _disaggregation(
            f"{key}.disaggregation", d["disaggregation"]),
    )


_KUBERNETES_EXAMPLE: Final = "{namespace: llm, label_selector: kubernetes.io/service-name=vllm}"


def _kubernetes(key: str, data: Any) -> KubernetesSource:
    """``pools.<name>.kubernetes``: the EndpointSlices the pool's engines are read from."""
    d = _mapping(key, data, _KUBERNETES_EXAMPLE)
    _check_keys(key, d, ("namespace", "label_selector", "http_port", "kv_events_port",
                         "kubeconfig", "prefill_rate_tps"))
    kv_port = d.get("kv_events_port", "kv-events")
    return KubernetesSource(
        namespace=_str(f"{key}.namespace", d.get("namespace"), example="llm"),
        label_selector=_str(f"{key}.label_selector", d.get("label_selector"),
                            example="kubernetes.io/service-name=vllm"),
        http_port=_str(f"{key}.http_port", d.get("http_port", "http"), example="http"),
        kv_events_port=None if kv_port is None else _str(f"{key}.kv_events_port", kv_port,
                                                         example="kv-events"),
        kubeconfig=_opt_str(f"{key}.kubeconfig", d.get("kubeconfig"), example="~/.kube/config"),
        prefill_rate_tps=_num(f"{key}.prefill_rate_tps", d.get("prefill_rate_tps", 10_000.0)),
    )


def _lora_adapters(key: str, data: Any, model: str) -> Mapping[str, str]:
    if data is None:
        return MappingProxyType({})
    d = _mapping(key, data, "{sql-lora: /adapters/sql-lora}")
    out: dict[str, str] = {}
    for name, path in d.items():
        adapter = _str(key, name, example="sql-lora")
        if adapter == model:
            raise _fail(f"{key}.{adapter}", path, "names the pool's own model",
                        "Give the adapter a name of its own, as clients will send it.")
        out[adapter] = _str(f"{key}.{adapter}", path, example="/adapters/sql-lora")
    return MappingProxyType(out)


def _decode_timing(key: str, data: Any) -> DecodeTiming:
    if data is None:
        return DEFAULT_DECODE_TIMING
    d = _mapping(key, data, "{fixed_s: 0.006, seq_s: 0.00002, context_token_s: 0.00000005}")
    _check_keys(key, d, ("fixed_s", "seq_s", "context_token_s"))
    base = DEFAULT_DECODE_TIMING
    return DecodeTiming(
        fixed_s=_num(f"{key}.fixed_s", d.get("fixed_s", base.fixed_s), strict=False),
        seq_s=_num(f"{key}.seq_s", d.get("seq_s", base.seq_s), strict=False),
        context_token_s=_num(f"{key}.context_token_s",
                             d.get("context_token_s", base.context_token_s), strict=False),
    )


def _route(name: str, data: Any, pools: Mapping[PoolName, PoolConfig]) -> RouteConfig:
    key = f"routes.{name}"
    if not name or any(ord(ch) < 32 for ch in name):
        # NOTE: the route's name is part of every session's key (core/session.session_key,
        # control characters separate its parts).
        raise _fail("routes", name, "must be a non-empty model name without control characters",
                    "Name the route as clients name the model, e.g. llama-3.1-8b.")
    d = _mapping(key, data, "{pools: [small]}")
    _check_keys(key, d, ("pools", "output_floor", "tokenize_margin", "proactive",
                         "image_tokens", "reasoning", *_SCENARIO_KEYS))
    names = d.get("pools")
    if not isinstance(names, list) or not names:
        raise _fail(f"{key}.pools", names, "must be a non-empty list of pool names", f"Write e.g. pools: [{next(iter(pools))}].")
    out: list[PoolName] = []
    for i, pool in enumerate(names):
        if pool not in pools:
            close = difflib.get_close_matches(str(pool), list(pools), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise _fail(f"{key}.pools[{i}]", pool, "is not a pool defined under pools:", f"Known pools: {', '.join(pools)}.{hint}")
        if pool in out:
            raise _fail(f"{key}.pools[{i}]", pool, "is listed twice", "List each pool once, smallest window first.")
        out.append(PoolName(pool))
    floor = _int(f"{key}.output_floor", d.get("output_floor", 256), minimum=1)
    margin = _num(f"{key}.tokenize_margin", d.get("tokenize_margin", 0.2), strict=False)
    if margin >= 1.0:
        raise _fail(f"{key}.tokenize_margin", margin, "must be below 1",
                    "Use the share below the estimate still worth an exact count, e.g. 0.2.")
    proactive = _bool(f"{key}.proactive", d.get("proactive", True))
    return RouteConfig(name=name, pools=tuple(out), output_floor=floor, tokenize_margin=margin,
                       proactive=proactive,
                       image_tokens=_image_tokens(f"{key}.image_tokens", d.get("image_tokens")),
                       reasoning=_reasoning(f"{key}.reasoning", d.get("reasoning")),
                       scenarios=_scenarios(key, d, pools, tuple(out)))


def _reasoning(key: str, data: Any) -> ReasoningSettings | None:
    """``reasoning: {switch: qwen3, thinking: true, budget: 2048, max_budget: 8192}``."""
    if data is None:
        return None
    d = _mapping(key, data, "{switch: qwen3, thinking: true, budget: 2048}")
    _check_keys(key, d, ("switch", "thinking", "budget", "max_budget", "classifier"))
    thinking = d.get("thinking")
    auto = thinking == "auto"
    if thinking is not None and not auto:
        thinking = _bool(f"{key}.thinking", thinking)
    budgets = {name: None if d.get(name) is None else _int(f"{key}.{name}", d[name], minimum=1)
               for name in ("budget", "max_budget")}
    try:
        return ReasoningSettings(switch=d.get("switch", "qwen3"),
                                 thinking=None if auto else thinking, auto=auto,
                                 classifier=d.get("classifier", "rules"), **budgets)
    except ValueError as exc:
        raise _fail(key, data, f"is not a valid reasoning setting ({exc})",
                    f"Use switch: one of {', '.join(THINK_SWITCHES)}; thinking: true, false or "
                    "auto; budget <= max_budget.") \
            from exc


_IMAGE_FIELDS: Final = tuple(f.name for f in dataclasses.fields(ImageCost))


def _image_tokens(key: str, data: Any) -> ImageCost:
    """``image_tokens: {family: <preset or grid|fixed|tiled>, <ImageCost field>: ...}``."""
    if data is None:
        return ImageCost()
    d = _mapping(key, data, "{family: qwen-vl}")
    _check_keys(key, d, _IMAGE_FIELDS)
    family = d.get("family", "grid")
    known = (*IMAGE_PRESETS, *IMAGE_FAMILIES)
    if family not in known:
        raise _fail(f"{key}.family", family, "is not an image family",
                    f"Choose a preset ({', '.join(IMAGE_PRESETS)}) or a rule "
                    f"({', '.join(IMAGE_FAMILIES)}) with its numbers.")
    base = IMAGE_PRESETS[family] if family in IMAGE_PRESETS else ImageCost(family)
    changes = {k: v for k, v in d.items() if k != "family"}
    try:
        return dataclasses.replace(base, **changes)
    except (TypeError, ValueError) as exc:
        raise _fail(key, data, f"is not a valid image cost ({exc})",
                    "Give whole numbers >= 1, e.g. {family: tiled, tile_px: 448, "
                    "tokens_per_tile: 256, max_tiles: 12}.") from exc


_SCENARIO_KEYS: Final = ("upgrade", "ab_split", "failover", "version_salt")


def _scenarios(key: str, d: Mapping[str, Any], pools: Mapping[PoolName, PoolConfig],
               route_pools: tuple[PoolName, ...]) -> RouteScenarios:
    """A route's model-bound cache scenarios (docs/model-bound-caches.md)."""
    upgrade = None
    if d.get("upgrade") is not None:
        k = f"{key}.upgrade"
        u = _mapping(k, d["upgrade"], "{warm_budget_tokens: 200000}")
        _check_keys(k, u, ("warm_budget_tokens", "move_sessions", "warm_timeout_s",
                           "ready_share"))
        share = _num(f"{k}.ready_share", u.get("ready_share", 0.5))
        if share > 1.0:
            raise _fail(f"{k}.ready_share", share, "must be at most 1",
                        "Use the share of the pool the new version must hold, e.g. 0.5.")
        upgrade = UpgradeSettings(
            warm_budget_tokens=_int(f"{k}.warm_budget_tokens", u.get("warm_budget_tokens", 0)),
            move_sessions=_bool(f"{k}.move_sessions", u.get("move_sessions", True)),
            warm_timeout_s=_num(f"{k}.warm_timeout_s", u.get("warm_timeout_s", 60.0)),
            ready_share=share)
    split = None
    if d.get("ab_split") is not None:
        k = f"{key}.ab_split"
        a = _mapping(k, d["ab_split"], "{arms: {main: 1, candidate: 1}}")
        _check_keys(k, a, ("arms", "sticky"))
        arms_raw = _mapping(f"{k}.arms", a.get("arms"), "{main: 1, candidate: 1}")
        arms = []
        for pool, weight in arms_raw.items():
            _known_pool(f"{k}.arms.{pool}", pool, pools)
            arms.append(AbArm(PoolName(str(pool)), _num(f"{k}.arms.{pool}", weight)))
        if len(arms) < 2:
            raise _fail(f"{k}.arms", dict(arms_raw), "needs at least two arms",
                        "Name two or more pools with their weights, e.g. {main: 1, candidate: 1}.")
        if len(route_pools) != 1 or route_pools[0] not in arms_raw:
            raise _fail(f"{key}.pools", list(route_pools), "must be exactly one of the A/B arms",
                        "An A/B route has one tier: list its control arm, e.g. "
                        f"pools: [{arms[0].pool}] (the other arms take its place by weight).")
        split = AbSplitSettings(tuple(arms), sticky=_bool(f"{k}.sticky", a.get("sticky", True)))
    failover = None
    if d.get("failover") is not None:
        k = f"{key}.failover"
        f = _mapping(k, d["failover"], "{backup: cloud}")
        _check_keys(k, f, ("primary", "backup", "saturated_waiting", "back_after_s",
                           "warm_budget_tokens", "warm_interval_s"))
        primary = f.get("primary", route_pools[0])
        if primary not in route_pools:
            raise _fail(f"{k}.primary", primary, "is not one of the route's pools",
                        f"Name one of {', '.join(route_pools)} (default: the first).")
        backup = f.get("backup")
        _known_pool(f"{k}.backup", backup, pools)
        if backup in route_pools:
            raise _fail(f"{k}.backup", backup, "is already one of the route's pools",
                        "A backup stands in for the primary: name a pool the route does not list.")
        failover = FailoverSettings(
            primary=PoolName(str(primary)), backup=PoolName(str(backup)),
            saturated_waiting=_int(f"{k}.saturated_waiting", f.get("saturated_waiting", 8),
                                   minimum=1),
            back_after_s=_num(f"{k}.back_after_s", f.get("back_after_s", 30.0), strict=False),
            warm_budget_tokens=_int(f"{k}.warm_budget_tokens", f.get("warm_budget_tokens", 0)),
            warm_interval_s=_num(f"{k}.warm_interval_s", f.get("warm_interval_s", 30.0)))
    return RouteScenarios(upgrade=upgrade, ab_split=split, failover=failover,
                          version_salt=_bool(f"{key}.version_salt", d.get("version_salt", False)))


def _known_pool(key: str, pool: Any, pools: Mapping[PoolName, PoolConfig]) -> None:
    if pool not in pools:
        close = difflib.get_close_matches(str(pool), list(pools), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise _fail(key, pool, "is not a pool defined under pools:",
                    f"Known pools: {', '.join(pools)}.{hint}")


def _policy_params(key: str, data: Any) -> Mapping[str, float | int | bool]:
    """A mapping of policy parameter names to numbers (or true/false), at ``key``."""
    params = _mapping(key, data, "{work_weight: 0.5}")
    for pkey, pval in params.items():
        if not isinstance(pval, int | float):  # bool is an int
            raise _fail(f"{key}.{pkey}", pval, "must be a number or true/false",
                        "Policy parameters are numbers.")
    return MappingProxyType(dict(params))


def _check_pool_policy(policy: PolicyConfig, pools: Mapping[PoolName, PoolConfig]) -> None:
    """Every pool's ``policy_params`` names parameters the configured policy takes."""
    known = policy_parameters(policy.name)
    for pool in pools.values():
        for pkey, pval in pool.policy_params.items():
            if pkey not in known:
                close = difflib.get_close_matches(pkey, list(known), n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise _fail(f"pools.{pool.name}.policy_params.{pkey}", pval,
                            f"is not a parameter of policy {policy.name!r}",
                            f"It takes {', '.join(known) if known else 'no parameters'}.{hint}")


def _policy(data: Any) -> PolicyConfig:
    d = _mapping("policy", data, "{name: kvroute}")
    _check_keys("policy", d, ("name", "params", "seed"))
    name = d.get("name", "kvroute")
    if name not in POLICY_NAMES:
        close = difflib.get_close_matches(str(name), POLICY_NAMES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise _fail("policy.name", name, "is not a known policy", f"Choose one of: {', '.join(POLICY_NAMES)}.{hint}")
    params = _policy_params("policy.params", d.get("params"))
    seed = d.get("seed")
    if seed is not None:
        seed = _int("policy.seed", seed)
    return PolicyConfig(name=name, params=params, seed=seed)


def _state(data: Any) -> StateConfig:
    d = _mapping("state", data, "{backend: memory}")
    _check_keys("state", d, ("backend", "url", "namespace", "timeout_s", "session_ttl_s",
                             "max_pins", "max_warm", "max_chain_tokens"))
    backend = d.get("backend", "memory")
    if backend not in ("memory", "redis"):
        raise _fail("state.backend", backend, "must be memory or redis", 'Write backend: memory, or backend: redis with url: "redis://host:6379/0".')
    url = d.get("url")
    if backend == "redis":
        url = _str("state.url", url, example='"redis://127.0.0.1:6379/0"')
        if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise _fail("state.url", url, "must be a redis:// URL", 'Write e.g. url: "redis://127.0.0.1:6379/0".')
    elif url is not None:
        raise _fail("state.url", url, "is only used with backend: redis", "Remove url, or set backend: redis.")
    base = StateConfig()
    return StateConfig(
        backend=backend,
        url=url,
        namespace=_str("state.namespace", d.get("namespace", base.namespace), example="kvroute"),
        timeout_s=_num("state.timeout_s", d.get("timeout_s", base.timeout_s)),
        session_ttl_s=_num("state.session_ttl_s", d.get("session_ttl_s", base.session_ttl_s)),
        max_pins=_int("state.max_pins", d.get("max_pins", base.max_pins), minimum=1),
        max_warm=_int("state.max_warm", d.get("max_warm", base.max_warm), minimum=1),
        max_chain_tokens=_int("state.max_chain_tokens",
                              d.get("max_chain_tokens", base.max_chain_tokens), minimum=0),
    )


_SUBJECT_TOKEN: Final = re.compile(r"[A-Za-z0-9_-]+")


def _cluster(data: Any) -> ClusterConfig:
    d = _mapping("cluster", data, '{bus: nats, url: "nats://127.0.0.1:4222"}')
    _check_keys("cluster", d, ("bus", "url", "subject", "router_id", "heartbeat_s",
                               "peer_expiry_s", "secret_env", "secret"))
    base = ClusterConfig()
    bus = d.get("bus", "none")
    if bus not in ("none", "nats"):
        raise _fail("cluster.bus", bus, "must be none or nats",
                    'Write bus: none (one router), or bus: nats with url: "nats://host:4222".')
    url = d.get("url")
    if bus == "nats":
        url = _str("cluster.url", url, example='"nats://127.0.0.1:4222"')
        parts = urlsplit(url)
        if parts.scheme not in ("nats", "tls") or not parts.hostname:
            raise _fail("cluster.url", url, "must be a nats:// URL with a host",
                        'Write e.g. url: "nats://127.0.0.1:4222".')
    elif url is not None:
        raise _fail("cluster.url", url, "is only used with bus: nats",
                    "Remove url, or set bus: nats.")
    subject = _str("cluster.subject", d.get("subject", base.subject), example="kvroute.cluster")
    if not all(_SUBJECT_TOKEN.fullmatch(token) for token in subject.split(".")):
        raise _fail("cluster.subject", subject,
                    "must be dot-separated tokens of letters, digits, - and _ (no wildcards)",
                    "Write e.g. subject: kvroute.cluster.prod (one subject per fleet).")
    router_id = d.get("router_id", base.router_id)
    if router_id != "" and not (isinstance(router_id, str)
                                and _SUBJECT_TOKEN.fullmatch(router_id)):
        raise _fail("cluster.router_id", router_id,
                    "must be letters, digits, - and _ (or empty for <hostname>-<pid>)",
                    "Write e.g. router_id: router-a, or remove it.")
    heartbeat_s = _num("cluster.heartbeat_s", d.get("heartbeat_s", base.heartbeat_s))
    expiry_s = _num("cluster.peer_expiry_s", d.get("peer_expiry_s", base.peer_expiry_s))
    if expiry_s < 2 * heartbeat_s:
        raise _fail("cluster.peer_expiry_s", expiry_s,
                    f"must be at least twice heartbeat_s ({heartbeat_s})",
                    "Otherwise one late heartbeat drops a live peer's load; raise peer_expiry_s "
                    "or lower heartbeat_s.")
    secret_env = _env_name("cluster.secret_env", d.get("secret_env", base.secret_env))
    secret = d.get("secret")
    if secret is not None and not (isinstance(secret, str)
                                   and len(secret.encode("utf-8")) >= MIN_SECRET_BYTES):
        # the value itself is never echoed: it may be a real secret with a typo
        raise ConfigError(
            f"cluster.secret: must be a string of at least {MIN_SECRET_BYTES} bytes (got a "
            f"{type(secret).__name__} that is not). Prefer the environment: remove secret and "
            f"export {secret_env} with a long random value, e.g. from "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`.")
    return ClusterConfig(bus=bus, url=url, subject=subject, router_id=router_id,
                         heartbeat_s=heartbeat_s, peer_expiry_s=expiry_s,
                         secret_env=secret_env, secret=secret)


def _env_name(key: str, value: Any) -> str:
    text = _str(key, value, example="ACME_KEY")
    if not text.replace("_", "").isalnum() or text[0].isdigit():
        raise _fail(key, value, "must be an environment variable name, not the key itself",
                    "Put the key in an environment variable and write its name here, e.g. ACME_KEY.")
    return text


def _tenants(data: Any) -> tuple[TenantConfig, ...]:
    if data is None:
        return ()
    if not isinstance(data, list):
        raise _fail("tenants", data, "must be a list", "Write tenants: [{name: acme, api_key_env: ACME_KEY, cache_salt: true}] or tenants: [].")
    out: list[TenantConfig] = []
    seen_envs: dict[str, str] = {}
    for i, item in enumerate(data):
        key = f"tenants[{i}]"
        d = _mapping(key, item, "{name: acme, api_key_env: ACME_KEY}")
        _check_keys(key, d, ("name", "api_key_env", "cache_salt", "routing_headers"))
        name = _name(f"{key}.name", d.get("name"))
        if any(t.name == name for t in out):
            raise _fail(f"{key}.name", name, "is defined twice", "Tenant names must be unique.")
        if "api_key_env" not in d:
            raise _fail(f"{key}.api_key_env", None, "is required", "Name the environment variable that holds this tenant's API key.")
        env = _env_name(f"{key}.api_key_env", d["api_key_env"])
        if env in seen_envs:
            raise _fail(f"{key}.api_key_env", env, f"is already tenant {seen_envs[env]!r}'s key",
                        "Give each tenant its own key: a shared key cannot tell them apart.")
        seen_envs[env] = name
        out.append(TenantConfig(
            TenantName(name), env, _bool(f"{key}.cache_salt", d.get("cache_salt", True)),
            _bool(f"{key}.routing_headers", d.get("routing_headers", False))))
    return tuple(out)


def _http_limits(data: Any) -> HttpLimitsConfig:
    d = _mapping("http", data, "{header_timeout_s: 60, max_connections: 4096}")
    fields_ = ("max_header_bytes", "header_timeout_s", "body_timeout_s", "send_timeout_s",
               "idle_timeout_s", "max_connections")
    _check_keys("http", d, fields_)
    base = HttpLimitsConfig()
    return HttpLimitsConfig(
        max_header_bytes=_int("http.max_header_bytes",
                              d.get("max_header_bytes", base.max_header_bytes), minimum=1024),
        header_timeout_s=_num("http.header_timeout_s",
                              d.get("header_timeout_s", base.header_timeout_s)),
        body_timeout_s=_num("http.body_timeout_s", d.get("body_timeout_s", base.body_timeout_s)),
        send_timeout_s=_num("http.send_timeout_s", d.get("send_timeout_s", base.send_timeout_s)),
        idle_timeout_s=_num("http.idle_timeout_s", d.get("idle_timeout_s", base.idle_timeout_s)),
        max_connections=_int("http.max_connections",
                             d.get("max_connections", base.max_connections), minimum=1),
    )


def _timeouts(data: Any) -> TimeoutsConfig:
    d = _mapping("timeouts", data, "{connect_s: 2, first_byte_s: 60, total_s: 600}")
    _check_keys("timeouts", d, ("connect_s", "first_byte_s", "total_s", "stall_s"))
    base = TimeoutsConfig()
    cfg = TimeoutsConfig(
        connect_s=_num("timeouts.connect_s", d.get("connect_s", base.connect_s)),
        first_byte_s=_num("timeouts.first_byte_s", d.get("first_byte_s", base.first_byte_s)),
        total_s=_num("timeouts.total_s", d.get("total_s", base.total_s)),
        stall_s=_num("timeouts.stall_s", d.get("stall_s", base.stall_s)),
    )
    if cfg.first_byte_s > cfg.total_s:
        raise _fail("timeouts.first_byte_s", cfg.first_byte_s, f"is longer than timeouts.total_s ({cfg.total_s:g})",
                    "The first byte must be allowed to arrive within the total: lower first_byte_s or raise total_s.")
    return cfg


def _retries(data: Any) -> RetryConfig:
    d = _mapping("retries", data, "{max_retries: 2}")
    _check_keys("retries", d, ("max_retries",))
    return RetryConfig(max_retries=_int("retries.max_retries", d.get("max_retries", 2)))


def _admission(data: Any) -> AdmissionConfig:
    d = _mapping("admission", data, "{max_in_flight: 256, max_queue: 1024, queue_timeout_s: 30}")
    _check_keys("admission", d, ("max_in_flight", "max_queue", "queue_timeout_s", "retry_after_s"))
    base = AdmissionConfig()
    return AdmissionConfig(
        max_in_flight=_int("admission.max_in_flight", d.get("max_in_flight", base.max_in_flight), minimum=1),
        max_queue=_int("admission.max_queue", d.get("max_queue", base.max_queue)),
        queue_timeout_s=_num("admission.queue_timeout_s", d.get("queue_timeout_s", base.queue_timeout_s)),
        retry_after_s=_int("admission.retry_after_s", d.get("retry_after_s", base.retry_after_s), minimum=1),
    )


def _discovery(data: Any) -> DiscoveryConfig:
    d = _mapping("discovery", data, "{metrics_interval_s: 2}")
    fields_ = ("models_interval_s", "metrics_interval_s", "health_interval_s", "timeout_s", "window_ttl_s")
    _check_keys("discovery", d, (*fields_, "unhealthy_after"))
    base = DiscoveryConfig()
    values = {f: _num(f"discovery.{f}", d.get(f, getattr(base, f))) for f in fields_}
    return DiscoveryConfig(
        **values,
        unhealthy_after=_int("discovery.unhealthy_after", d.get("unhealthy_after", base.unhealthy_after), minimum=1),
    )


def _cache_drift(data: Any) -> CacheDriftSettings:
    """``cache_drift:`` (``core/cache_drift.py``; docs/observability.md, the drift alarm)."""
    d = _mapping("cache_drift", data, "{threshold: 0.5}")
    base = CacheDriftSettings()
    _check_keys("cache_drift", d, ("enabled", "threshold", "window", "min_samples",
                                   "tolerance_blocks", "tolerance_fraction",
                                   "approximate_on_alarm"))

    def get(key: str) -> Any:
        return d.get(key, getattr(base, key))

    return CacheDriftSettings(
        enabled=_bool("cache_drift.enabled", get("enabled")),
        threshold=_num("cache_drift.threshold", get("threshold")),
        window=_int("cache_drift.window", get("window"), minimum=1),
        min_samples=_int("cache_drift.min_samples", get("min_samples"), minimum=1),
        tolerance_blocks=_int("cache_drift.tolerance_blocks", get("tolerance_blocks")),
        tolerance_fraction=_num("cache_drift.tolerance_fraction", get("tolerance_fraction"),
                                strict=False),
        approximate_on_alarm=_bool("cache_drift.approximate_on_alarm",
                                   get("approximate_on_alarm")),
    )


def _warm_ahead(data: Any, env: Mapping[str, str]) -> WarmAheadConfig:
    d = _mapping("warm_ahead", data, "{enabled: true, fraction: 0.6, cooldown_s: 300}")
    _check_keys("warm_ahead", d, ("enabled", "fraction", "cooldown_s", "rewarm_fraction",
                                  "timeout_s", "max_in_flight", "max_in_flight_per_replica",
                                  "chunk_tokens"))
    base = WarmAheadConfig()
    enabled = _bool("warm_ahead.enabled", d.get("enabled", base.enabled))
    fraction = _num("warm_ahead.fraction", d.get("fraction", base.fraction))
    if fraction >= 1.0:
        raise _fail("warm_ahead.fraction", fraction, "must be below 1", "Use the share of the window at which to warm, e.g. 0.6.")
    override = env.get(WARM_AHEAD_ENV)
    if override is not None:
        if override.strip() not in ("0", "1"):
            raise _fail(WARM_AHEAD_ENV, override, "must be 0 or 1", f"Set {WARM_AHEAD_ENV}=0 to switch warm-ahead off, 1 to force it on, or unset it.")
        enabled = override.strip() == "1"
    return WarmAheadConfig(
        enabled=enabled,
        fraction=fraction,
        cooldown_s=_num("warm_ahead.cooldown_s", d.get("cooldown_s", base.cooldown_s), strict=False),
        rewarm_fraction=_rewarm(d.get("rewarm_fraction", base.rewarm_fraction)),
        timeout_s=_num("warm_ahead.timeout_s", d.get("timeout_s", base.timeout_s)),
        max_in_flight=_int("warm_ahead.max_in_flight", d.get("max_in_flight", base.max_in_flight), minimum=1),
        max_in_flight_per_replica=_per_replica(d.get("max_in_flight_per_replica", base.max_in_flight_per_replica)),
        chunk_tokens=_chunk_tokens(d.get("chunk_tokens", base.chunk_tokens)),
    )


def _chunk_tokens(value: Any) -> int:
    key = "warm_ahead.chunk_tokens"
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(key, value, "must be an integer",
                    "Write a whole number of tokens, e.g. 512 (the default), or 0 to send each warm-up as one request.")
    if value < 0:
        raise _fail(key, value, "must be >= 0",
                    "Use the most tokens one warm-up request may prefill, e.g. 512, or 0 to send each warm-up as one request.")
    return value


def _per_replica(value: Any) -> int:
    key = "warm_ahead.max_in_flight_per_replica"
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(key, value, "must be an integer", "Write a whole number >= 1, e.g. 1 (the default).")
    if value < 1:
        raise _fail(key, value, "must be >= 1",
                    "Use 1 (the default: an escalated request waits behind at most one warm-up per "
                    "replica) or more; to stop warm-ups set warm_ahead.enabled: false.")
    return value


def _rewarm(value: Any) -> float:
    share = _num("warm_ahead.rewarm_fraction", value)
    if share > 1.0:
        raise _fail("warm_ahead.rewarm_fraction", value, "must be at most 1",
                    "Use the growth (share of the window) that allows another warm-up, e.g. 0.1; 1 = once per cooldown.")
    return share


_RESERVED_ROUTES: Final = frozenset({"admin", "health", "metrics"})


def parse_config(data: Any, *, env: Mapping[str, str] | None = None) -> RouterConfig:
    """Validate a decoded YAML document and build the config tree.

    Args:
        data: the decoded document (a mapping).
        env: environment for ``KVROUTE_WARM_AHEAD``; ``os.environ`` when None.

    Raises:
        ConfigError: naming the key, the value and the fix, for the first problem found.
    """
    env = os.environ if env is None else env
    if not isinstance(data, Mapping):
        raise _fail("(top level)", data, "must be a mapping", "Start the file with keys such as listen:, pools:, routes:.")
    _check_keys("", data, _TOP_KEYS)

    pools_raw = data.get("pools")
    if not isinstance(pools_raw, Mapping) or not pools_raw:
        raise _fail("pools", pools_raw, "must define at least one pool",
                    'Write pools: {small: {model: qwen3-8b, replicas: [{name: s0, url: "http://127.0.0.1:8101"}]}}.')
    pools: dict[PoolName, PoolConfig] = {}
    replica_pool: dict[str, str] = {}
    for pname, pdata in pools_raw.items():
        pool = _pool(str(pname), pdata)
        for i, rep in enumerate(pool.replicas):
            if rep.name in replica_pool:
                raise _fail(f"pools.{pname}.replicas[{i}].name", rep.name,
                            f"is already used in pool {replica_pool[rep.name]!r}",
                            "Replica names must be unique across all pools.")
            replica_pool[rep.name] = pool.name
        pools[pool.name] = pool

    routes_raw = data.get("routes")
    if not isinstance(routes_raw, Mapping) or not routes_raw:
        first = next(iter(pools))
        raise _fail("routes", routes_raw, "must define at least one route",
                    f"Name the model clients send, e.g. routes: {{assistant: {{pools: [{first}]}}}}.")
    routes: dict[str, RouteConfig] = {}
    for rname, rdata in routes_raw.items():
        name = _str("routes", rname, example="assistant")
        if name in _RESERVED_ROUTES:
            raise _fail(f"routes.{name}", name, "is a reserved word", "Pick another model name for the route.")
        routes[name] = _route(name, rdata, pools)
    for pool in pools.values():
        catalog = pool.external.catalog if pool.external is not None else None
        for route_model in catalog or ():
            if route_model not in routes:
                raise _fail(f"pools.{pool.name}.external.catalog.{route_model}", route_model,
                            "is not a route", "Catalog keys are the model names clients send: "
                            f"use one of the routes ({', '.join(routes)}), or remove the entry.")

    log_level = data.get("log_level", "info")
    if not isinstance(log_level, str) or log_level.lower() not in _LOG_LEVELS:
        raise _fail("log_level", log_level, "is not a log level", f"Choose one of: {', '.join(_LOG_LEVELS)}.")
    log_format = data.get("log_format", "json")
    if log_format not in ("json", "kv"):
        raise _fail("log_format", log_format, "must be json or kv", "Write log_format: json (one JSON object per line) or kv (key=value).")
    admin_env = data.get("admin_key_env")
    admin_key_env = None if admin_env is None else _env_name("admin_key_env", admin_env)
    policy = _policy(data.get("policy"))
    _check_pool_policy(policy, pools)
    tenants = _tenants(data.get("tenants"))
    return RouterConfig(
        pools=MappingProxyType(pools),
        routes=MappingProxyType(routes),
        listen=_listen(data.get("listen")),
        policy=policy,
        state=_state(data.get("state")),
        cluster=_cluster(data.get("cluster")),
        tenants=tenants,
        admin_key_env=admin_key_env,
        salt_secret_env=_env_name("salt_secret_env", data.get("salt_secret_env", "KVROUTE_SALT_SECRET")),
        timeouts=_timeouts(data.get("timeouts")),
        retries=_retries(data.get("retries")),
        admission=_admission(data.get("admission")),
        discovery=_discovery(data.get("discovery")),
        warm_ahead=_warm_ahead(data.get("warm_ahead"), env),
        cache_drift=_cache_drift(data.get("cache_drift")),
        predicted_ttl_s=_num("predicted_ttl_s", data.get("predicted_ttl_s", 2.0)),
        approx_predicted_ttl_s=_num("approx_predicted_ttl_s", data.get("approx_predicted_ttl_s", 120.0)),
        max_body_bytes=_int("max_body_bytes", data.get("max_body_bytes", 16 * 1024 * 1024), minimum=1024),
        http=_http_limits(data.get("http")),
        log_level=log_level.lower(),
        log_format=log_format,
        audit_sample=_audit_sample(data.get("audit_sample")),
        kv_stream=_kv_stream(data.get("kv_stream")),
        gate=_gate(data.get("gate"), tenants),
    )


def _gate(data: Any, tenants: Sequence[TenantConfig] = ()) -> GateConfig:
    if data is None:
        return GateConfig()
    d = _mapping("gate", data, "{verdicts: /var/lib/kvroute/verdicts.json}")
    _check_keys("gate", d, ("verdicts", "sample"))
    return GateConfig(verdicts=_opt_str("gate.verdicts", d.get("verdicts"),
                                        example="/var/lib/kvroute/verdicts.json"),
                      sample=_transcript_sample(d.get("sample"), tenants))


_SAMPLE_EXAMPLE = "{directory: /var/lib/kvroute/transcripts, tenants: [acme], rate: 0.05}"


def _transcript_sample(data: Any, tenants: Sequence[TenantConfig]) -> TranscriptSampleConfig | None:
    if data is None:
        return None
    d = _mapping("gate.sample", data, _SAMPLE_EXAMPLE)
    _check_keys("gate.sample", d, ("directory",
                                   *(f.name for f in dataclasses.fields(SampleSettings))))
    base = TranscriptSampleConfig(directory="", tenants=())
    directory = _str("gate.sample.directory", d.get("directory"),
                     example="/var/lib/kvroute/transcripts")
    names = d.get("tenants")
    known = [t.name for t in tenants] or [DEFAULT_TENANT]
    if not isinstance(names, list) or not names:
        raise _fail("gate.sample.tenants", names, "must be a non-empty list of tenant names",
                    f"Opt tenants in by name, e.g. tenants: [{known[0]}] (prompts go to disk).")
    for name in names:
        if name not in known:
            raise _fail("gate.sample.tenants", name, "is not a configured tenant",
                        f"Use one of: {', '.join(known)}.")
    rate = _num("gate.sample.rate", d.get("rate", base.rate))
    if rate > 1.0:
        raise _fail("gate.sample.rate", rate, "must be <= 1",
                    "Write the share of conversations sampled, e.g. 0.05.")
    max_tokens = _int("gate.sample.max_tokens", d.get("max_tokens", base.max_tokens), minimum=1)
    if max_tokens > 4096:
        raise _fail("gate.sample.max_tokens", max_tokens, "must be <= 4096",
                    "Each replayed turn generates this many tokens; 16 to 64 is plenty.")
    return TranscriptSampleConfig(
        directory=directory, tenants=tuple(dict.fromkeys(str(n) for n in names)), rate=rate,
        idle_s=_num("gate.sample.idle_s", d.get("idle_s", base.idle_s)),
        min_turns=_int("gate.sample.min_turns", d.get("min_turns", base.min_turns), minimum=1),
        max_open=_int("gate.sample.max_open", d.get("max_open", base.max_open), minimum=1),
        max_per_minute=_int("gate.sample.max_per_minute",
                            d.get("max_per_minute", base.max_per_minute), minimum=1),
        max_per_tenant=_int("gate.sample.max_per_tenant",
                            d.get("max_per_tenant", base.max_per_tenant), minimum=1),
        max_bytes_per_tenant=_int("gate.sample.max_bytes_per_tenant",
                                  d.get("max_bytes_per_tenant", base.max_bytes_per_tenant),
                                  minimum=1024),
        max_tokens=max_tokens,
        seed=_str("gate.sample.seed", d.get("seed", base.seed), example="kvroute-transcripts"))


def _kv_stream(data: Any) -> KvStreamConfig | None:
    if data is None:
        return None
    d = _mapping("kv_stream", data, '{url: "nats://127.0.0.1:4222"}')
    _check_keys("kv_stream", d, ("url", "name", "subject_prefix", "relay", "max_age_s",
                                 "max_bytes", "snapshot_every", "connect_timeout_s"))
    base = KvStreamConfig()
    url = _str("kv_stream.url", d.get("url", base.url), example='"nats://127.0.0.1:4222"')
    if urlsplit(url).scheme not in ("nats", "tls") or not urlsplit(url).hostname:
        raise _fail("kv_stream.url", url, "must be a nats:// URL with a host",
                    'Write e.g. url: "nats://127.0.0.1:4222".')
    name = _str("kv_stream.name", d.get("name", base.name), example="KVROUTE_KV_EVENTS")
    if not name.replace("_", "").replace("-", "").isalnum():
        raise _fail("kv_stream.name", name, "must be a JetStream stream name",
                    "Use letters, digits, '-' and '_' only (no dots, spaces or wildcards).")
    prefix = _str("kv_stream.subject_prefix", d.get("subject_prefix", base.subject_prefix),
                  example="kvroute.kv")
    tokens = prefix.split(".")
    if any(not t or any(ch.isspace() or ch in "*>" for ch in t) for t in tokens):
        raise _fail("kv_stream.subject_prefix", prefix, "must be a NATS subject without wildcards",
                    "Use dot-separated words, e.g. kvroute.kv.")
    return KvStreamConfig(
        url=url,
        name=name,
        subject_prefix=prefix,
        relay=_bool("kv_stream.relay", d.get("relay", base.relay)),
        max_age_s=_num("kv_stream.max_age_s", d.get("max_age_s", base.max_age_s)),
        max_bytes=_int("kv_stream.max_bytes", d.get("max_bytes", base.max_bytes), minimum=1 << 20),
        snapshot_every=_int("kv_stream.snapshot_every",
                            d.get("snapshot_every", base.snapshot_every), minimum=1),
        connect_timeout_s=_num("kv_stream.connect_timeout_s",
                               d.get("connect_timeout_s", base.connect_timeout_s)),
    )


def _audit_sample(data: Any) -> AuditSampleConfig | None:
    if data is None:
        return None
    d = _mapping("audit_sample", data, "{path: /var/log/kvroute/sample.jsonl, every: 100}")
    _check_keys("audit_sample", d, ("path", "every"))
    path = _str("audit_sample.path", d.get("path"), example="/var/log/kvroute/sample.jsonl")
    return AuditSampleConfig(path=path, every=_int("audit_sample.every", d.get("every", 100),
                                                   minimum=1))


def load_config(path: str | Path, *, env: Mapping[str, str] | None = None) -> RouterConfig:
    """Read and validate a YAML config file.

    Raises:
        ConfigError: the file cannot be read, is not YAML, or fails validation.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r}: {exc.strerror}. Pass an existing file with -c.") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from exc
    return parse_config(data, env=env)


# --------------------------------------------------------------------------------------------
# Secrets
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Secrets:
    """What the environment supplies: API key → tenant, the admin key, tenants' cache salts,
    external providers' keys.

    ``api_keys`` empty means no tenants are configured: one default tenant, no auth.
    ``repr`` never shows the keys.
    """

    api_keys: Mapping[str, TenantName] = field(repr=False)
    admin_key: str | None = field(repr=False)
    cache_salts: Mapping[TenantName, str] = field(repr=False)
    provider_keys: Mapping[PoolName, str] = field(
        repr=False, default_factory=lambda: MappingProxyType({}))
    """External pools' API keys (``pools.<name>.external.api_key_env``), by pool."""
    cluster_secret: str | None = field(repr=False, default=None)
    """The key of the fleet's pseudonyms (``cluster.secret`` or ``cluster.secret_env``);
    None when the config shares nothing (``cluster.bus: none``, ``state.backend: memory``)
    and sets none."""


def derive_cache_salt(secret: str, tenant: str) -> str:
    """A tenant's stable cache salt: HMAC-SHA256(secret, tenant) in hex, 32 characters.

    Stable across restarts and across router processes that share the secret; not guessable
    by another tenant (who would otherwise be able to address the salted blocks). Hex keeps
    it inside vLLM's ``cache_salt`` rules (<= 128 chars, no ``@ / \\ NUL``).
    """
    return hmac.new(secret.encode("utf-8"), tenant.encode("utf-8"), hashlib.sha256).hexdigest()[:32]


def resolve_secrets(config: RouterConfig, env: Mapping[str, str] | None = None) -> Secrets:
    """Read every secret the config names from the environment.

    Raises:
        ConfigError: a named variable is unset or empty, two tenants share a key value, or
            a tenant asks for ``cache_salt`` without the salt secret set.
    """
    env = os.environ if env is None else env
    api_keys: dict[str, TenantName] = {}
    salts: dict[TenantName, str] = {}
    for i, tenant in enumerate(config.tenants):
        value = env.get(tenant.api_key_env, "")
        if not value:
            raise ConfigError(
                f"tenants[{i}].api_key_env: environment variable {tenant.api_key_env} (tenant "
                f"{tenant.name!r}) is unset or empty. Export it with the tenant's API key before starting."
            )
        if value in api_keys:
            raise ConfigError(
                f"tenants[{i}].api_key_env: {tenant.api_key_env} holds the same key as tenant "
                f"{api_keys[value]!r}'s variable. Give every tenant a distinct key."
            )
        api_keys[value] = tenant.name
        if tenant.cache_salt:
            secret = env.get(config.salt_secret_env, "")
            if not secret:
                raise ConfigError(
                    f"tenants[{i}].cache_salt: tenant {tenant.name!r} is salted (the default "
                    f"for every tenant), but {config.salt_secret_env} (salt_secret_env) is "
                    "unset or empty. Export a long random secret, the same on every router "
                    "process, or write cache_salt: false for a tenant that may share its "
                    "cache with the other unsalted tenants."
                )
            salts[tenant.name] = derive_cache_salt(secret, tenant.name)
    admin_key: str | None = None
    if config.admin_key_env is not None:
        admin_key = env.get(config.admin_key_env, "")
        if not admin_key:
            raise ConfigError(
                f"admin_key_env: environment variable {config.admin_key_env} is unset or empty. "
                "Export the admin key, or remove admin_key_env to disable the admin endpoints."
            )
        if admin_key in api_keys:
            raise ConfigError(
                f"admin_key_env: {config.admin_key_env} holds a tenant's API key. The admin key "
                "must differ from every tenant key."
            )
    return Secrets(api_keys=api_keys, admin_key=admin_key, cache_salts=salts,
                   provider_keys=resolve_provider_keys(config, env),
                   cluster_secret=resolve_cluster_secret(config, env))


def resolve_cluster_secret(config: RouterConfig,
                           env: Mapping[str, str] | None = None) -> str | None:
    """The cluster secret: ``cluster.secret``, else ``cluster.secret_env``'s value.

    Required when routers share state where others can read it (``cluster.bus: nats``,
    ``state.backend: redis``): tenant, session and request ids go there only as keyed
    pseudonyms (``core/pseudonyms.py``). Otherwise None unless one is set anyway.

    Raises:
        ConfigError: it is required and unset, or shorter than ``MIN_SECRET_BYTES`` (the
            message says how to set it and never holds the value).
    """
    env = os.environ if env is None else env
    cluster = config.cluster
    secret = cluster.secret if cluster.secret is not None else env.get(cluster.secret_env, "")
    needed = [why for why, on in (("cluster.bus is nats", cluster.bus == "nats"),
                                  ("state.backend is redis", config.state.backend == "redis"))
              if on]
    if not secret:
        if not needed:
            return None
        raise ConfigError(
            f"{' and '.join(needed)}, so this router shares tenant and session state with "
            f"other routers, but no cluster secret is set: {cluster.secret_env} "
            "(cluster.secret_env) is unset or empty. Export a long random value, the same on "
            "every router of the fleet, e.g. "
            f"export {cluster.secret_env}=$(python -c 'import secrets; "
            "print(secrets.token_hex(32))'); or write cluster.secret in the file. Tenant and "
            "session ids then leave the router only as keyed pseudonyms.")
    if len(secret.encode("utf-8")) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"cluster secret ({cluster.secret_env}) has {len(secret.encode('utf-8'))} bytes; "
            f"it needs at least {MIN_SECRET_BYTES}. Use a long random value, e.g. "
            "python -c 'import secrets; print(secrets.token_hex(32))'.")
    return secret


def resolve_provider_keys(config: RouterConfig,
                          env: Mapping[str, str] | None = None) -> Mapping[PoolName, str]:
    """The API key of every external pool that names one (``external.api_key_env``).

    Raises:
        ConfigError: a named variable is unset or empty.
    """
    env = os.environ if env is None else env
    keys: dict[PoolName, str] = {}
    for pool in config.pools.values():
        ext = pool.external
        if ext is None or ext.api_key_env is None:
            continue
        value = env.get(ext.api_key_env, "")
        if not value:
            raise ConfigError(
                f"pools.{pool.name}.external.api_key_env: environment variable "
                f"{ext.api_key_env} is unset or empty. Export the provider's API key before "
                "starting, or remove api_key_env if the provider needs none."
            )
        keys[pool.name] = value
    return MappingProxyType(keys)
