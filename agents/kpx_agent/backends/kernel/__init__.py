"""The mode-neutral kernel toolkit: what every mode (and the agent's conntrack edge) speaks to
the kernel in, defined once.

- `names`: every kernel object kpx creates or removes by name (nftables tables and their
  family keywords, the ipvs helper table);
- `netlink`: netlink framing (header, attributes, messages, acknowledgements; errors as
  positive errno values);
- `nft_schema`: the nftables vocabulary's data (field kinds, typed elements, `SetDecl`,
  `ChainDecl`); `nft_rules`: typed rules and their one nft text serializer;
  `nft_transaction`: a typed transaction (`Op`, one class per operation) and its nft text;
- `tool_input`: a kernel tool's input (`nft -f -`, `iptables-restore`) fed while it is still
  being made, never committed unfinished;
- for the kernel fakes every mode ships beside its adapter (`<mode>/fake.py`): `packet_walk`,
  a packet's path through netfilter's hooks over every random choice, and `nft_fake`, nftables
  tables built from typed transactions, checked as the kernel checks them and walked by their
  typed statements.

Nothing here decides anything about Services or the node: it is the vocabulary, never the
policy. Any mode may import it; it imports no mode.
"""
