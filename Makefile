# kpx: Kubernetes Service proxying (operator + node agents).
SHELL := /bin/bash
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
APT_PACKAGES := nftables iptables conntrack etcd-server iproute2 socat procps curl kmod \
	mmdebstrap buildah umoci skopeo runc \
	containernetworking-plugins busybox-static gcc libc6-dev lua5.4
# proxy-vm (a qemu guest with IPVS for the ipvs kernel tests), installed without recommends
VM_APT_PACKAGES := qemu-system-x86 mmdebstrap e2fsprogs
N ?=

CONFORMANCE_SUITE ?= proxy
CONFORMANCE_TARGETS ?= kpx/nftables,kube-proxy/nftables,kpx/iptables,kube-proxy/iptables
CONFORMANCE_IPVS_SUITE ?= conformance

.PHONY: test-long conformance conformance-ipvs setup setup-apt setup-python setup-kubernetes setup-helm setup-kstatus setup-coredns setup-go-localstate setup-vm image test test-unit test-kernel test-e2e lint crds chart demo demo-down bench bench-migration chaos

## setup: install everything a fresh machine needs (idempotent: a second run installs and builds nothing)
setup: setup-apt setup-python setup-kubernetes setup-helm setup-kstatus setup-coredns setup-go-localstate setup-vm

setup-apt:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "apt: all packages present"; fi
	@# containerd and ctr (tests/e2e/test_image_archives_containerd.py loads the archives as kind
	@# does, into a private containerd): Debian's package, unless some containerd is there already
	@if command -v containerd >/dev/null && command -v ctr >/dev/null; then echo "apt: containerd present"; \
	else echo "apt: installing containerd"; apt-get update -qq \
	  && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends containerd >/dev/null; fi

