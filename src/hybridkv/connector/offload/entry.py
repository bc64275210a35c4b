"""One stored block as bytes: a checked header, then the payload. The disk tier writes it as a
file, the Redis tier as a value; both check it on every read.

    entry = header | layout fp | key | payload
    header (32 bytes, little-endian):
        magic "HKVBLOCK" | u16 format version | u16 len(fp) | u32 len(key)
        | u64 len(payload) | u64 xxh3-64(payload)

A value is served only if its header is whole, names this key and this layout, its length
adds up and the payload's checksum matches: bytes of another key, a truncated entry or
garbage are a miss, never loaded. Parsing is struct unpacking only (never pickle): a poisoned
entry can at worst be rejected.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from hybridkv.connector.offload.store import Payload

MAGIC = b"HKVBLOCK"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHHIQQ")


def encode_header(layout_fingerprint: bytes, key: bytes, payload: Payload) -> bytes:
    """Everything an entry holds before its payload."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, len(layout_fingerprint), len(key), len(payload),
                       xxhash.xxh3_64_intdigest(payload)) + layout_fingerprint + key


@dataclass(frozen=True)
class Header:
    layout_fingerprint: bytes
    key: bytes
    payload_len: int
    checksum: int

    @property
    def entry_bytes(self) -> int:
        return HEADER.size + len(self.layout_fingerprint) + len(self.key) + self.payload_len


def unpack_fixed(data: Payload) -> tuple[int, int, int, int] | None:
    """(len(fp), len(key), len(payload), checksum) from the fixed part, or None if it is not
    a header of this format (too short, wrong magic or version)."""
    if len(data) < HEADER.size:
        return None
    magic, version, fp_len, key_len, payload_len, checksum = HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        return None
    return fp_len, key_len, payload_len, checksum


def decode_header(data: Payload) -> Header | None:
    """The header at the start of `data`, or None if there is none (or it is cut short)."""
    fixed = unpack_fixed(data)
    if fixed is None:
        return None
    fp_len, key_len, payload_len, checksum = fixed
    fp_end = HEADER.size + fp_len
    if len(data) < fp_end + key_len:
        return None
    return Header(bytes(data[HEADER.size:fp_end]), bytes(data[fp_end:fp_end + key_len]),
                  payload_len, checksum)


def open_entry(data: Payload, key: bytes, layout_fingerprint: bytes) -> memoryview | None:
    """The payload of a whole entry of `key` under `layout_fingerprint` (a view: no copy),
    or None if the entry is anything else."""
    header = decode_header(data)
    if (header is None or header.key != key or header.layout_fingerprint != layout_fingerprint
            or header.entry_bytes != len(data)):
        return None
    payload = memoryview(data)[len(data) - header.payload_len:]
    if xxhash.xxh3_64_intdigest(payload) != header.checksum:
        return None
    return payload
