"""Every kernel object kpx owns by name, and the nft family keywords, are spelled once: as a
string literal only in the kernel toolkit's `names` module (kpx_agent.backends.kernel.names),
in the whole product, harness and benchmarks. Everything else imports the constant, so a
rename cannot leave one place behind (the ipvs table name was spelled in 2 places, the
family map in 4)."""

from __future__ import annotations

import ast
from pathlib import Path

from kpx_agent.backends.kernel import names

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("agents", "kube", "api", "operator", "harness", "bench")
NAMES_FILE = "agents/kpx_agent/backends/kernel/names.py"
#: The literals named once: kernel objects and nft keywords whose spelling is not common
#: English (the nftables table "kpx" and the family keyword "ip" are, so they are checked by
#: value below instead).
ONCE = (
    names.IPVS_TABLE,
    names.IPVS_DUMMY,
    names.NFT_FAMILIES[6],
    *names.NFT_ADDR_TYPE.values(),
)


def literal_sites(source: str, literals: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, literal) of each string constant in `source` that is exactly one of `literals`
    (text that merely mentions one, in a message or an f-string, is not a spelling)."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in literals
    ]


def test_each_kernel_name_is_spelled_once_in_the_names_module() -> None:
    found: dict[str, list[str]] = {literal: [] for literal in ONCE}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            if ".venv" in path.parts:
                continue
            rel = path.relative_to(ROOT).as_posix()
            for line, literal in literal_sites(path.read_text(), ONCE):
                found[literal].append(f"{rel}:{line}")
    assert found == {literal: [found[literal][0]] for literal in ONCE}, found
    assert all(site.startswith(NAMES_FILE) for sites in found.values() for site in sites)


def test_the_names_are_what_the_kernel_and_upstream_call_them() -> None:
    assert names.NFT_FAMILIES == {4: "ip", 6: "ip6"}
    assert names.NFT_ADDR_TYPE == {4: "ipv4_addr", 6: "ipv6_addr"}
    assert (names.NFT_TABLE, names.IPVS_TABLE, names.IPVS_DUMMY) == (
        "kpx",
        "kpx-ipvs",
        "kube-ipvs0",
    )


def test_the_scan_sees_what_it_must() -> None:
    """A literal in any expression is found; a mention inside longer text is not."""
    source = (
        'TABLE = "kpx-ipvs"\n'
        'run(["nft", "delete", "table", "ip6", TABLE])\n'
        'log.info("removed the kpx-ipvs tables")\n'
        'x = f"{family} kpx-ipvs"\n'
    )
    assert literal_sites(source, ONCE) == [(1, "kpx-ipvs"), (2, "ip6")]
