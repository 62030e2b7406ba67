"""A client of SGLang's HiCache RPC storage protocol, doing what SGLang's own client does.

SGLang (``--hicache-storage-backend rpc``) talks to an out-of-tree storage server over two
Unix sockets:

* the *mempool* socket, where each scheduler process registers its host KV pool: one
  ``sendmsg`` of 8 bytes of magic (u64 ``0x8DF6FBFD``, little-endian), a u32 little-endian
  name length and the UTF-8 name, with the pool's memfd as ``SCM_RIGHTS``. The server
  answers the pool id as a u32 little-endian. The connection stays open while the pool is
  in use; closing it unregisters the pool.
* the *gRPC* socket, service ``sglang.runtime.hicache.StorageServer``: ``Exist``,
  ``BatchPut`` and ``BatchGet`` move objects by (offset, length) iovecs into the pool.

The gRPC stubs are generated at import time from the project's own
``proto/sglang/runtime/hicache/storage.proto`` with grpcio-tools, so this client and
kvtierd are held to the same definition.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import struct
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import grpc

from kvtier.testing.processes import ROOT

MAGIC = 0x8DF6FBFD
# What SGLang's client allows: messages up to 512 MiB, 120 s per call.
MAX_MESSAGE = 512 << 20
TIMEOUT_S = 120.0

PROTO_ROOT = ROOT / "proto"
PROTO = "sglang/runtime/hicache/storage.proto"


def _generate_stubs():
    """Generates the Python stubs of the protocol into a temporary directory and imports them."""
    from grpc_tools import protoc

    out = Path(tempfile.mkdtemp(prefix="kvtier-sglang-stubs-"))
    wkt = Path(protoc.__file__).parent / "_proto"
    code = protoc.main(
        [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{wkt}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            PROTO,
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO} (exit {code})")
    # The proto's package is `sglang.runtime.hicache`, but the real `sglang` package is
    # installed beside these tests: load the generated modules under names of their own.
    gen = out / "sglang" / "runtime" / "hicache"
    pb2 = _load("kvtier_tests_hicache_storage_pb2", gen / "storage_pb2.py")
    grpc_py = gen / "storage_pb2_grpc.py"
    grpc_py.write_text(
        grpc_py.read_text().replace(
            "from sglang.runtime.hicache import storage_pb2",
            "import kvtier_tests_hicache_storage_pb2",
        )
    )
    pb2_grpc = _load("kvtier_tests_hicache_storage_pb2_grpc", grpc_py)
    return pb2, pb2_grpc


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load the generated module {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


pb2, pb2_grpc = _generate_stubs()


def preamble(name: bytes, magic: int = MAGIC) -> bytes:
    """The registration message's bytes (without the descriptor)."""
    return struct.pack("<QI", magic, len(name)) + name


def send_registration(path: str, name: bytes, fds: list[int], magic: int = MAGIC) -> socket.socket:
    """Connects to the mempool socket and sends one registration message with `fds`."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
    s.sendmsg([preamble(name, magic)], anc)
    return s


def read_pool_id(s: socket.socket) -> int | None:
    """The 4-byte pool id the server answers, or None when it closed the connection instead."""
    got = b""
    while len(got) < 4:
        try:
            chunk = s.recv(4 - len(got))
        except (TimeoutError, ConnectionResetError):
            return None
        if not chunk:
            return None
        got += chunk
    return struct.unpack("<I", got)[0]


class HostPool:
    """A host KV pool as SGLang keeps it: a memfd, mapped by the storage server too."""

    def __init__(self, size: int, name: str = "sglang-host-pool", sealable: bool = False):
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealable else 0))
        os.ftruncate(self.fd, size)

    def write(self, offset: int, data: bytes) -> None:
        assert os.pwrite(self.fd, data, offset) == len(data)

    def read(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def close(self) -> None:
        os.close(self.fd)


class Client:
    """One SGLang scheduler's view: its registered pool and the gRPC stub."""

    def __init__(self, mempool_socket: str, grpc_socket: str, pool: HostPool, name: str = "tp0"):
        self.pool = pool
        self.registration = send_registration(mempool_socket, name.encode(), [pool.fd])
        pool_id = read_pool_id(self.registration)
        if pool_id is None:
            raise RuntimeError("the storage server refused the pool registration")
        self.pool_id = pool_id
        self.channel = grpc.insecure_channel(
            f"unix://{grpc_socket}",
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE),
                ("grpc.max_receive_message_length", MAX_MESSAGE),
            ],
        )
        self.stub = pb2_grpc.StorageServerStub(self.channel)

    def transfer(
        self, obj_id: str | bytes, iovecs: list[tuple[int, int]], pool_id: int | None = None
    ):
        return pb2.Transfer(
            id=obj_id.encode() if isinstance(obj_id, str) else obj_id,
            iovec=[pb2.Iovec(offset=o, length=n) for o, n in iovecs],
            pool_id=self.pool_id if pool_id is None else pool_id,
        )

    def exist(self, ids: list[str]) -> list[bool]:
        r = self.stub.Exist(pb2.ExistRequest(id=[i.encode() for i in ids]), timeout=TIMEOUT_S)
        return list(r.results)

    def batch_put(self, transfers) -> list[int]:
        return list(
            self.stub.BatchPut(pb2.BatchPutRequest(puts=transfers), timeout=TIMEOUT_S).results
        )

    def batch_get(self, transfers) -> list[int]:
        return list(
            self.stub.BatchGet(pb2.BatchGetRequest(gets=transfers), timeout=TIMEOUT_S).results
        )

    def unregister(self) -> None:
        """Closes the registration connection, as SGLang does when it shuts down."""
        self.registration.close()

    def close(self) -> None:
        self.channel.close()
        try:
            self.registration.close()
        except OSError:
            pass
