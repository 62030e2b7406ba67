"""kvtierd's page events on a ZMQ PUB socket in vLLM's KV-event wire format, for routers that
index vLLM's events (Dynamo's KV router, llm-d's KV-cache indexer and the like)::

    python -m kvtier.integrations.vllm.kv_events --daemon /run/kvtier/kvtierd.sock \\
        --endpoint 'tcp://*:5557' --replay-endpoint 'tcp://*:5558' --block-size 16

It follows one kvtierd's ``WatchEvents`` stream (:class:`kvtier.events.Follower`: resumes after
a disconnect, starts over from a snapshot after a restart) and publishes each batch as vLLM's
``ZmqEventPublisher`` does: a multipart message of the topic, the sequence number (8 bytes,
big-endian) and a msgpack ``KVEventBatch`` (``[ts, events, data_parallel_rank]``, each event a
map tagged ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``). A replay ROUTER socket
answers a request (an empty frame, then the first wanted sequence number as 8 bytes) with the
buffered messages from there, then an end marker (sequence -1, empty payload).

Mapping (docs/routing.md has the table):

- STORED → ``BlockStored``, consecutive pages of one prompt in one event, with the first's
  parent as ``parent_block_hash``. Block hashes are kvtier's 32-byte page keys (vLLM's
  ``ExternalBlockHash`` allows bytes): a router hashes a prompt with kvtier's hash spec
  (docs/hash-spec.md) and matches on them. ``token_ids`` is empty, since kvtierd keeps pages
  by key and never sees tokens.
- REMOVED → ``BlockRemoved``.
- The tier sets ``medium``: ``CPU`` for L2, ``STORAGE`` for L3 (pages this kvtierd wrote
  there, and its backend's evictions).
- CLEARED of every layout or of the bridged one, and RESYNC (the snapshot's pages follow) →
  ``AllBlocksCleared``. That event names no medium, so after an L3 clear the bridge asks
  kvtierd for a snapshot, which gives the subscribers back what L2 still holds.

With ``layout`` set, only that layout's pages are published (one model per socket, as vLLM
publishes); without it, every layout's.
"""

from __future__ import annotations

import argparse
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from kvtier.events import EventBatch, EventKind, EventTier, Follower, PageEvent

# vLLM's end-of-replay marker (ZmqEventPublisher.END_SEQ).
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# vLLM's media (vllm.distributed.kv_events.MEDIUM_*), by kvtier tier.
MEDIUM = {EventTier.L2_HOST: "CPU", EventTier.L3_STORAGE: "STORAGE"}


def _stored(events: Sequence[PageEvent], block_size: int) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [e.key for e in events],
        "parent_block_hash": events[0].parent,
        "token_ids": [],
        "block_size": block_size,
        "lora_id": None,
        "medium": MEDIUM[events[0].tier],
        "lora_name": None,
    }


def translate(
    batch: EventBatch, block_size: int, layout: str | None = None
) -> list[dict[str, Any]]:
    """``batch`` as vLLM's events (maps as msgpack encodes ``KVCacheEvent`` s), merging runs:
    STORED pages that continue the one before (same tier, parent = the previous key) share one
    ``BlockStored``, and consecutive REMOVED pages of a tier one ``BlockRemoved``."""
    out: list[dict[str, Any]] = []
    run: list[PageEvent] = []

    def flush() -> None:
        if run:
            out.append(_stored(run, block_size))
            run.clear()

    for e in batch.events:
        if e.kind in (EventKind.STORED, EventKind.REMOVED) and layout and e.layout != layout:
            continue
        if e.kind is EventKind.STORED:
            if run and (e.parent != run[-1].key or e.tier != run[-1].tier):
                flush()
            run.append(e)
            continue
        flush()
        if e.kind is EventKind.REMOVED:
            last = out[-1] if out else None
            medium = MEDIUM[e.tier]
            if last and last["type"] == "BlockRemoved" and last["medium"] == medium:
                last["block_hashes"].append(e.key)
            else:
                out.append({"type": "BlockRemoved", "block_hashes": [e.key], "medium": medium})
        elif e.kind is EventKind.RESYNC or not e.layout or not layout or e.layout == layout:
            # CLEARED (of everything, or of this layout) and RESYNC. vLLM's AllBlocksCleared
            # names no medium: an L3 clear sends it too, and the bridge then has kvtierd
            # resend what it still holds (KvEventsBridge asks for a snapshot).
            if not (out and out[-1]["type"] == "AllBlocksCleared"):
                out.append({"type": "AllBlocksCleared"})
    flush()
    return out


