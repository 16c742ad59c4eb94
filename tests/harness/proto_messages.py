"""Protobuf message classes for the tests, built at run time from descriptors (no protoc here).

``shop/common.proto`` (package ``shop.common``): ``Address {string city = 1; optional string zip = 2;}``.
``shop/order.proto`` (package ``shop``, imports common and the well-known types)::

    enum State { NEW = 0; PAID = 1; SHIPPED = 2; }
    message Order {
      int64 id = 1; string status = 2; bool active = 3; double score = 4; float ratio = 5;
      bytes blob = 6; State state = 7; google.protobuf.Timestamp at = 8;
      google.protobuf.Duration wait = 9; google.protobuf.Int64Value maybe = 10;
      google.protobuf.StringValue note = 11; shop.common.Address address = 12;
      repeated string tags = 13; map<string, int64> attrs = 14; optional string nickname = 15;
      uint64 big = 16; int32 small = 17; google.protobuf.Struct extra = 18;
      message Line { string sku = 1; int32 qty = 2; }  repeated Line lines = 19;
    }
    message Refund { int64 id = 1; string reason = 2; }   // the file's second message: indexes [1]

``classes()`` returns ``(Order, Refund)`` from a private pool.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    duration_pb2,
    message_factory,
    struct_pb2,
    timestamp_pb2,
    wrappers_pb2,
)

F = descriptor_pb2.FieldDescriptorProto


def _field(msg: Any, name: str, number: int, kind: int, type_name: str | None = None, *,
           repeated: bool = False, proto3_optional: bool = False) -> None:
    f = msg.field.add(name=name, number=number, type=kind,
                      label=F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL)
    if type_name:
        f.type_name = type_name
    if proto3_optional:
        f.proto3_optional = True
        f.oneof_index = len(msg.oneof_decl)
        msg.oneof_decl.add(name=f"_{name}")


def _common() -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto(name="shop/common.proto", package="shop.common", syntax="proto3")
    address = fd.message_type.add(name="Address")
    _field(address, "city", 1, F.TYPE_STRING)
    _field(address, "zip", 2, F.TYPE_STRING, proto3_optional=True)
    return fd


def _order() -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto(name="shop/order.proto", package="shop", syntax="proto3")
    fd.dependency.extend(["shop/common.proto", "google/protobuf/timestamp.proto", "google/protobuf/duration.proto",
                          "google/protobuf/wrappers.proto", "google/protobuf/struct.proto"])
    state = fd.enum_type.add(name="State")
    for number, name in enumerate(("NEW", "PAID", "SHIPPED")):
        state.value.add(name=name, number=number)
    order = fd.message_type.add(name="Order")
    _field(order, "id", 1, F.TYPE_INT64)
    _field(order, "status", 2, F.TYPE_STRING)
    _field(order, "active", 3, F.TYPE_BOOL)
    _field(order, "score", 4, F.TYPE_DOUBLE)
    _field(order, "ratio", 5, F.TYPE_FLOAT)
    _field(order, "blob", 6, F.TYPE_BYTES)
    _field(order, "state", 7, F.TYPE_ENUM, ".shop.State")
    _field(order, "at", 8, F.TYPE_MESSAGE, ".google.protobuf.Timestamp")
    _field(order, "wait", 9, F.TYPE_MESSAGE, ".google.protobuf.Duration")
    _field(order, "maybe", 10, F.TYPE_MESSAGE, ".google.protobuf.Int64Value")
    _field(order, "note", 11, F.TYPE_MESSAGE, ".google.protobuf.StringValue")
    _field(order, "address", 12, F.TYPE_MESSAGE, ".shop.common.Address")
    _field(order, "tags", 13, F.TYPE_STRING, repeated=True)
    entry = order.nested_type.add(name="AttrsEntry")
    entry.options.map_entry = True
    _field(entry, "key", 1, F.TYPE_STRING)
    _field(entry, "value", 2, F.TYPE_INT64)
    _field(order, "attrs", 14, F.TYPE_MESSAGE, ".shop.Order.AttrsEntry", repeated=True)
    _field(order, "nickname", 15, F.TYPE_STRING, proto3_optional=True)
    _field(order, "big", 16, F.TYPE_UINT64)
    _field(order, "small", 17, F.TYPE_INT32)
    _field(order, "extra", 18, F.TYPE_MESSAGE, ".google.protobuf.Struct")
    line = order.nested_type.add(name="Line")
    _field(line, "sku", 1, F.TYPE_STRING)
    _field(line, "qty", 2, F.TYPE_INT32)
    _field(order, "lines", 19, F.TYPE_MESSAGE, ".shop.Order.Line", repeated=True)
    refund = fd.message_type.add(name="Refund")
    _field(refund, "id", 1, F.TYPE_INT64)
    _field(refund, "reason", 2, F.TYPE_STRING)
    return fd


def classes() -> tuple[Any, Any]:
    """``(Order, Refund)`` message classes, in a fresh private descriptor pool."""
    pool = descriptor_pool.DescriptorPool()
    for module in (timestamp_pb2, duration_pb2, wrappers_pb2, struct_pb2):
        pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    pool.Add(_common())
    pool.Add(_order())
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.Order")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.Refund")))
