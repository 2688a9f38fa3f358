"""The tenants YAML file: entries validated as a whole before anything is stored, keys only as hashes.

The file is a list of entries, or a mapping with a `tenants:` list. Each entry is a `TenantSpec`
plus `api_key` and/or `api_keys`, each `sha256:<64 hex digits>`: a plaintext key in a file would
be a secret in a config repository, so it is refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, field_validator

from antumbra.platform.ingress.tenant_spec import TenantError, TenantSpec

_HASHED_KEY = re.compile(r"^sha256:([0-9a-fA-F]{64})$")


class TenantFileError(TenantError):
    """A tenants YAML file that cannot be read or does not validate; nothing from it was stored."""


class TenantFileEntry(TenantSpec):
    """One entry of a tenants file: a spec plus key hashes, never plaintext keys."""

    api_key: str | None = None
    api_keys: list[str] = Field(default_factory=list)

    @field_validator("api_key")
    @classmethod
    def _one_hashed(cls, value: str | None) -> str | None:
        return None if value is None else _parse_hashed_key(value)

    @field_validator("api_keys")
    @classmethod
    def _all_hashed(cls, values: list[str]) -> list[str]:
        return [_parse_hashed_key(v) for v in values]

    def key_hashes(self) -> list[str]:
        hashes = list(self.api_keys)
        if self.api_key is not None:
            hashes.append(self.api_key)
        return sorted(set(hashes))

    def spec(self) -> TenantSpec:
        return TenantSpec.model_validate(self.model_dump(exclude={"api_key", "api_keys"}))


def _parse_hashed_key(value: str) -> str:
    match = _HASHED_KEY.match(value.strip())
    if match is None:
        raise ValueError(
            "API keys in a tenants file must be given as sha256:<64 hex digits> "
            '(for example `printf %s "$KEY" | sha256sum`), never in plaintext'
        )
    return match.group(1).lower()


def read_tenant_file(path: Path) -> list[TenantFileEntry]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise TenantFileError(f"cannot read tenants file {path}: {exc}") from exc
    if isinstance(data, dict) and set(data) == {"tenants"}:
        data = data["tenants"]
    if data is None:
        return []
    if not isinstance(data, list):
        raise TenantFileError(f"{path}: expected a list of tenants or a mapping with a `tenants:` list")
    entries: list[TenantFileEntry] = []
    for i, item in enumerate(data):
        try:
            entries.append(TenantFileEntry.model_validate(item))
        except ValidationError as exc:
            raise TenantFileError(f"{path}: tenant #{i + 1}: {_short(exc)}") from exc
    ids = [e.id for e in entries]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise TenantFileError(f"{path}: tenant ids appear more than once: {', '.join(dupes)}")
    owners: dict[str, str] = {}
    for e in entries:
        for h in e.key_hashes():
            if owners.setdefault(h, e.id) != e.id:
                raise TenantFileError(f"{path}: tenants {owners[h]!r} and {e.id!r} list the same API key")
    return entries


def _short(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'entry'}: {err['msg']}" for err in exc.errors()
    )
