"""The ready pods behind a Kubernetes Service, from the API server's EndpointSlices.

router.discovery uses this for "k8s:SERVICE[.NAMESPACE]:PORT" worker targets: every ready
endpoint of the Service's EndpointSlices (discovery.k8s.io/v1) is a worker, listed again at
every refresh. Unlike DNS it sees a pod stop being ready, or start terminating, with no resolver
cache in between. It runs inside a pod whose service account may list EndpointSlices in the
Service's namespace (the chart's Role, with router.discoveryMode kubernetes).

The standard library is enough: the API server's address comes from the KUBERNETES_SERVICE_*
variables every pod has, its CA, the pod's namespace and its token from the service account's
mount. The token is read again at every request, as the kubelet rotates it.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# Where the kubelet mounts the pod's service account: token, ca.crt, namespace.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class ApiServer:
    """Where the Kubernetes API is, and how this pod authenticates to it."""

    url: str         # https://host:port
    ca_file: str     # the CA its certificate chains to
    token_file: str  # a bearer token, read at every request
    namespace: str   # where Services named without a namespace are: the pod's own

    @classmethod
    def in_cluster(cls) -> ApiServer:
        """This pod's API server and service account; raises ValueError outside a pod or
        without a mounted service account."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        if not host:
            raise ValueError("k8s: worker targets need the Kubernetes API, but "
                             "KUBERNETES_SERVICE_HOST is not set (not in a pod?); outside "
                             "Kubernetes use dns:NAME:PORT")
        account = SERVICE_ACCOUNT_DIR
        try:
            namespace = (account / "namespace").read_text().strip()
        except OSError as error:
            raise ValueError(f"k8s: worker targets need the pod's service account at {account} "
                             f"({error.strerror}): set automountServiceAccountToken (the chart "
                             "does with router.discoveryMode kubernetes)") from None
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        address = f"[{host}]" if ":" in host else host    # an IPv6 cluster's API server
        return cls(f"https://{address}:{port}", str(account / "ca.crt"), str(account / "token"),
                   namespace)


class EndpointSlices:
    """Lists the ready endpoints of Services through one API server."""

    def __init__(self, api: ApiServer, timeout_s: float = 5.0) -> None:
        self.api = api
        self.timeout_s = timeout_s
        try:
            self._tls = ssl.create_default_context(cafile=api.ca_file)
        except (OSError, ssl.SSLError) as error:
            raise ValueError(f"cannot use the Kubernetes API's CA {api.ca_file}: "
                             f"{getattr(error, 'strerror', None) or error}") from None

    async def ready_ips(self, name: str) -> set[str]:
        """The addresses of the ready endpoints of the Service "SERVICE[.NAMESPACE]", of one
        family (see ready_ips). Raises OSError when the API cannot tell (unreachable, or an
        error such as 403 for a service account without the Role), naming why."""
        service, _, namespace = name.partition(".")
        return await asyncio.to_thread(self._list, service, namespace or self.api.namespace)

    def _list(self, service: str, namespace: str) -> set[str]:
        query = urllib.parse.urlencode({"labelSelector": f"kubernetes.io/service-name={service}"})
        url = (f"{self.api.url}/apis/discovery.k8s.io/v1/namespaces/"
               f"{urllib.parse.quote(namespace)}/endpointslices?{query}")
        token = Path(self.api.token_file).read_text().strip()
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}",
                                                       "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self._tls) as reply:
                slices = json.load(reply)["items"]
        except urllib.error.HTTPError as error:
            raise OSError(f"listing the EndpointSlices of {namespace}/{service} failed: HTTP "
                          f"{error.code}: {_status_message(error)}") from None
        return ready_ips(slices)


def ready_ips(slices: list[dict]) -> set[str]:
    """The address of every ready endpoint in EndpointSlice objects, IPv4 ones when there are
    any: in a dual-stack cluster a Service has a slice of each family, and each pod must count
    as one worker, not two. An endpoint whose readiness is not given counts as ready (the API's
    own rule); a terminating one is never ready."""
    by_family: dict[str, set[str]] = {"IPv4": set(), "IPv6": set()}
    for endpoint_slice in slices:
        found = by_family.get(endpoint_slice.get("addressType"))
        if found is None:   # FQDN slices name hosts, not pods
            continue
        for endpoint in endpoint_slice.get("endpoints") or ():
            if (endpoint.get("conditions") or {}).get("ready") is not False and endpoint["addresses"]:
                found.add(endpoint["addresses"][0])     # the API: "consumers should use the first"
    return by_family["IPv4"] or by_family["IPv6"]


def _status_message(error: urllib.error.HTTPError) -> str:
    """The message of the API's Status object in an error reply, else the HTTP reason."""
    try:
        return json.loads(error.read())["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return str(error.reason)
