"""The Kubernetes client layer shared by the agent and the operator: credentials first.

- `kubeconfig`: a kubeconfig document -> one typed context (pure; errors name the field);
- `tls`: an ssl.SSLContext from PEM bytes, key material kept in memory (memfd);
- `exec_plugin`: client.authentication.k8s.io exec credential plugins (v1, v1beta1);
- `credentials`: `Credentials` (kubeconfig or in-cluster), what each request authenticates with.

It imports neither the agent nor the operator nor kopf.
"""

from .credentials import Auth, Credentials, from_kubeconfig, in_cluster
from .exec_plugin import ExecPluginError
from .kubeconfig import KubeconfigError

__all__ = ["Auth", "Credentials", "ExecPluginError", "KubeconfigError", "from_kubeconfig",
           "in_cluster"]  # fmt: skip