## setup-vm: qemu and mmdebstrap, then the proxy-vm guest image (cached in ~/.cache/kpx/vm/,
## rebuilt only when its recipe changes: about 80 s cold, nothing warm)
setup-vm: setup-python
	@missing=""; for p in $(VM_APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	else echo "apt: vm packages present"; fi
	$(PYTHON) -m kpx_cluster.vm.cli build

setup-python:
	$(PYTHON) toolchain/setup-python.py

setup-kubernetes:
	toolchain/build-kubernetes.sh kube-apiserver kube-controller-manager kube-scheduler kubectl kube-proxy \
	  kubelet agnhost e2e.test ginkgo regression-issue-74839

setup-helm:
	toolchain/build-helm.sh

## setup-kstatus: the kstatus checker (toolchain/kstatus: sigs.k8s.io/cli-utils' status.Compute and
## Flux-style CEL health expressions), which tests/e2e/test_gitops_status.py runs on real objects
setup-kstatus:
	toolchain/build-kstatus.sh

## setup-coredns: CoreDNS from its Go module (toolchain/coredns), the real nodes' cluster DNS
setup-coredns:
	toolchain/build-coredns.sh

## setup-go-localstate: the Go example client of the state API (examples/plugins/go-localstate),
## which tests/e2e/test_state_api_go_client.py runs against a real agent
setup-go-localstate:
	toolchain/build-go-localstate.sh

## image: the operator and agent images (images/Containerfile) as OCI archives in the cache;
## prints `image: REF ARCHIVE` per image; builds nothing when no input changed (docs/images.md);
## then the real nodes' pause, busybox and CoreDNS images (docs/real-kubelets.md)
image: setup-apt setup-coredns
	PYTHONPATH=harness $(PYTHON) -m kpx_cluster.images build
	PYTHONPATH=harness $(PYTHON) -m kpx_cluster.kubelets.static_images

## test: the whole suite (unit, kernel-in-netns, and e2e against a real apiserver) but the
## `long` load runs; needs root
test: setup image
	$(PYTHON) -m pytest -m "not long"

## test-long: the runs that `make test` leaves out (in the IPVS guest, the ipvs -> nftables
## switch under load and the guest's real kubelet nodes; the rolled-back and reverted mode
## switches under load on real kubelets)
test-long: setup image
	$(PYTHON) -m pytest -m long

## test-unit: the pure tier, no root, no cluster (seconds)
test-unit:
	$(PYTHON) -m pytest tests/unit

## test-kernel: the kernel tier, rules in network namespaces and no apiserver; needs root
test-kernel: setup image
	$(PYTHON) -m pytest tests/e2e -m "netns and not e2e"

## test-e2e: the cluster tier, against a real kube-apiserver and etcd (most also need root)
test-e2e: setup image
	$(PYTHON) -m pytest tests/e2e -m e2e

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

## crds: regenerate crds/ from the Python models, and the chart's copy and schema from crds/
crds:
	$(PYTHON) -m kpx_api.crdgen --out crds/
	$(PYTHON) charts/sync_from_crds.py

## conformance: Kubernetes' own [sig-network] e2e specs (e2e.test) against kpx and upstream
## kube-proxy, nftables and iptables, on real kubelets; prints the table (docs/conformance.md)
conformance: setup image
	PYTHONPATH=harness $(PYTHON) -m kpx_cluster.conformance --suite $(CONFORMANCE_SUITE) \
	  --targets $(CONFORMANCE_TARGETS) --record bench/results/conformance.md

## conformance-ipvs: the same for ipvs mode, kpx and kube-proxy, on real kubelet nodes in the
## IPVS guest (this kernel has no IPVS); the 47 Conformance specs by default (docs/conformance.md)
conformance-ipvs: setup image
	PYTHONPATH=harness $(PYTHON) -m kpx_cluster.conformance --suite $(CONFORMANCE_IPVS_SUITE) \
	  --targets kpx/ipvs,kube-proxy/ipvs --record bench/results/conformance-ipvs.md

## chart: the Helm chart as a chart repository: kpx-<version>.tgz (`helm package`) and index.yaml
## (`helm repo index`) in $(CHART_OUT) (gitignored); CHART_URL=... sets the repository's URL
CHART_OUT ?= build/charts
CHART_URL ?=
chart: setup-helm
	$(PYTHON) charts/package.py --out $(CHART_OUT) $(if $(CHART_URL),--url $(CHART_URL))

demo: setup image
	$(PYTHON) -m kpx_cluster.demo up

demo-down:
	$(PYTHON) -m kpx_cluster.demo down

## bench: kpx against upstream kube-proxy, side by side (N=1000 for one size; SUSTAINED
## EndpointSlice changes in 10 s after the burst), the state API, and
## the agent's memory (the whole agent, a relist included, at MEMORY_SIZES: 30,000 adds 25-40
## minutes; by layer in one process at LAYER_SIZES, with the slopes per Service and per endpoint),
## and what the namespace opt-out saves at OPTOUT_SIZE Services (half left out; against
## upstream's service-proxy-name label), the initial lists in JSON against protobuf (bytes, the
## apiserver's and the agent's CPU); then the side by side at SCALE_SIZE Services (one cold
## start each, no sustained burst, an upstream start stopped after 300 s: about 40 minutes);
## sets up the machine first
MEMORY_SIZES ?= 1000,10000
LAYER_SIZES ?= 1000,10000,30000
SUSTAINED ?= 5000
OPTOUT_SIZE ?= 30000
SCALE_SIZE ?= 30000
bench: setup
	$(PYTHON) bench/compare.py $(if $(N),--services $(N),) --sustained $(SUSTAINED)
	$(PYTHON) bench/state_api.py $(if $(N),--services $(N),)
	$(PYTHON) bench/agent_memory.py --services $(if $(N),$(N),$(MEMORY_SIZES))
	$(PYTHON) bench/memory_layers.py $(if $(N),--services $(N) --at $(N),--services $(LAYER_SIZES))
	$(PYTHON) bench/optout_savings.py --services $(if $(N),$(N),$(OPTOUT_SIZE))
	$(PYTHON) bench/list_encodings.py --services $(if $(N),$(N),10000)
	$(PYTHON) bench/watch_encodings.py --services $(if $(N),$(N),1000)
	$(if $(N),,$(PYTHON) bench/compare.py --services $(SCALE_SIZE) --cold-starts 1 \
	  --cold-timeout 300 --sustained 0)

## bench-migration: upstream kube-proxy (iptables, nftables) -> kpx nftables, then spec.mode
## iptables -> nftables -> iptables, on three simulated nodes under constant load (new TCP
## connections, UDP, held connections); table in bench/results/migration.md. REAL=1: on three
## real kubelets (bench/results/migration-real-kubelets.md)
bench-migration: setup image
	$(PYTHON) bench/migration.py $(if $(REAL),--real,)

## chaos: the fault table (docs/chaos.md): faults injected under constant load on three real
## kubelet nodes (agents killed, apiserver stopped, foreign nft changes, poison pair, ...); prints
## the table, writes bench/results/chaos.md, exits 1 when a row misses its goal. Not part of `make
## test`; about 25 minutes
chaos: setup image
	$(PYTHON) bench/chaos.py
