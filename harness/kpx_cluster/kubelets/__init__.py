"""Real nodes for the development cluster: kubelet + containerd + CNI per node, each in a
network and a mount namespace of its own, the control plane in a netns of its own
(docs/real-kubelets.md). `config` holds the pure builders; `cluster`, `supervisor` and
`cgroups` are the process and namespace edge."""
