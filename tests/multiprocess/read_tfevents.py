#!/usr/bin/env python3
"""An independent reader of TensorBoard event files for the tracker test: TFRecord framing and masked
CRC32C checked with the standard library, Event messages decoded by python3-protobuf from the module
protoc generated for proto/xlr8/tensorboard.proto.

read_tfevents.py GENERATED_DIR EVENT_FILE  ->  one JSON line: file_version, scalars {tag: [[step, value]]},
texts {tag: [[step, text]]}, hparams {session_start: {name: value}, session_end: status}, records.
"""
import json
import struct
import sys

sys.path.insert(0, sys.argv[1])
from xlr8 import tensorboard_pb2  # noqa: E402


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def main():
    data = open(sys.argv[2], "rb").read()
    pos, out = 0, {"file_version": None, "scalars": {}, "texts": {}, "hparams": {}, "records": 0}
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        if length_crc != masked(header):
            raise SystemExit("bad length CRC at byte %d" % pos)
        body = data[pos + 12 : pos + 12 + length]
        (body_crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
        if body_crc != masked(body):
            raise SystemExit("bad data CRC at byte %d" % pos)
        pos += 16 + length
        out["records"] += 1
        event = tensorboard_pb2.Event()
        event.ParseFromString(body)
        if event.HasField("file_version"):
            out["file_version"] = event.file_version
        for value in event.summary.value:
            if value.HasField("simple_value"):
                out["scalars"].setdefault(value.tag, []).append([event.step, value.simple_value])
            elif value.metadata.plugin_data.plugin_name == "text":
                out["texts"].setdefault(value.tag, []).append([event.step, value.tensor.string_val[0].decode()])
            elif value.metadata.plugin_data.plugin_name == "hparams":
                hparams = tensorboard_pb2.HParamsPluginData()
                hparams.ParseFromString(value.metadata.plugin_data.content)
                kind = hparams.WhichOneof("data")
                if kind == "session_start_info":
                    start = {}
                    for name, v in hparams.session_start_info.hparams.items():
                        start[name] = getattr(v, v.WhichOneof("kind"))
                    out["hparams"]["session_start"] = start
                elif kind == "session_end_info":
                    out["hparams"]["session_end"] = hparams.session_end_info.status
    print(json.dumps(out))


if __name__ == "__main__":
    main()
