"""The Kubernetes client layer of the agent, the operator, the harness and the benchmarks:
the only code that talks HTTP to the apiserver.

- `kubeconfig`: a kubeconfig document -> one typed context (pure; errors name the field);
- `tls`: an ssl.SSLContext from PEM bytes, key material kept in memory (memfd);
- `exec_plugin`: client.authentication.k8s.io exec credential plugins (v1, v1beta1);
- `credentials`: `Credentials` (kubeconfig or in-cluster), what each request authenticates with;
- `errors`: one `ApiError` hierarchy (NotFound, Conflict, Gone, Forbidden, Unauthorized, ...);
- `request`: how a request is built (pure); `kinds`: where the built-in kinds live (the
  table that seeds discovery); `client`: `Client`, the aiohttp edge (requests,
  server-side apply, list and watch with the fast path);
- `reflector`: list+watch of one resource into a sink, as client-go's reflector;
- `blocking`: `BlockingClient`, the same client for synchronous code (harness, benchmarks);
- `collector`: the cyclic garbage collector paused around bulk allocations.

It imports neither the agent nor the operator nor the harness nor kopf.
"""

from .client import DEFAULT_WATCH_IDLE_TIMEOUT, Client, Obj, Reply
from .credentials import Auth, Credentials, from_kubeconfig, in_cluster
from .errors import (
    AlreadyExists,
    ApiError,
    BadRequest,
    Conflict,
    Forbidden,
    Gone,
    Invalid,
    NotFound,
    ServerError,
    TooManyRequests,
    Unauthorized,
    Unreachable,
    WatchIdle,
)
from .exec_plugin import ExecPluginError
from .kubeconfig import KubeconfigError

__all__ = [
    "DEFAULT_WATCH_IDLE_TIMEOUT",
    "AlreadyExists",
    "ApiError",
    "Auth",
    "BadRequest",
    "Client",
    "Conflict",
    "Credentials",
    "ExecPluginError",
    "Forbidden",
    "Gone",
    "Invalid",
    "KubeconfigError",
    "NotFound",
    "Obj",
    "Reply",
    "ServerError",
    "TooManyRequests",
    "Unauthorized",
    "Unreachable",
    "WatchIdle",
    "from_kubeconfig",
    "in_cluster",
]
