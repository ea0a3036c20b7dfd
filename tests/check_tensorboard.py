#!/usr/bin/python3
"""Decodes a run's TensorBoard event files independently of dtrain's writer and checks
every scalar against metrics.jsonl.

The messages are built here from the field numbers TensorFlow publishes
(tensorflow/core/util/event.proto, tensorflow/core/framework/summary.proto) and parsed by
Python's protobuf (Debian's python3-protobuf); the TFRecord framing's masked CRC-32C is
computed bit by bit here, not with a table as the writer does.

    check_tensorboard.py RUN_DIR                 exit 0, or 1 with what differs
    check_tensorboard.py --tensorboard RUN_DIR   the same, read with tensorboard's own
                                                 EventAccumulator (what TensorBoard shows)
"""
import glob
import json
import os
import struct
import sys

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

F = descriptor_pb2.FieldDescriptorProto


def event_class():
    fdp = descriptor_pb2.FileDescriptorProto(name="tb_check.proto", package="tb", syntax="proto3")
    summary = fdp.message_type.add(name="Summary")
    value = summary.nested_type.add(name="Value")
    value.field.add(name="tag", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    value.field.add(name="simple_value", number=2, type=F.TYPE_FLOAT, label=F.LABEL_OPTIONAL)
    value.field.add(name="node_name", number=7, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    summary.field.add(name="value", number=1, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                      type_name=".tb.Summary.Value")
    event = fdp.message_type.add(name="Event")
    event.field.add(name="wall_time", number=1, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL)
    event.field.add(name="step", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    event.field.add(name="file_version", number=3, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    event.field.add(name="graph_def", number=4, type=F.TYPE_BYTES, label=F.LABEL_OPTIONAL)
    event.field.add(name="summary", number=5, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL,
                    type_name=".tb.Summary")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.MessageFactory(pool).GetPrototype(pool.FindMessageTypeByName("tb.Event"))


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path):
    raw = open(path, "rb").read()
    at = 0
    while at < len(raw):
        if len(raw) - at < 12:
            raise SystemExit(f"{path}: a record cut short at byte {at}")
        head = raw[at:at + 8]
        (length,) = struct.unpack("<Q", head)
        (head_crc,) = struct.unpack("<I", raw[at + 8:at + 12])
        if head_crc != masked(head):
            raise SystemExit(f"{path}: the length's CRC at byte {at} is wrong")
        data = raw[at + 12:at + 12 + length]
        (data_crc,) = struct.unpack("<I", raw[at + 12 + length:at + 16 + length])
        if data_crc != masked(data):
            raise SystemExit(f"{path}: the data's CRC at byte {at} is wrong")
        yield data
        at += 16 + length


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def read_with_tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(os.path.join(run_dir, "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {(e.step, tag): (e.value, e.wall_time)
            for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


def read_by_hand(run_dir):
    Event = event_class()
    files = glob.glob(os.path.join(run_dir, "tb", "events.out.tfevents.*"))
    if len(files) != 1:
        raise SystemExit(f"{run_dir}/tb: {len(files)} event files, expected 1")
    got = {}
    first = True
    for data in records(files[0]):
        e = Event.FromString(data)
        if first:
            if e.file_version != "brain.Event:2":
                raise SystemExit(f"first event's file_version is {e.file_version!r}")
            first = False
            continue
        for v in e.summary.value:
            key = (e.step, v.tag)
            if key in got:
                raise SystemExit(f"step {e.step} {v.tag} appears twice")
            got[key] = (v.simple_value, e.wall_time)
    return got


def main(run_dir, reader):
    got = reader(run_dir)
    want = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        j = json.loads(line)
        if j["kind"] not in ("train", "eval"):
            continue
        for k, v in j.items():
            if k in ("kind", "step", "epoch", "time") or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            want[(j["step"], f"{j['kind']}/{k}")] = (f32(v), j["time"])
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise SystemExit(f"scalars differ: missing {missing[:5]}, extra {extra[:5]}")
    for key, (value, time) in want.items():
        if got[key][0] != value or abs(got[key][1] - time) > 1e-6:
            raise SystemExit(f"step {key[0]} {key[1]}: {got[key]} in TensorBoard, {(value, time)} in metrics.jsonl")
    for tag in ("train/loss", "train/lr", "train/samples_per_s", "eval/loss"):
        if not any(t == tag for _, t in got):
            raise SystemExit(f"no {tag} scalar")
    print(f"check_tensorboard: {len(got)} scalars match metrics.jsonl ({reader.__name__})")


if __name__ == "__main__":
    if sys.argv[1] == "--tensorboard":
        main(sys.argv[2], read_with_tensorboard)
    else:
        main(sys.argv[1], read_by_hand)
