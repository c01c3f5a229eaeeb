"""Reads the protobuf wire format just far enough to say which string field is not UTF-8.

protobuf rejects a proto3 string holding invalid UTF-8 but does not say which field held it; a
client deserves "params.stop[0]" rather than "cannot parse". This walks the encoded message
alongside its descriptor and tries each string field's bytes.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


class _Truncated(Exception):
    pass


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise _Truncated
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _is_repeated(field: FieldDescriptor) -> bool:
    # `is_repeated` is new (protobuf 6); older releases only have `label`.
    if hasattr(field, "is_repeated"):
        return field.is_repeated
    return field.label == FieldDescriptor.LABEL_REPEATED


def find_invalid_utf8(descriptor: Descriptor, data: bytes) -> str | None:
    """The path of the first string field whose bytes are not UTF-8 (for example
    "params.stop[0]"), or None when there is none or the bytes are not a message at all."""
    try:
        return _search(descriptor, data, prefix="")
    except _Truncated:
        return None


def _search(descriptor: Descriptor, data: bytes, prefix: str) -> str | None:
    seen: dict[int, int] = {}  # occurrences so far of each repeated field
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            _, pos = _varint(data, pos)
        elif wire_type == _FIXED64:
            pos += 8
        elif wire_type == _FIXED32:
            pos += 4
        elif wire_type == _LENGTH_DELIMITED:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
            if pos > len(data):
                raise _Truncated
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            path = prefix + field.name
            if _is_repeated(field):
                index = seen.get(number, 0)
                seen[number] = index + 1
                path += f"[{index}]"
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    value.decode("utf-8")
                except UnicodeDecodeError:
                    return path
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = _search(field.message_type, value, path + ".")
                if found is not None:
                    return found
        else:  # groups (proto2 only) or garbage: nothing more to learn
            return None
    return None
