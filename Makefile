# kpx: Kubernetes Service proxying (operator + node agents).
SHELL := /bin/bash
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
APT_PACKAGES := nftables iptables conntrack etcd-server iproute2 socat procps curl kmod
N ?=

.PHONY: setup setup-apt setup-python setup-kubernetes test test-unit test-e2e lint crds demo demo-down bench clean-cache

## setup: install everything a fresh machine needs (idempotent: a second run installs and builds nothing)
setup: setup-apt setup-python setup-kubernetes

setup-apt:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "apt: all packages present"; fi

setup-python:
	$(PIP) install -q --disable-pip-version-check -e '.[dev]'

setup-kubernetes:
	toolchain/build-kubernetes.sh kube-apiserver kube-controller-manager kube-scheduler kubectl

## test: the whole suite (unit, kernel-in-netns, and e2e against a real apiserver); needs root
test: setup
	$(PYTHON) -m pytest

test-unit:
	$(PYTHON) -m pytest tests/unit

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

## crds: regenerate crds/ from the Python models
crds:
	$(PYTHON) -m kpx_api.crdgen --out crds/

demo: setup
	$(PYTHON) -m kpx_cluster.demo up

demo-down:
	$(PYTHON) -m kpx_cluster.demo down

bench:
	$(PYTHON) bench/agent_scale.py $(if $(N),--services $(N),)
