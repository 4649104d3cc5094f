#!/usr/bin/env python3
"""Test peer for tests/zmq.rs: a stand-in for vLLM's ZmqEventPublisher (pyzmq + msgspec).

Each engine binds, on 127.0.0.1 with a free port, like vLLM's
`vllm/distributed/kv_events.py`:
  * a PUB socket sending every batch as [topic, seq (8-byte big-endian), payload], seq
    counting from 0;
  * a ROUTER replay socket: a request [identity, b"", start_seq] is answered with
    [identity, b"", topic, seq, payload] for every buffered batch with seq >= start_seq,
    then [identity, b"", b"", 0xFFFF_FFFF_FFFF_FFFF, b""] (vLLM since its PR #45177, which
    added the topic frame); engine 1 answers as vLLM did before, without the topic frame:
    [identity, b"", seq, payload], then [identity, b"", 0xFFFF_FFFF_FFFF_FFFF, b""].

Payloads are msgspec-encoded KVEventBatches built from a deterministic W4-style workload
(shared system prompts + per-request tokens) on a small model of an engine's prefix cache:
BlockStored for the blocks a request adds (chained by parent_block_hash), BlockRemoved of
leaf blocks, and one AllBlocksCleared (engine 0, halfway; not with --restart-at). Engine 0
speaks the current vLLM encoding (array batch,
map events, int hashes, engine block = router block, topic `kv@127.0.0.1@model`, replay
answers with the topic frame); engine 1 an older one (array events, 32-byte `bytes` hashes,
engine block = 2 router blocks, data_parallel_rank = 1, topic "", replay answers without it).

With --restart-at B, engine 0 restarts like a new vLLM process after its real batch B: it
prints `PAUSED <last seq>` and waits for `RESTART`; then it closes its sockets, binds the same
ports again, starts `seq` from 0 with an empty replay buffer and an empty cache, publishes its
next (old counter + --restart-hidden) real batches to the replay buffer only, so the first
batch the subscriber sees is ahead of the old counter (a restart that outran it), prints
`RESTARTED <hidden>`, and sends heartbeats until `GO2`.

Protocol with the test on stdin/stdout:
  1. prints `ENGINE <i> <pub endpoint> <replay endpoint>` per engine, then `READY`;
  2. publishes an empty heartbeat batch per engine every 20 ms until it reads `GO`
     (so the test knows its SUB sockets receive: the PUB/SUB slow joiner);
  3. publishes the real batches, NOT sending on PUB those listed by --skip (they stay in
     the replay buffer), then 3 trailing heartbeats; prints `DONE <n0> <n1> ...` (batches
     per engine) and `SENT <seconds>`;
  4. keeps answering replay requests until `QUIT` or end of stdin; on `DUMP` it writes
     <out>/engine<i>.bin (every (seq, payload) published, skipped ones included: u64 BE
     seq, u32 BE length, payload) and <out>/requests.txt (one request's tokens per line),
     then prints `WRITTEN` (after the measured part, so it does not compete for the CPU).
"""

import argparse
import collections
import hashlib
import os
import queue
import random
import struct
import sys
import threading
import time
from typing import Any, Optional, Union

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)

# --- vLLM's structs, current encoding (map events) ----------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Optional[Union[int, bytes]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str] = None
    extra_keys: Optional[list[Any]] = None
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]
    group_idx: int = 0


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


# --- older encoding (array events, tag first) ---------------------------------------------


class ArrEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrBlockStored(ArrEvent, tag="BlockStored"):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Optional[Union[int, bytes]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class ArrBlockRemoved(ArrEvent, tag="BlockRemoved"):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]


class ArrAllBlocksCleared(ArrEvent, tag="AllBlocksCleared"):
    pass


ENCODER = msgspec.msgpack.Encoder()

# --- workload -----------------------------------------------------------------------------

ROUTER_BLOCK = 16
SYSTEM_PROMPTS = 8
SYSTEM_TOKENS = 128


