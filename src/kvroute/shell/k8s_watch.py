"""Engine discovery from the Kubernetes API: list and watch EndpointSlices selected by labels.

Theory of operation
-------------------

``EndpointSliceWatcher.run`` keeps the set of engines behind a label selector (usually the
engines' Service: ``kubernetes.io/service-name=vllm``) in one namespace, with plain aiohttp
against the API server (the same client the rest of the router uses; no Kubernetes SDK):

1. **list** ``GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=...``:
   every slice and the list's ``resourceVersion``;
2. **watch** the same path with ``watch=1&resourceVersion=<rv>&allowWatchBookmarks=true``:
   a stream of one JSON event per line (``ADDED``/``MODIFIED``/``DELETED`` a slice,
   ``BOOKMARK`` to advance the version); each event updates the slice it names and the
   version the next watch resumes from. When the server ends the stream (it does, after
   ``timeoutSeconds``), the watch is resumed from the last version;
3. **410 Gone** (an ``ERROR`` event whose ``Status.code`` is 410, or an HTTP 410 answer):
   the version is too old for the server's history, so the watcher lists again (step 1).

After each step the engines of all slices are merged (``wire.k8s_endpoints``) and compared
with the last set announced; a non-empty difference is handed to ``on_change`` (scale-out adds,
scale-in removes, a rescheduled pod re-points). Any other failure (connection refused, a 5xx,
a malformed event) is logged with what went wrong and retried after ``retry_s``, from a list:
the last announced set stays in force meanwhile, so an API outage never empties the fleet.

Credentials: ``K8sApi.in_cluster`` (the pod's service-account token, re-read on every request
because the kubelet rotates it, and the cluster CA) or ``K8sApi.from_kubeconfig`` (the
current context's server, CA and bearer token).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp
import yaml  # type: ignore[import-untyped]  # types-PyYAML is not a dependency

from kvroute.wire.k8s_endpoints import (
    EndpointDiff,
    EngineEndpoint,
    K8sFormatError,
    PortNames,
    diff_endpoints,
    merge_slices,
    parse_slice_list,
    parse_watch_event,
)

__all__ = ["EndpointSliceWatcher", "K8sApi", "K8sConfigError"]

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_SLICES_PATH: Final = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
_GONE: Final = 410


class K8sConfigError(ValueError):
    """The Kubernetes API cannot be reached as configured (says what is missing)."""


class _Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


@dataclass(frozen=True, slots=True)
class K8sApi:
    """Where the API server is and how to authenticate to it.

    Attributes:
        server: ``https://host:port`` (or ``http://`` for a local proxy such as ``kubectl proxy``).
        token: a bearer token, or None.
        token_file: a file holding the token, re-read on every request (service accounts).
        ssl_context: verifies the server with the cluster CA; None for ``http://``.
    """

    server: str
    token: str | None = None
    token_file: Path | None = None
    ssl_context: ssl.SSLContext | None = None

    def headers(self) -> dict[str, str]:
        token = self.token_file.read_text().strip() if self.token_file else self.token
        return {"Authorization": f"Bearer {token}"} if token else {}

    @classmethod
    def in_cluster(cls, env: Mapping[str, str], sa_dir: Path = SERVICE_ACCOUNT_DIR) -> K8sApi:
        """The API server as a pod sees it (``KUBERNETES_SERVICE_HOST``/``_PORT``)."""
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise K8sConfigError(
                "KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set: kvroute is not "
                "running in a pod; pass a kubeconfig path instead")
        token, ca = sa_dir / "token", sa_dir / "ca.crt"
        for f in (token, ca):
            if not f.is_file():
                raise K8sConfigError(
                    f"{f} is missing: mount the pod's service-account token "
                    "(automountServiceAccountToken: true)")
        host = f"[{host}]" if ":" in host else host
        return cls(server=f"https://{host}:{port}", token_file=token,
                   ssl_context=ssl.create_default_context(cafile=str(ca)))

    @classmethod
    def from_kubeconfig(cls, path: Path, context: str | None = None) -> K8sApi:
        """The server, CA and bearer token of a kubeconfig's (current) context.

        Only token authentication is read (a service-account or static token); a
        kubeconfig that authenticates with client certificates or an exec plugin is refused
        with a message saying so.
        """
        try:
            cfg = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise K8sConfigError(f"cannot read kubeconfig {path}: {exc}") from exc
        if not isinstance(cfg, dict):
            raise K8sConfigError(f"kubeconfig {path} is not a YAML mapping")
        name = context or cfg.get("current-context")

        def named(section: str, key: str) -> dict[str, Any]:
            for entry in cfg.get(section) or ():
                if entry.get("name") == key:
                    return dict(entry.get(section.removesuffix("s")) or {})
            raise K8sConfigError(f"kubeconfig {path} has no {section.removesuffix('s')} {key!r}")

        ctx = named("contexts", str(name))
        cluster, user = named("clusters", str(ctx.get("cluster"))), named("users", str(ctx.get("user")))
        server = str(cluster.get("server", ""))
        if not server:
            raise K8sConfigError(f"kubeconfig {path}: cluster {ctx.get('cluster')!r} has no server")
        token = user.get("token")
        token_file = Path(user["tokenFile"]) if user.get("tokenFile") else None
        if token is None and token_file is None:
            raise K8sConfigError(
                f"kubeconfig {path}: user {ctx.get('user')!r} has no token or tokenFile; kvroute "
                "reads bearer tokens only (create a service-account token with kubectl create token)")
        context_ssl: ssl.SSLContext | None = None
        if server.startswith("https://"):
            if cluster.get("certificate-authority-data"):
                pem = base64.b64decode(cluster["certificate-authority-data"]).decode()
                context_ssl = ssl.create_default_context(cadata=pem)
            elif cluster.get("certificate-authority"):
                context_ssl = ssl.create_default_context(cafile=str(cluster["certificate-authority"]))
            else:
                context_ssl = ssl.create_default_context()
        return cls(server=server.rstrip("/"), token=token, token_file=token_file,
                   ssl_context=context_ssl)


class EndpointSliceWatcher:
    """Follows the engines behind a label selector and announces every change.

    Args:
        api: the API server and credentials.
        session: the aiohttp client session (never closed here).
        namespace / label_selector: which EndpointSlices (``app=vllm,tier=gpu``).
        ports: the names of the HTTP and KV-event ports on the slices.
        on_change: called with each non-empty difference and the whole new set.
        watch_timeout_s: asks the server to end each watch after this long (``timeoutSeconds``).
        retry_s: the pause after a failed list or watch.
    """

    def __init__(
        self,
        api: K8sApi,
        session: aiohttp.ClientSession,
        *,
        namespace: str,
        label_selector: str,
        ports: PortNames,
        on_change: Callable[[EndpointDiff, Mapping[str, EngineEndpoint]], None],
        watch_timeout_s: int = 300,
        retry_s: float = 2.0,
    ) -> None:
        self._api = api
        self._session = session
        self._url = api.server + _SLICES_PATH.format(namespace=namespace)
        self._selector = label_selector
        self._ports = ports
        self._on_change = on_change
        self._watch_timeout_s = watch_timeout_s
        self._retry_s = retry_s
        self._slices: dict[str, tuple[EngineEndpoint, ...]] = {}
        self._announced: dict[str, EngineEndpoint] = {}
        self._version = ""
        self.listed = asyncio.Event()
        """Set once the first list is applied (start-up waits for it)."""
        self.num_lists = 0
        self.num_watches = 0
        self.num_errors = 0

    @property
    def engines(self) -> Mapping[str, EngineEndpoint]:
        """The engines last announced, by name."""
        return dict(self._announced)

    async def run(self) -> None:
        """List, then watch; relist on 410 Gone; retry after errors. Runs until cancelled."""
        listed = False
        while True:
            try:
                if not listed:
                    await self._list()
                    listed = True
                await self._watch()
            except _Gone:
                log.info("kubernetes: resourceVersion %s expired (410 Gone); listing again",
                         self._version)
                listed = False
            except (aiohttp.ClientError, TimeoutError, K8sFormatError, ValueError) as exc:
                self.num_errors += 1
                log.error("kubernetes: EndpointSlice list/watch at %s failed: %s: %s; "
                          "keeping the last %d engines and retrying in %.0fs",
                          self._url, type(exc).__name__, exc, len(self._announced),
                          self._retry_s)
                listed = False
                await asyncio.sleep(self._retry_s)

    async def _list(self) -> None:
        params = {"labelSelector": self._selector}
        async with self._session.get(self._url, params=params, headers=self._api.headers(),
                                     ssl=self._ssl()) as resp:
            await _raise_for_status(resp, "list", gone_means_relist=False)
            body = await resp.json(content_type=None)
        self._version, self._slices = parse_slice_list(body, self._ports)
        self.num_lists += 1
        self._announce()
        self.listed.set()

    async def _watch(self) -> None:
        params = {"labelSelector": self._selector, "watch": "1",
                  "resourceVersion": self._version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(self._watch_timeout_s)}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=self._watch_timeout_s + 30)
        async with self._session.get(self._url, params=params, headers=self._api.headers(),
                                     ssl=self._ssl(), timeout=timeout) as resp:
            await _raise_for_status(resp, "watch")
            self.num_watches += 1
            async for line in _lines(resp):
                ev = parse_watch_event(json.loads(line), self._ports)
                if ev.kind == "ERROR":
                    if ev.error_code == _GONE:
                        raise _Gone
                    raise K8sFormatError(f"watch error {ev.error_code}: {ev.error_message}")
                self._version = ev.resource_version or self._version
                if ev.kind == "DELETED":
                    self._slices.pop(ev.slice_name, None)
                elif ev.kind in ("ADDED", "MODIFIED"):
                    self._slices[ev.slice_name] = ev.endpoints
                self._announce()

    def _ssl(self) -> ssl.SSLContext | bool:
        return self._api.ssl_context if self._api.ssl_context is not None else True

    def _announce(self) -> None:
        new = merge_slices(self._slices)
        diff = diff_endpoints(self._announced, new)
        if diff.empty:
            return
        self._announced = new
        log.info("kubernetes: engines +%s -%s ~%s (now %d)",
                 [e.name for e in diff.added], [e.name for e in diff.removed],
                 [e.name for e in diff.changed], len(new))
        self._on_change(diff, dict(new))


async def _lines(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The non-empty lines of a watch stream, however long: a slice of a thousand
    endpoints is one line of hundreds of kilobytes, and the split here has no size limit
    (aiohttp's ``readline`` raises ``LineTooLong`` past its buffer limit)."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if buf.strip():
        yield buf


async def _raise_for_status(resp: aiohttp.ClientResponse, what: str, *,
                            gone_means_relist: bool = True) -> None:
    if resp.status == _GONE and gone_means_relist:
        raise _Gone
    if resp.status != 200:
        text = (await resp.text())[:300]
        hint = (" (the service account needs list/watch on endpointslices.discovery.k8s.io: "
                "see deploy/k8s/base/rbac.yaml)") if resp.status in (401, 403) else ""
        raise aiohttp.ClientResponseError(
            resp.request_info, resp.history, status=resp.status,
            message=f"EndpointSlice {what} answered {resp.status}: {text}{hint}")
