"""Handing a node over between proxies: make-before-break, kube-proxy takeover, rollback.

An agent starting where another proxy ran (another kpx mode, or upstream kube-proxy) removes
what that proxy left only after its own rules are verified in the kernel (`make_before_break`);
`from_kube_proxy`, `kube_proxy_leftovers` and `kube_proxy_config` take a node over from
upstream kube-proxy and convert its configuration; `rollback` decides when a switch goes back;
`migration` explains what a mode switch changes; `preflight` checks which modes this node can
run. Imports: model, settings, backends (the registry and the contract); never sync.
"""