class Engine:
    """A tiny model of one engine's prefix cache and the events it emits."""

    def __init__(self, index: int, seed: int, systems: list[list[int]]):
        self.index = index
        self.rng = random.Random(seed * 1000 + index)
        self.systems = systems
        self.old = index == 1
        self.block_size = ROUTER_BLOCK * (2 if self.old else 1)
        self.rank = index
        self.held: dict[Any, Any] = {}  # block hash -> parent hash (None for a root)
        self.children: collections.Counter = collections.Counter()
        self.chains: list[list[Any]] = []  # stored requests' block hashes
        self.no_clear = False  # with a restart, the restart is engine 0's clearing
        self.requests: list[list[int]] = []

    def block_hash(self, parent: Any, tokens: list[int]) -> Any:
        h = hashlib.blake2b(digest_size=32)
        h.update(repr(parent).encode())
        h.update(struct.pack(f"<{len(tokens)}I", *tokens))
        d = h.digest()
        return d if self.old else int.from_bytes(d[:8], "big")

    def stored(self, hashes, parent, tokens):
        if self.old:
            return ArrBlockStored(hashes, parent, tokens, self.block_size, None, "GPU")
        return MapBlockStored(hashes, parent, tokens, self.block_size, None, "GPU", None,
                              [None] * len(hashes))

    def removed(self, hashes):
        return ArrBlockRemoved(hashes, "GPU") if self.old else MapBlockRemoved(hashes, "GPU")

    def cleared(self):
        return ArrAllBlocksCleared() if self.old else MapAllBlocksCleared()

    def request(self) -> list[Any]:
        rng = self.rng
        tokens = list(self.systems[rng.randrange(len(self.systems))])
        tokens += [rng.randrange(32000) for _ in range(32 + rng.randrange(225))]
        self.requests.append(tokens)
        n = len(tokens) // self.block_size
        hashes, parent = [], None
        for b in range(n):
            blk = tokens[b * self.block_size:(b + 1) * self.block_size]
            parent = self.block_hash(parent, blk)
            hashes.append(parent)
        first = 0
        while first < n and hashes[first] in self.held:
            first += 1
        if first == n:
            return []
        parent = hashes[first - 1] if first > 0 else None
        for j in range(first, n):
            p = hashes[j - 1] if j > 0 else None
            self.held[hashes[j]] = p
            if p is not None:
                self.children[p] += 1
        self.chains.append(hashes)
        toks = tokens[first * self.block_size:n * self.block_size]
        return [self.stored(hashes[first:], parent, toks)]

    def evict(self) -> list[Any]:
        if not self.chains:
            return []
        chain = self.chains[self.rng.randrange(len(self.chains))]
        out = []
        for h in reversed(chain):
            if len(out) >= 1 + self.rng.randrange(4):
                break
            if h not in self.held:
                continue
            if self.children[h] > 0:
                break
            p = self.held.pop(h)
            if p is not None:
                self.children[p] -= 1
            out.append(h)
        return [self.removed(out)] if out else []

    def batch_events(self, i: int, n: int) -> list[Any]:
        if self.index == 0 and i == n // 2 and not self.no_clear:
            self.held.clear()
            self.children.clear()
            self.chains.clear()
            return [self.cleared()]
        events = []
        for _ in range(1 + self.rng.randrange(3)):
            events += self.request()
        if self.rng.random() < 0.4:
            events += self.evict()
        return events

    def encode(self, events: list[Any], ts: float) -> bytes:
        return ENCODER.encode(EventBatch(ts, events, self.rank))


def systems(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32000) for _ in range(SYSTEM_TOKENS)] for _ in range(SYSTEM_PROMPTS)]


# --- publisher ----------------------------------------------------------------------------


class Publisher:
    """vLLM's ZmqEventPublisher, minus its background thread."""

    def __init__(self, ctx: zmq.Context, buffer_steps: int, unbounded: bool, current: bool):
        self.ctx = ctx
        # The current vLLM publisher (a topic, replay answers with the topic frame) or an
        # older one (no topic, replay answers without it).
        self.topic = b"kv@127.0.0.1@model" if current else b""
        self.replay_topic = (self.topic,) if current else ()
        self.unbounded = unbounded
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if unbounded:
            self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: collections.deque = collections.deque(maxlen=buffer_steps)
        self.seq = 0
        self.log: list[tuple[int, bytes]] = []
        self.replays = 0

    @staticmethod
    def bind_again(sock: zmq.Socket, port: int):
        deadline = time.time() + 5
        while True:
            try:
                sock.bind(f"tcp://127.0.0.1:{port}")
                return
            except zmq.ZMQError:
                if time.time() > deadline:
                    raise
                time.sleep(0.02)

    def restart(self):
        """A new process on the same ports: new sockets, seq from 0, an empty buffer."""
        self.pub.close(linger=0)
        self.replay.close(linger=0)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if self.unbounded:
            self.pub.setsockopt(zmq.SNDHWM, 0)
        self.bind_again(self.pub, self.pub_port)
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.bind_again(self.replay, self.replay_port)
        self.buffer.clear()
        self.seq = 0



    def publish(self, payload: bytes, send: bool = True):
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        self.log.append((seq, payload))
        if send:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def service_replay(self):
        while True:
            try:
                frame = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frame) == 3:
                client_id, _, start = frame
            elif len(frame) == 2:
                client_id, start = frame
            else:
                print(f"invalid replay request: {frame!r}", file=sys.stderr)
                continue
            self.replays += 1
            start_seq = int.from_bytes(start, "big")
            for seq, buf in self.buffer:
                if seq >= start_seq:
                    self.replay.send_multipart(
                        (client_id, b"", *self.replay_topic, seq.to_bytes(8, "big"), buf)
                    )
            end_topic = (b"",) if self.replay_topic else ()
            self.replay.send_multipart((client_id, b"", *end_topic, END_SEQ, b""))


