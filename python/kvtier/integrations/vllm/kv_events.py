"""kvtierd's page events on a ZMQ PUB socket in vLLM's KV-event wire format, for routers that
index vLLM's events (Dynamo's KV router, llm-d's KV-cache indexer and the like)::

    python -m kvtier.integrations.vllm.kv_events --daemon /run/kvtier/kvtierd.sock \\
        --endpoint 'tcp://127.0.0.1:5557' --replay-endpoint 'tcp://127.0.0.1:5558' \\
        --block-size 16

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

Doors (docs/routing.md): the events name pages a router could use to learn what tenants
store, so an endpoint binds loopback or ``ipc://`` unless CURVE admits listed subscribers
only (``curve_secret_key``: the bridge's secret key, Z85, and ``curve_clients``: the public
keys that may subscribe), or ``open_endpoints`` says an address other hosts reach without
that is meant. A subscriber's messages are bounded (4 KiB). The bridge
publishes what its kvtierd identity may see: run it as a tenant's process (or with its
token) to publish only that tenant's pages. Batches wait for the publisher in a bounded
queue: past ``queue_batches`` the oldest go and the subscribers get a clear and a fresh
snapshot instead (``dropped`` counts them). Replays are served on a thread of their own,
at most ``replays_per_s`` a second (a request past that gets the end marker alone), so a
replay flood never delays the live stream.
"""

from __future__ import annotations

import argparse
import ipaddress
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
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


def _local(endpoint: str) -> bool:
    """Whether ``endpoint`` is reachable from this host only: ``ipc://``, ``inproc://``, or
    TCP on a loopback address."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc") or not sep:
        return True  # no network (or no endpoint at all: binding it fails, naming it)
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name, a host name: other hosts may reach it


@dataclass(frozen=True)
class Curve:
    """CURVE for the bridge's sockets: its secret key (Z85, 40 characters) and, when given,
    the public keys (Z85) of the only subscribers admitted."""

    secret_key: bytes
    clients: tuple[bytes, ...] = ()

    @property
    def public_key(self) -> bytes:
        return zmq.curve_public(self.secret_key)


def _bound(
    sock: zmq.Socket[bytes],
    field: str,
    endpoint: str,
    curve: Curve | None,
    open_endpoints: bool,
) -> zmq.Socket[bytes]:
    # CURVE without an allow-list encrypts, but admits any key: libzmq lets every client in
    # when no authenticator is installed.
    admits_listed = curve is not None and bool(curve.clients)
    if not admits_listed and not open_endpoints and not _local(endpoint):
        sock.close(linger=0)
        raise ValueError(
            f"{field}: {endpoint!r} is reachable from other hosts, and the events name every "
            "page the bridge's kvtierd identity may see: bind 127.0.0.1 or ipc://, turn CURVE "
            "on with the subscribers' keys (curve_secret_key and curve_clients), or say "
            "open_endpoints (--open-endpoints) to mean it"
        )
    # What a subscriber sends is a subscription or a replay request: a few bytes.
    sock.setsockopt(zmq.MAXMSGSIZE, 4096)
    if curve is not None:
        sock.curve_secretkey = curve.secret_key
        sock.curve_publickey = curve.public_key
        sock.curve_server = True
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise ValueError(f"{field}: cannot bind {endpoint!r}: {e}") from None
    return sock


class _Rate:
    """At most ``per_s`` events a second (a token bucket of one second's worth)."""

    def __init__(self, per_s: float):
        self.per_s, self.tokens, self.at = per_s, per_s, time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.per_s, self.tokens + (now - self.at) * self.per_s)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


