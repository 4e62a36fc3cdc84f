#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora into fuzz/seeds/<target>/ from real encodings:
the wire formats as documented in the decoders (frame.rs, negotiate.rs, strategy/ps/protocol.rs,
strategy/pipeline/wire.rs, events.rs, wire.rs, stall/watcher.rs), the repository's
example configs, model specs and inventory, and the first bytes of the vendored MNIST files.
Run from the repository root: python3 fuzz/seeds.py"""

import gzip
import json
import pathlib
import struct

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "fuzz" / "seeds"


def put(target, name, data):
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    (d / name).write_bytes(data)


def header(channel, flags, op, group, seq, tag, length):
    return struct.pack("<BBBBB3xQQII", 0xF1, 2, channel, flags, op, group, seq, tag, length)


def frames():
    put("frame", "p2p_hello", header(2, 0, 5, 0, 5, 6, 5) + b"hello")
    put("frame", "allreduce_empty", header(1, 0, 4, 7, 1 << 40, 3, 0))
    raw = bytes(i % 7 for i in range(5000))
    # An LZ4 block of literals only: token (15 literals, extended length), then the bytes.
    lit = raw[:300]
    block = bytes([0xF0]) + bytes([255]) + bytes([len(lit) - 15 - 255]) + lit
    payload = struct.pack("<I", len(lit)) + block
    put("frame", "lz4_literals", header(1, 1, 4, 0, 9, 0, len(payload)) + payload)


def ctrl():
    msgs = [
        {"Join": {"protocol": 1, "rank": 2, "world_size": 4, "config_hash": 99,
                  "token": "t", "mesh_addr": "10.0.0.2:5000"}},
        {"Welcome": {"rank": 1, "session": 7, "peers": ["a:1", "b:2"]}},
        {"Hello": {"session": 7, "from": 1, "to": 2}},
        {"HelloAck": {"from": 2}},
        "Ready",
        "Go",
        {"MeshFailed": {"reason": "no route"}},
        {"Abort": {"reason": "peer lost"}},
        {"Rejoin": {"protocol": 2, "rank": 2, "world_size": 3, "config_hash": 42}},
        {"Rejoined": {"session": 7, "peers": ["a:1", "b:2"]}},
    ]
    for i, m in enumerate(msgs):
        put("ctrl", f"msg{i}", json.dumps(m, separators=(",", ":")))


def comm_internal():
    put("comm_internal", "report_open", struct.pack("<BQQQ", 1, 12, 11, 250))
    put("comm_internal", "report_idle", struct.pack("<BQQQ", 0, 3, 2**64 - 1, 0))


def announce():
    def enc(stop, abort, ready, names):
        out = bytes([stop | abort << 1]) + struct.pack("<I", len(ready))
        out += b"".join(struct.pack("<Q", w) for w in ready)
        out += struct.pack("<I", len(names))
        for name, n in names:
            b = name.encode()
            out += struct.pack("<QI", n, len(b)) + b
        return out

    put("announce", "names", enc(0, 0, [], [("layers.0.weight", 150), ("é", 1)]))
    put("announce", "ready", enc(1, 0, [5, 2**64 - 1], []))
    put("announce", "abort", enc(0, 1, [1], [("b", 3)]))


def ps_message():
    floats = struct.pack("<3f", 1.0, -2.5, 3.25)
    put("ps_message", "pull", b"\x01")
    put("ps_message", "push", b"\x02" + struct.pack("<QIIfB", 7, 2, 64, 0.25, 1)
        + struct.pack("<Q", 3) + floats)
    put("ps_message", "params", b"\x03" + struct.pack("<QQ", 9, 3) + floats)
    put("ps_message", "reject", b"\x04" + struct.pack("<I", 9) + b"too stale")
    put("ps_message", "stop", b"\x05" + struct.pack("<I", 6) + b"target")
    put("ps_message", "abort", b"\x07" + struct.pack("<I", 4) + b"lost")
    put("ps_message", "gather", b"\x06" + struct.pack("<Q", 12))
    put("ps_message", "members", b"\x09" + struct.pack("<III", 2, 3, 7))


def pipeline_wire():
    put("pipeline_wire", "three", struct.pack("<Q3f", 3, 1.5, -2.0, 1e-38))
    put("pipeline_wire", "empty", struct.pack("<Q", 0))


def rank_event():
    put("rank_event", "progress",
        '@event {"event":"progress","step":3,"total":10,"epoch":1,"epochs":2,"loss":0.5}')
    put("rank_event", "failed", '@event {"event":"failed","blamed":2}')
    put("rank_event", "finished",
        '@event {"event":"finished","role":"root","figures":{"test_acc":0.99,"wall_s":3.5}}')


def texts():
    for f in sorted((ROOT / "examples").glob("*.yaml")):
        put("train_config", f.name, f.read_text())
    put("train_config", "env", "lr: 0.1\n\0WORLD_SIZE=4\nMASTER_ADDR=node1\nFLOTILLA_SEED=3\n"
        "FLOTILLA_COMM__TIMEOUT_S=5\n")
    for f in sorted((ROOT / "models").glob("*.yaml")):
        put("model_spec", f.name, f.read_text())
    put("inventory", "pool.ini", (ROOT / "examples" / "pool.ini").read_text())
    put("inventory", "list", "node1\nnode2:2222\n# comment\nuser@node3\n")
    put("launcher_env", "torchrun", "RANK=1\nLOCAL_RANK=0\nWORLD_SIZE=4\nMASTER_ADDR=h\n"
        "MASTER_PORT=29500\n")
    put("launcher_env", "slurm", "SLURM_PROCID=3\nSLURM_NTASKS=8\n"
        "SLURM_JOB_NODELIST=node[01-04,07],gpu1\n")
    put("topology", "flat", "arch: flat\nservers: 2\nparameter_server: "
        "{aggr_type: sync, num_workers: 4}\n")
    put("topology", "hier", "arch: hierarchical\nglobal_server: {aggr_type: sync, "
        "local_servers: [{aggr_type: async, num_workers: 2}, {aggr_type: sync, num_workers: 1}]}\n")


def idx():
    for f in sorted((ROOT / "data" / "mnist").glob("*.gz")):
        with gzip.open(f) as g:
            head = g.read(16)
        put("idx", f.name.replace(".gz", ".head"), head)
    images = struct.pack(">IIII", 0x803, 2, 3, 3) + bytes(range(18))
    labels = struct.pack(">II", 0x801, 4) + bytes([0, 1, 2, 9])
    put("idx", "images", images)
    put("idx", "labels", labels)
    put("idx", "images.gz", gzip.compress(images, mtime=0))


if __name__ == "__main__":
    # Regression inputs (regress-*: what fuzzing found) are kept; the rest is rewritten.
    for f in (frames, ctrl, comm_internal, announce, ps_message, pipeline_wire, rank_event,
              texts, idx):
        f()
    print(f"seeds written to {OUT.relative_to(ROOT)}")