def stdin_reader(q: queue.Queue):
    for line in sys.stdin:
        q.put(line.strip())
    q.put("QUIT")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--batches", type=int, default=200, help="real batches per engine")
    ap.add_argument("--skip", default="", help="comma-separated real-batch indices not sent on PUB")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--buffer", type=int, default=10_000, help="replay buffer (batches)")
    ap.add_argument("--out", default=None, help="directory for engine<i>.bin and requests.txt")
    ap.add_argument("--blast", action="store_true",
                    help="unbounded PUB high-water mark; serve replays every 256 batches")
    ap.add_argument("--restart-at", type=int, default=None,
                    help="engine 0 restarts after this real batch")
    ap.add_argument("--restart-hidden", type=int, default=0,
                    help="first batches after the restart go to the replay buffer only")
    args = ap.parse_args()
    skip = {int(x) for x in args.skip.split(",") if x}

    syst = systems(args.seed)
    engines = [Engine(i, args.seed, syst) for i in range(args.engines)]
    for e in engines:
        e.no_clear = args.restart_at is not None
    # Pre-encode everything so publishing measures the wire, not the workload.
    payloads = []
    for e in engines:
        out = []
        for i in range(args.batches):
            if e.index == 0 and args.restart_at is not None and i == args.restart_at + 1:
                # the restarted engine's cache is empty
                e.held.clear()
                e.children.clear()
                e.chains.clear()
            out.append(e.encode(e.batch_events(i, args.batches), 1.7e9 + i))
        payloads.append(out)
    empty = [e.encode([], 1.7e9) for e in engines]

    ctx = zmq.Context()
    pubs = [Publisher(ctx, args.buffer, args.blast, not e.old) for e in engines]
    for i, p in enumerate(pubs):
        print(f"ENGINE {i} tcp://127.0.0.1:{p.pub_port} tcp://127.0.0.1:{p.replay_port}")
    print("READY", flush=True)

    cmds: queue.Queue = queue.Queue()
    threading.Thread(target=stdin_reader, args=(cmds,), daemon=True).start()

    def command(timeout: float) -> Optional[str]:
        try:
            return cmds.get(timeout=timeout)
        except queue.Empty:
            return None

    # 1. heartbeats until GO
    while True:
        for i, p in enumerate(pubs):
            p.publish(empty[i])
            p.service_replay()
        c = command(0.02)
        if c == "GO":
            break
        if c == "QUIT":
            return

    # 2. the real batches, round-robin over engines
    t0 = time.perf_counter()
    cursor = [0] * len(pubs)
    hidden_total = 0
    restarted = False

    def publish_next(i: int, send: Optional[bool] = None) -> int:
        b = cursor[i]
        cursor[i] += 1
        pubs[i].publish(payloads[i][b], send=(b not in skip) if send is None else send)
        return b

    while any(c < args.batches for c in cursor):
        for i, p in enumerate(pubs):
            if cursor[i] >= args.batches:
                continue
            b = publish_next(i)
            if i == 0 and b == args.restart_at and not restarted:
                restarted = True
                # wait until the test has seen the first epoch, then restart
                print(f"PAUSED {p.seq - 1}", flush=True)
                while True:
                    p.service_replay()
                    c = command(0.02)
                    if c == "RESTART":
                        break
                    if c == "QUIT":
                        return
                old = p.seq
                p.restart()
                # outrun the old counter: the new epoch's first batches go to the buffer only
                hidden_total = min(old + args.restart_hidden, args.batches - cursor[0] - 20)
                for _ in range(hidden_total):
                    publish_next(0, send=False)
                print(f"RESTARTED {hidden_total}", flush=True)
                # an engine keeps publishing: heartbeats until the test has seen the restart
                while True:
                    p.publish(empty[0])
                    p.service_replay()
                    c = command(0.02)
                    if c == "GO2":
                        break
                    if c == "QUIT":
                        return
        b = min(cursor)
        if not args.blast or b % 256 == 255:
            for p in pubs:
                p.service_replay()
    for _ in range(3):
        for i, p in enumerate(pubs):
            p.publish(empty[i])
    sent = time.perf_counter() - t0

    # DONE: each engine's last seq + 1 (its current epoch); LOGGED: batches published in all
    print("DONE " + " ".join(str(p.seq) for p in pubs))
    print("LOGGED " + " ".join(str(len(p.log)) for p in pubs))
    print(f"HIDDEN {hidden_total}")
    print(f"SENT {sent:.6f}", flush=True)

    def dump():
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            for i, p in enumerate(pubs):
                with open(os.path.join(args.out, f"engine{i}.bin"), "wb") as f:
                    for seq, buf in p.log:
                        f.write(struct.pack(">QI", seq, len(buf)))
                        f.write(buf)
            with open(os.path.join(args.out, "requests.txt"), "w") as f:
                for e in engines:
                    for r in e.requests:
                        f.write(" ".join(map(str, r)) + "\n")
        print("WRITTEN", flush=True)

    # 3. serve replays until told to quit
    poller = zmq.Poller()
    for p in pubs:
        poller.register(p.replay, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll(20):
            for p in pubs:
                if p.replay is sock:
                    p.service_replay()
        try:
            c = cmds.get_nowait()
        except queue.Empty:
            continue
        if c == "DUMP":
            dump()
        elif c == "QUIT":
            break
    print("REPLAYS " + " ".join(str(p.replays) for p in pubs), flush=True)


if __name__ == "__main__":
    main()