class KvEventsBridge:
    """Publishes one kvtierd's events on ZMQ in vLLM's format until :meth:`close`.

    ``endpoint`` and ``replay_endpoint`` are bound (``tcp://127.0.0.1:0`` picks a port:
    :attr:`endpoint` tells which); one other hosts can reach needs ``curve`` or
    ``open_endpoints``. ``buffer_steps`` batches are kept for replay; ``queue_batches`` wait
    for the publisher at most; ``replays_per_s`` replay requests are served a second.
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
        curve: Curve | None = None,
        open_endpoints: bool = False,
        queue_batches: int = 1_000,
        replays_per_s: float = 10.0,
    ):
        if block_size <= 0:
            raise ValueError(f"block_size: must be a positive number of tokens, got {block_size}")
        if buffer_steps <= 0:
            raise ValueError(f"buffer_steps: must be positive, got {buffer_steps}")
        if queue_batches <= 0:
            raise ValueError(f"queue_batches: must be positive, got {queue_batches}")
        if replays_per_s <= 0:
            raise ValueError(f"replays_per_s: must be positive, got {replays_per_s}")
        self.block_size, self.layout, self.rank = block_size, layout, data_parallel_rank
        self._topic = topic.encode()
        # Written by the publisher, read by the replay thread: under the lock.
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._buffer_lock = threading.Lock()
        self._queue: queue.Queue[bytes] = queue.Queue(maxsize=queue_batches)
        # A batch was dropped: a snapshot is owed once the queue is drained.
        self._behind = threading.Event()
        #: Batches dropped because the publisher fell ``queue_batches`` behind (each time,
        #: the subscribers get a clear and a fresh snapshot instead).
        self.dropped = 0
        #: Replay requests answered with the end marker alone, past ``replays_per_s``.
        self.replays_refused = 0
        self._rate = _Rate(replays_per_s)
        self._encode = msgspec.msgpack.Encoder().encode
        self._position = (0, 0)
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._auth = None
        if curve is not None and curve.clients:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", _AllowKeys(curve.clients))
        try:
            self._pub = _bound(
                self._ctx.socket(zmq.PUB), "endpoint", endpoint, curve, open_endpoints
            )
        except ValueError:
            self._stop_auth()
            raise
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            try:
                replay = _bound(
                    self._ctx.socket(zmq.ROUTER),
                    "replay_endpoint",
                    replay_endpoint,
                    curve,
                    open_endpoints,
                )
            except ValueError:
                self._pub.close(linger=0)
                self._stop_auth()
                raise
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay = replay
        #: Batches published so far (the next one's sequence number).
        self.published = 0
        self._publisher = threading.Thread(
            target=self._publish_loop, name="kvtier-zmq-pub", daemon=True
        )
        self._replayer = threading.Thread(
            target=self._replay_loop, name="kvtier-zmq-replay", daemon=True
        )
        self._follower = Follower(
            daemon, self._on_batch, lambda: self._position, retry_s, "kvtier-zmq-events"
        )
        self._publisher.start()
        if self._replay is not None:
            self._replayer.start()
        self._follower.start()

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def _on_batch(self, batch: EventBatch) -> None:
        seqs = [e.seq for e in batch.events if e.seq]
        self._position = (batch.stream_id, max(seqs) if seqs else self._position[1])
        events = translate(batch, self.block_size, self.layout)
        if events:
            try:
                self._queue.put_nowait(self._encode([time.time(), events, self.rank]))
            except queue.Full:
                # The publisher is behind: rather than wait (the follower would stall on
                # kvtierd's stream) or grow without bound, drop the batch; once the
                # publisher has caught up, the subscribers start over from a snapshot.
                self.dropped += 1
                self._behind.set()
                return
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
        # The PUB socket lives on this thread only (ZMQ sockets are not thread-safe).
        while not self._stop.is_set():
            try:
                payload = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self._behind.is_set():
                    # Drained after dropping: what the subscribers hold is no longer what
                    # kvtierd holds; a clear and a snapshot give it back.
                    self._behind.clear()
                    self._follower.resync()
                continue
            seq = self.published
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            with self._buffer_lock:
                self._buffer.append((seq, payload))
            self.published += 1

    def _replay_loop(self) -> None:
        # The ROUTER socket lives on this thread only.
        sock = self._replay
        assert sock is not None
        while not self._stop.is_set():
            if sock.poll(50):
                self._serve_replay(sock)

    def _serve_replay(self, sock: zmq.Socket[bytes]) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request: vLLM's publisher ignores these too
        client, _, start = frames
        if not self._rate.take():
            self.replays_refused += 1
            sock.send_multipart((client, b"", b"", END_SEQ, b""))
            return
        first = int.from_bytes(start, "big")
        with self._buffer_lock:
            wanted = [(seq, p) for seq, p in self._buffer if seq >= first]
        for seq, payload in wanted:
            sock.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        sock.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._follower.stop()
        self._stop.set()
        self._publisher.join(timeout=5)
        if self._replay is not None:
            self._replayer.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._stop_auth()

    def __enter__(self) -> KvEventsBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _AllowKeys:
    """The ZAP callback that admits the listed CURVE public keys (Z85) alone."""

    def __init__(self, keys: Sequence[bytes]):
        self.keys = set(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        # pyzmq hands the client's key Z85-encoded.
        return key in self.keys


def _read_key(path: str, what: str) -> bytes:
    key = open(path, "rb").read().strip()
    if len(key) != 40:
        raise ValueError(f"{what}: {path} holds {len(key)} bytes; a Z85 CURVE key has 40")
    return key


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
    ap.add_argument(
        "--curve-secret-key-file",
        help="file of the bridge's CURVE secret key (Z85): subscribers then need its public key",
    )
    ap.add_argument(
        "--curve-client-key",
        action="append",
        default=[],
        help="file of a subscriber's CURVE public key (Z85); given, only these may subscribe",
    )
    ap.add_argument(
        "--open-endpoints",
        action="store_true",
        help="bind an address other hosts reach without CURVE (the events are then open)",
    )
    ap.add_argument(
        "--replays-per-s", type=float, default=10.0, help="replay requests served a second"
    )
    a = ap.parse_args(argv)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    try:
        curve = None
        if a.curve_secret_key_file:
            curve = Curve(
                _read_key(a.curve_secret_key_file, "--curve-secret-key-file"),
                tuple(_read_key(f, "--curve-client-key") for f in a.curve_client_key),
            )
        elif a.curve_client_key:
            raise ValueError("--curve-client-key: needs --curve-secret-key-file")
        bridge = KvEventsBridge(
            a.daemon,
            a.endpoint,
            a.replay_endpoint,
            block_size=a.block_size,
            layout=a.layout,
            topic=a.topic,
            buffer_steps=a.buffer_steps,
            curve=curve,
            open_endpoints=a.open_endpoints,
            replays_per_s=a.replays_per_s,
        )
    except (ValueError, OSError) as e:
        ap.error(str(e))
    with bridge:
        print(f"publishing on {bridge.endpoint} (replay: {bridge.replay_endpoint})", flush=True)
        done.wait()


if __name__ == "__main__":
    main()
