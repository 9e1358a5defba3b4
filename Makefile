# kpx: Kubernetes Service proxying (operator + node agents).
SHELL := /bin/bash
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
APT_PACKAGES := nftables iptables conntrack etcd-server iproute2 socat procps curl kmod
N ?=

.PHONY: setup setup-apt setup-python setup-kubernetes setup-helm test test-unit lint crds demo demo-down bench

## setup: install everything a fresh machine needs (idempotent: a second run installs and builds nothing)
setup: setup-apt setup-python setup-kubernetes setup-helm

setup-apt:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "apt: all packages present"; fi

setup-python:
	$(PIP) install -q --disable-pip-version-check -e '.[dev]'

setup-kubernetes:
	toolchain/build-kubernetes.sh kube-apiserver kube-controller-manager kube-scheduler kubectl kube-proxy

setup-helm:
	toolchain/build-helm.sh

## test: the whole suite (unit, kernel-in-netns, and e2e against a real apiserver); needs root
test: setup
	$(PYTHON) -m pytest

test-unit:
	$(PYTHON) -m pytest tests/unit

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

## crds: regenerate crds/ from the Python models, and the chart's copy and schema from crds/
crds:
	$(PYTHON) -m kpx_api.crdgen --out crds/
	$(PYTHON) charts/sync_from_crds.py

demo: setup
	$(PYTHON) -m kpx_cluster.demo up

demo-down:
	$(PYTHON) -m kpx_cluster.demo down

## bench: kpx against upstream kube-proxy, side by side (N=1000 for one size); sets up the machine first
bench: setup
	$(PYTHON) bench/compare.py $(if $(N),--services $(N),)
	$(PYTHON) bench/state_api.py $(if $(N),--services $(N),)
