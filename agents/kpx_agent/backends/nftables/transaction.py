"""Builds the text of one `nft -f` transaction (pure)."""

from __future__ import annotations

from collections.abc import Iterable

from . import names as n


class Transaction:
    """Commands for one family's table, rendered in order as one atomic script."""

    def __init__(self, family: int) -> None:
        self.prefix = f"{n.FAMILIES[family]} {n.TABLE}"
        self._lines: list[str] = []

    def __bool__(self) -> bool:
        return bool(self._lines)

    def raw(self, text: str) -> None:
        self._lines.append(text.rstrip("\n"))

    def replace_table(self, definition: str) -> None:
        """Swap the whole table atomically (create-if-missing, delete, define)."""
        self._lines.append(f"add table {self.prefix}")
        self._lines.append(f"delete table {self.prefix}")
        self.raw(definition)

    def add_endpoint_chain(self, name: str, map_definition: str, rule: str) -> None:
        """Create a new chain with its own map, used by its one rule (never rewritten)."""
        self._lines.append(f"add map {self.prefix} {name} {{ {map_definition} }}")
        self._lines.append(f"add chain {self.prefix} {name}")
        self._lines.append(f"add rule {self.prefix} {name} {rule}")

    def add_port_chain(
        self, name: str, sets: Iterable[tuple[str, str]], rules: Iterable[str]
    ) -> None:
        """Create (or rewrite) a chain owned by one service port, with the sets it uses."""
        for set_name, body in sets:
            self._lines.append(f"add set {self.prefix} {set_name} {{ {body} }}")
        self._lines.append(f"add chain {self.prefix} {name}")
        self._lines.append(f"flush chain {self.prefix} {name}")
        for rule in rules:
            self._lines.append(f"add rule {self.prefix} {name} {rule}")

    def delete_chain(self, name: str) -> None:
        self._lines.append(f"flush chain {self.prefix} {name}")
        self._lines.append(f"delete chain {self.prefix} {name}")

    def delete_set(self, name: str) -> None:
        self._lines.append(f"delete set {self.prefix} {name}")

    def delete_elements(self, set_name: str, keys: Iterable[str]) -> None:
        body = ", ".join(keys)
        if body:
            self._lines.append(f"delete element {self.prefix} {set_name} {{ {body} }}")

    def add_elements(self, set_name: str, elements: Iterable[tuple[str, str | None]]) -> None:
        body = ", ".join(k if v is None else f"{k} : {v}" for k, v in elements)
        if body:
            self._lines.append(f"add element {self.prefix} {set_name} {{ {body} }}")

    def render(self) -> str:
        return "\n".join(self._lines) + "\n" if self._lines else ""