def _bound(sock: zmq.Socket[bytes], field: str, endpoint: str) -> zmq.Socket[bytes]:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise ValueError(f"{field}: cannot bind {endpoint!r}: {e}") from None
    return sock


class KvEventsBridge:
    """Publishes one kvtierd's events on ZMQ in vLLM's format until :meth:`close`.

    ``endpoint`` and ``replay_endpoint`` are bound (``tcp://*:0`` picks a port:
    :attr:`endpoint` tells which). ``buffer_steps`` batches are kept for replay.
    """

    def __init__(
        self,
        daemon: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        block_size: int,
        layout: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        data_parallel_rank: int | None = None,
        retry_s: float = 0.2,
    ):
        if block_size <= 0:
            raise ValueError(f"block_size: must be a positive number of tokens, got {block_size}")
        if buffer_steps <= 0:
            raise ValueError(f"buffer_steps: must be positive, got {buffer_steps}")
        self.block_size, self.layout, self.rank = block_size, layout, data_parallel_rank
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[bytes] = queue.Queue()
        self._encode = msgspec.msgpack.Encoder().encode
        self._position = (0, 0)
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._pub = _bound(self._ctx.socket(zmq.PUB), "endpoint", endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            try:
                replay = _bound(self._ctx.socket(zmq.ROUTER), "replay_endpoint", replay_endpoint)
            except ValueError:
                self._pub.close(linger=0)
                raise
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay = replay
        #: Batches published so far (the next one's sequence number).
        self.published = 0
        self._publisher = threading.Thread(
            target=self._publish_loop, name="kvtier-zmq-pub", daemon=True
        )
        self._follower = Follower(
            daemon, self._on_batch, lambda: self._position, retry_s, "kvtier-zmq-events"
        )
        self._publisher.start()
        self._follower.start()

    def _on_batch(self, batch: EventBatch) -> None:
        seqs = [e.seq for e in batch.events if e.seq]
        self._position = (batch.stream_id, max(seqs) if seqs else self._position[1])
        events = translate(batch, self.block_size, self.layout)
        if events:
            self._queue.put(self._encode([time.time(), events, self.rank]))
        # vLLM's AllBlocksCleared has no medium, so an L3 clear cleared the subscribers' L2
        # view too: a snapshot from kvtierd gives it back.
        if any(
            e.kind is EventKind.CLEARED
            and e.tier is EventTier.L3_STORAGE
            and (not self.layout or not e.layout or e.layout == self.layout)
            for e in batch.events
        ):
            self._follower.resync()

    def _publish_loop(self) -> None:
        # Both sockets live on this thread only (ZMQ sockets are not thread-safe).
        while not self._stop.is_set():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay(self._replay)
            try:
                payload = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            seq = self.published
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.published += 1

    def _serve_replay(self, sock: zmq.Socket[bytes]) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request: vLLM's publisher ignores these too
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                sock.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        sock.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._follower.stop()
        self._stop.set()
        self._publisher.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> KvEventsBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m kvtier.integrations.vllm.kv_events",
        description="Publish a kvtierd's page events on ZMQ in vLLM's KV-event format.",
    )
    ap.add_argument("--daemon", required=True, help="kvtierd's address (socket path or URL)")
    ap.add_argument("--endpoint", required=True, help="ZMQ PUB endpoint to bind")
    ap.add_argument("--replay-endpoint", help="ZMQ ROUTER endpoint for replays")
    ap.add_argument(
        "--block-size",
        type=int,
        required=True,
        help="tokens per page (the engine's block size), as BlockStored carries it",
    )
    ap.add_argument("--layout", help="publish only this layout fingerprint's pages")
    ap.add_argument("--topic", default="", help="ZMQ topic (vLLM's default: empty)")
    ap.add_argument("--buffer-steps", type=int, default=10_000, help="batches kept for replay")
    a = ap.parse_args(argv)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    try:
        bridge = KvEventsBridge(
            a.daemon,
            a.endpoint,
            a.replay_endpoint,
            block_size=a.block_size,
            layout=a.layout,
            topic=a.topic,
            buffer_steps=a.buffer_steps,
        )
    except ValueError as e:
        ap.error(str(e))
    with bridge:
        print(f"publishing on {bridge.endpoint} (replay: {bridge.replay_endpoint})", flush=True)
        done.wait()


if __name__ == "__main__":
    main()
