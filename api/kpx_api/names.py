"""Kubernetes names: DNS labels and subdomains, label keys and values."""

from __future__ import annotations

from typing import Annotated, Final

from kpx_api.validation import Text

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = rf"{_DNS_LABEL}(\.{_DNS_LABEL})*"
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"

DNS_LABEL_PATTERN: Final = rf"^{_DNS_LABEL}$"
DNS_SUBDOMAIN_PATTERN: Final = rf"^{_DNS_SUBDOMAIN}$"
#: A label key (also a taint key or resource name): optional DNS subdomain prefix and "/", then
#: a name of at most 63 characters.
LABEL_KEY_PATTERN: Final = rf"^({_DNS_SUBDOMAIN}/)?{_NAME}$"
LABEL_KEY_MAX_LENGTH: Final = 253 + 1 + 63
LABEL_VALUE_PATTERN: Final = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
LABEL_VALUE_MAX_LENGTH: Final = 63

DNS_LABEL_MESSAGE: Final = (
    "must be a DNS-1123 label: at most 63 lowercase letters, digits and '-', "
    "starting and ending with a letter or digit"
)
DNS_SUBDOMAIN_MESSAGE: Final = (
    "must be a DNS-1123 subdomain: lowercase letters, digits, '-' and '.', "
    "starting and ending with a letter or digit"
)
LABEL_KEY_MESSAGE: Final = (
    "must be a label key: an optional DNS subdomain prefix and '/', then a name of at most "
    "63 letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
)
LABEL_VALUE_MESSAGE: Final = (
    "must be a label value: empty, or at most 63 letters, digits, '-', '_' and '.', "
    "starting and ending with a letter or digit"
)

#: A namespace name.
DNSLabel = Annotated[
    str, Text(max_length=63, min_length=1, pattern=DNS_LABEL_PATTERN, message=DNS_LABEL_MESSAGE)
]
#: An object name such as a PriorityClass name.
DNSSubdomain = Annotated[
    str,
    Text(
        max_length=253, min_length=1, pattern=DNS_SUBDOMAIN_PATTERN, message=DNS_SUBDOMAIN_MESSAGE
    ),
]
LabelKey = Annotated[
    str,
    Text(max_length=LABEL_KEY_MAX_LENGTH, pattern=LABEL_KEY_PATTERN, message=LABEL_KEY_MESSAGE),
]
LabelValue = Annotated[
    str,
    Text(
        max_length=LABEL_VALUE_MAX_LENGTH, pattern=LABEL_VALUE_PATTERN, message=LABEL_VALUE_MESSAGE
    ),
]

_LABEL_KEY_TEXT = Text(
    max_length=LABEL_KEY_MAX_LENGTH, pattern=LABEL_KEY_PATTERN, message=LABEL_KEY_MESSAGE
)


def is_label_key(key: str) -> bool:
    """Whether `key` is a valid label key (the same check as CEL `LABEL_KEYS_CEL`)."""
    return len(key) <= LABEL_KEY_MAX_LENGTH and _LABEL_KEY_TEXT.matches(key)


#: CEL for "every key of the map ``self`` is a label key".
LABEL_KEYS_CEL: Final = (
    f"self.all(k, size(k) <= {LABEL_KEY_MAX_LENGTH} && k.matches(r'{LABEL_KEY_PATTERN}'))"
)
