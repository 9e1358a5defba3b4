"""The netlink encoding of set and map elements (the cold start's bulk load): wire bytes,
message splitting, and refusal of anything that is not a well-formed element of its set."""

from __future__ import annotations

import errno
import struct
from collections.abc import Iterator

import pytest

from kpx_agent.backends.kernel.netlink import NLMSG_ERROR
from kpx_agent.backends.nftables import netlink_batch as nb
from kpx_agent.backends.nftables.schema import Goto, ValueKind, declaration
from kpx_agent.model.types import IP, Protocol

TCP, UDP = Protocol.TCP, Protocol.UDP
ip = IP.of


def encode_batch(elements: nb.Elements) -> nb.Batch:
    """Every element in one batch (one kernel transaction)."""
    (batch,) = nb.encode_batches(elements, per_batch=0)
    return batch


def split_messages(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, seq, payload after nfgenmsg) of each netlink message in a batch."""
    out, offset = [], 0
    while offset < len(data):
        length, kind, flags, seq, _pid = struct.unpack_from("=IHHII", data, offset)
        out.append((kind, flags, seq, data[offset + 20 : offset + length]))
        offset += (length + 3) & ~3
    return out


def test_one_endpoint_element_on_the_wire() -> None:
    batch = encode_batch(
        {4: {"endpoints-2": [((ip("10.96.0.10"), TCP, 80, 1), (ip("10.244.1.2"), 8080))]}}
    )
    (begin, *middle, end) = split_messages(batch.data)
    assert begin[0] == nb.NFNL_MSG_BATCH_BEGIN and end[0] == nb.NFNL_MSG_BATCH_END
    assert [(kind, seq) for kind, _, seq, _ in middle] == [((10 << 8) | 12, 1)]
    assert batch.messages == {1: (4, "endpoints-2")}
    payload = middle[0][3]
    table = struct.pack("=HH", 8, 1) + b"kpx\0"
    set_name = struct.pack("=HH", 16, 2) + b"endpoints-2\0"
    key = bytes.fromhex("0a60000a0600000000500000") + struct.pack("=I", 1)  # bucket: host order
    value = bytes.fromhex("0af401021f900000")
    element = (
        struct.pack("=HH", 44, 0x8001)
        + struct.pack("=HH", 24, 0x8001)
        + struct.pack("=HH", 20, 1)
        + key
        + struct.pack("=HH", 16, 0x8002)
        + struct.pack("=HH", 12, 1)
        + value
    )
    assert payload == table + set_name + struct.pack("=HH", 4 + len(element), 0x8003) + element


def test_verdicts_and_ipv6_keys() -> None:
    batch = encode_batch(
        {6: {"service-ips": [((ip("fd00:96::10"), UDP, 53), Goto("endpoints-1"))]}}
    )
    payload = split_messages(batch.data)[1][3]
    assert bytes.fromhex("fd000096" + "00" * 10 + "00101100000000350000") in payload
    verdict = struct.pack(">i", -4)  # NFT_GOTO
    assert verdict + struct.pack("=HH", 16, 2) + b"endpoints-1\0" in payload
    family = struct.unpack_from("=B", batch.data, 20 + 16)[0]  # nfgenmsg of the first message
    assert family == 10  # NFPROTO_IPV6


def test_large_sets_are_split_into_messages_below_the_attribute_limit() -> None:
    pairs = [((ip(f"10.96.{i // 256}.{i % 256}"), TCP, 80), None) for i in range(20_000)]
    batch = encode_batch({4: {"cluster-ips": pairs}})
    middle = split_messages(batch.data)[1:-1]
    assert len(middle) > 1 and len(batch.messages) == len(middle)
    assert [seq for _, _, seq, _ in middle] == list(range(1, len(middle) + 1))
    total = 0
    for _, flags, _, payload in middle:
        assert flags & nb.NLM_F_ACK and len(payload) < 65_535
        total += payload.count(struct.pack("=HH", 24, 0x8001))  # one list element each
    assert total == 20_000


@pytest.mark.parametrize(
    ("set_name", "key", "value", "reason"),
    [
        ("cluster-ips", ("10.96.0.300", TCP, 80), None, "illegal IP address"),
        ("cluster-ips", (ip("10.96.0.1"), "icmp", 80), None, "'icmp'"),
        ("cluster-ips", (ip("10.96.0.1"), TCP, 70000), None, "0..65535"),
        ("cluster-ips", (ip("10.96.0.1"), TCP, "80; flush ruleset"), None, "0..65535"),
        ("cluster-ips", (ip("10.96.0.1"), TCP, True), None, "0..65535"),
        ("cluster-ips", (ip("10.96.0.1"), TCP), None, "expected 3 fields"),
        ("cluster-ips", "10.96.0.1 . tcp . 80", None, "expected 3 fields"),  # text: refused
        ("cluster-ips", (ip("10.96.0.1"), TCP, 80), Goto("x"), "has no value"),
        ("service-ips", (ip("10.96.0.1"), TCP, 80), None, "Goto(<chain>)"),
        ("service-ips", (ip("10.96.0.1"), TCP, 80), "goto x", "Goto(<chain>)"),
        ("service-ips", (ip("10.96.0.1"), TCP, 80), Goto("x; flush ruleset"), "Goto(<chain>)"),
        ("endpoints-2", (ip("10.96.0.1"), TCP, 80, -1), (ip("10.244.0.1"), 80), "-1"),
        ("endpoints-2", (ip("10.96.0.1"), TCP, 80, 0), (ip("10.244.0.1"),), "(address, port)"),
        ("firewall-allow", (ip("10.96.0.1"), TCP, 80, "10.0.0.0/8"), None, "cannot be loaded"),
        ("no-such-set", (ip("10.96.0.1"),), None, "cannot be loaded"),
    ],
)
def test_malformed_elements_are_refused_naming_set_and_element(
    set_name: str, key: object, value: object, reason: str
) -> None:
    with pytest.raises(ValueError, match=set_name) as err:
        encode_batch({4: {set_name: [(key, value)]}})  # type: ignore[dict-item]
    assert reason in str(err.value)


def test_only_exact_match_sets_are_loadable() -> None:
    assert nb.loadable("service-ips") and nb.loadable("endpoints-7")
    assert nb.loadable("nodeport-endpoints-128") and nb.loadable("hairpin")
    assert nb.loadable("short-circuit-ips") and nb.loadable("short-circuit-nodeports")
    assert nb.loadable("short-circuit-endpoints-3")
    assert nb.loadable("short-circuit-nodeport-endpoints-2")
    # One declaration per set (schema.py), read by the encoder as by the table definition.
    assert declaration("short-circuit-nodeports").key == declaration("service-nodeports").key
    assert declaration("short-circuit-endpoints-3").key == declaration("endpoints-3").key
    assert declaration("endpoints-3").value is ValueKind.ENDPOINT
    assert {
        "service-ips",
        "service-nodeports",
        "short-circuit-ips",
        "short-circuit-nodeports",
    } == nb.VERDICT_MAPS
    assert not nb.loadable("firewall-allow") and not nb.loadable("nodeport-addresses")
    assert not nb.loadable("aff-abc") and not nb.loadable("endpoints-x")


def test_acks_are_read_by_sequence_number() -> None:
    def error(seq: int, code: int) -> bytes:
        return (
            struct.pack("=IHHII", 36, NLMSG_ERROR, 0, seq, 0) + struct.pack("=i", code) + bytes(16)
        )

    noise = struct.pack("=IHHII", 20, 0x1000, 0, 9, 0) + bytes(4)
    # the kernel sends the errno negated; the toolkit's one convention gives it positive
    assert list(nb.parse_acks(error(1, 0) + noise + error(2, -2))) == [(1, 0), (2, 2)]


def test_batch_problem_names_the_refused_set_or_missing_acks() -> None:
    batch = encode_batch(
        {
            4: {"cluster-ips": [((ip("10.96.0.1"), TCP, 80), None)]},
            6: {"hairpin": [((ip("::1"), ip("::1")), None)]},
        }
    )
    assert nb.batch_problem(batch, {1: 0, 2: 0}) is None
    refused = nb.batch_problem(batch, {1: 0, 2: errno.ENOENT})
    assert refused is not None and "ip6 kpx hairpin" in refused and "ENOENT" in refused
    assert nb.batch_problem(batch, {1: 0}) == "the kernel acknowledged 1 of 2 element messages"


def test_a_large_load_is_cut_into_batches_with_the_dispatch_maps_last() -> None:
    """Batches of about `per_batch` elements, each a whole transaction (its own begin, end and
    sequence numbers); the verdict maps' elements come last, together, in one batch."""
    cluster_ips = [((ip(f"10.96.{i // 256}.{i % 256}"), TCP, 80), None) for i in range(12_000)]
    dispatch = [((ip(f"10.96.0.{i}"), TCP, 80), Goto("endpoints-1")) for i in range(3)]
    elements: nb.Elements = {
        4: {"service-ips": dispatch, "cluster-ips": cluster_ips},
        6: {"service-ips": [((ip("fd00:96::1"), TCP, 80), Goto("endpoints-1"))]},
    }
    batches = list(nb.encode_batches(elements, per_batch=5000))
    sets_per_batch = [sorted({s for _, s in b.messages.values()}) for b in batches]
    assert sets_per_batch[:-1] == [["cluster-ips"]] * 3
    assert sets_per_batch[-1] == ["service-ips"]
    assert sorted(set(batches[-1].messages.values())) == [(4, "service-ips"), (6, "service-ips")]
    counted = []
    for batch in batches:
        (begin, *middle, end) = split_messages(batch.data)
        assert begin[0] == nb.NFNL_MSG_BATCH_BEGIN and end[0] == nb.NFNL_MSG_BATCH_END
        assert [seq for _, _, seq, _ in middle] == list(range(1, len(middle) + 1))
        counted.append(sum(p.count(struct.pack("=HH", 24, 0x8001)) for *_, p in middle))
    assert counted[:3] == [5000, 5000, 2000]
    # One batch when asked: the same elements, the dispatch maps still last.
    (whole,) = nb.encode_batches(elements, per_batch=0)
    assert list(whole.messages.values())[-2:] == [(4, "service-ips"), (6, "service-ips")]


def test_a_load_takes_its_elements_a_batch_at_a_time() -> None:
    """The backend hands the load its elements as a generator (a full sync's endpoints are
    made from the record's runs as they are consumed): each batch is encoded and handed on
    before the next batch's elements are taken, so they are never all held at once."""
    taken = 0

    def cluster_ips() -> Iterator[nb.Pair]:
        nonlocal taken
        for i in range(12_000):
            taken += 1
            yield ((ip(f"10.96.{i // 256}.{i % 256}"), TCP, 80), None)

    batches = nb.encode_batches({4: {"cluster-ips": cluster_ips()}}, per_batch=5000)
    first = next(batches)
    assert taken == 5000 and len(first.messages) >= 1
    assert [len(b.messages) >= 1 for b in batches] == [True, True]
    assert taken == 12_000
