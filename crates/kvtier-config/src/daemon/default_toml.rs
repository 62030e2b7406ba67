//! kvtierd's commented default file: one text, every key with its default and what it does,
//! assembled with the tables kvtierd shares with kvtier-agent (`[server.unix]`,
//! `[server.connections]`) and its own (`[server.admin]`, `[tenants]`).

/// The complete, commented default configuration. `kvtierd --print-default-config` prints it,
/// `deploy/kvtierd.toml` is a copy, and a test checks it parses to [`DaemonConfig::default`].
pub const DEFAULT_TOML: &str = concat!(
    r#"# kvtierd configuration.
#
# Every key is optional: the value shown is the default. Layering, lowest to highest:
# these defaults < this file < KVTIER_<SECTION>_<KEY> environment variables (KVTIER_<KEY> for
# top-level keys, e.g. KVTIER_L2_POOL_BYTES=1GiB) < `--set section.key=value` flags.
# Sizes take units B, KiB, MiB, GiB, TiB (K, M, G, T are the same binary multiples);
# durations take ms, s, m, h.

# Directory for the control socket and local state. Relative paths are relative to the
# directory kvtierd starts in.
data_dir = "kvtier-data"

[server]
# Unix domain socket of the gRPC control plane. Empty: <data_dir>/kvtierd.sock.
socket = ""
# The pool door: a Unix socket where a registered client receives its L2 pool as a file
# descriptor (SCM_RIGHTS), never as a path to open. Same access rules as the control socket.
# Empty: the control socket's path with ".pools" appended.
pool_socket = ""
# Optional TCP address for clients on other hosts, e.g. "0.0.0.0:50051". Empty: off.
# Over TCP every call but the grpc.health.v1 checks must present server.token, and the
# listener needs TLS (tls_cert and tls_key) unless tcp_insecure is set.
tcp = ""
# TLS of the TCP listener: PEM certificate chain and PEM private key files.
tls_cert = ""
tls_key = ""
# PEM CA bundle. Set: TCP clients must present a certificate it signed (mutual TLS).
tls_client_ca = ""
# Bearer token every call over TCP must present as "authorization: Bearer <token>"
# (required whenever tcp is set). Set it through KVTIER_SERVER_TOKEN or token_file, not this file.
token = ""
# A file holding the token (surrounding whitespace ignored), instead of token.
token_file = ""
# Serve TCP without TLS. Refused unless tcp is a loopback address (127.0.0.1, [::1]): for
# tests and single-host setups. The token is required all the same: without it every local
# user would get past [server.unix]'s mode and allow-lists.
tcp_insecure = false
# Most page keys accepted in one request (1 to 1048576).
max_batch = 65536
# Most WatchEvents streams, and most WatchMetrics streams, one caller holds open at once
# (1 to 4096); a caller also opens at most 4 a second (in bursts of this many). A caller is
# a role (the operator, peer kvtierds, or one tenant) and, on the Unix socket, one uid of
# it. Past either a stream is refused (RESOURCE_EXHAUSTED) and counted in
# kvtier_streams_refused_total.
max_streams_per_caller = 32
# On shutdown, how long in-flight requests and open connections get to finish before they
# are closed (100ms to 10m).
drain_timeout = "10s"
# Token that admin calls (attach / detach the storage tier) over TCP must present as
# "authorization: Bearer <token>". Empty: admin calls only on the Unix socket. Set it through
# KVTIER_SERVER_ADMIN_TOKEN rather than this file.
admin_token = ""
# Token of the peer kvtierds that use this one as their storage tier (their
# l3.remote.token): kvtier.v1.ObjectStorage is served to callers presenting it and to the
# operator. Empty: with no [tenants], every caller that may use kvtierd at all may use it
# too (one trust domain); with tenants, only the operator. Set it through
# KVTIER_SERVER_PEER_TOKEN or peer_token_file, not this file.
peer_token = ""
peer_token_file = ""
"#,
    crate::unix_default_toml!(),
    crate::connections_default_toml!(),
    crate::admin_default_toml!(),
    r#"
[metrics]
# Address of the Prometheus text endpoint (GET /metrics). Port 0 picks a free port.
# Empty: off.
listen = "127.0.0.1:9464"
# Bearer token a scrape must present ("Authorization: Bearer <token>"; Prometheus's
# authorization.credentials); empty: none. Set it through KVTIER_METRICS_TOKEN or token_file
# rather than this file. A wrong or missing one gets 401, counted in
# kvtier_metrics_unauthorized_total.
token = ""
token_file = ""
# Show the series labelled by tenant (kvtier_tenant_*: each tenant's name and usage) on this
# endpoint. Off by default: they are the operator's (kvtierctl status, WatchMetrics). On with
# a listen address other hosts can reach, a token is required.
tenant_series = false
# kvtier_lookup_hit_ceiling_ratio is the hit rate a cache without bound could reach: the share
# of the pages looked up that had been looked up before, over the requests of the last one to
# two of these windows (1s to 7d).
hit_ceiling_window = "1h"

[l2]
# A tmpfs where kvtierd keeps its pool files and slot tables, in a directory of its own made
# there at start: kvtierd-<uid>, mode 0700 (a symlink or another user's directory at that name
# stops kvtierd). No client opens them by name: the pool door (server.pool_socket) hands each
# session its pool's descriptor. The directory survives a kvtierd restart, for the crash
# takeover. Used with backing = "shm_file".
shm_dir = "/dev/shm"
# What backs each pool: "shm_file" (a file in kvtierd's directory in shm_dir, which a kvtierd
# started after a crash can take over) or "memfd" (no name at all, its size sealed; not taken
# over after a crash).
backing = "shm_file"
# Size of each pool class (one per layout: model, dtype, shape, page size, TP rank).
# Rounded down to whole slots; at least one slot.
pool_bytes = "256MiB"
# Alternatively a number of pages (slots) per pool class; overrides pool_bytes when above 0.
pool_pages = 0
# Largest page (one slot) a layout may have; a registration with larger pages is refused.
# Clients choose their layout, so this bounds what pool_pages can make kvtierd allocate.
max_page_bytes = "64MiB"
# Most pool classes (distinct layouts) served at once (1 to 1024).
max_pools = 8
# Most of them one named tenant's own pools may be (with tenant_pools), so no tenant can
# keep every place and refuse the others' first registration (0 to max_pools). 0: an even
# share, max_pools / (named tenants + 1), at least 1. A tenant at its share gives the place
# of its own least recently used idle pool to its new layout, or is refused.
max_pools_per_tenant = 0
# A pool no session has used for this long, and that holds no page L3 still lacks, is
# removed (its memory and its file in shm_dir given back). A new layout past max_pools takes
# the place of the least recently used such pool at once. 0: only at max_pools.
idle_pool_ttl = "1h"
# Which ready, unpinned leaf page to evict first: lru, lfu, fifo, mru, filo, priority, slru.
eviction_policy = "lru"
# Lock pools in RAM (needs RLIMIT_MEMLOCK / systemd LimitMEMLOCK above the pool size).
mlock = false
# Ask the kernel for transparent huge pages on the pools (best effort).
huge_pages = false
# While [tenants] names any: each named tenant gets its own pool per layout, whose descriptor
# only that tenant's sessions receive from the pool door. Costs a pool per tenant and layout
# (each counts in max_pools); a tenant's pool is not taken over after a crash (its pages come
# back from L3). false: one pool per layout mapped by every tenant's sessions (tenancy then
# scopes only the API).
tenant_pools = true
# Allocate each pool's memory when it is created (fallocate), after checking shm_dir has
# room: a /dev/shm too small for the pool is then a clear error at registration, not a
# SIGBUS later in whichever process first touches a page. false: pages on first use.
reserve = true
# Share of each pool that pages not yet written to L3 may take while L3 is up (0.05 to 1.0).
# Past it, writers (agents backing pages up) are refused until L3 writes land: that is the
# backpressure that slows engines to what L3 absorbs. The rest of the pool keeps pages L3
# holds, for readers and for prefetches to make room among.
dirty_fraction = 0.5
# While [tenants] names any: the share of that dirty limit (of the pool, without L3) one
# session, and one tenant's sessions together, may hold reserved and not yet committed (0.05
# to 1.0). A client that reserves and never commits then blocks at most this much; past it
# its reservations get NO_SPACE (it commits what it has, then reserves again) and every other
# tenant keeps writing. Without tenants every writer is one trust domain and has no budget.
reserve_share = 0.5
# Survive a kvtierd crash with L2 intact (shm_file pools). Each committed page gets a record
# beside the pool (key, length, CRC32C, computed in the background), cleared before its slot
# is reused. A kvtierd that starts and finds a dead one's pool takes over every page whose
# record and checksum verify, and serves them at once; a page half-written, or changed after
# its record, is never taken. false: no records, and a dead kvtierd's pools are removed.
take_over_after_crash = true

[l3]
# The storage tier behind L2: "file" (the embedded default: one file per page, [l3.file]),
# "rocksdb" (pages in a RocksDB database with blob files, [l3.rocksdb]), "s3" (any
# S3-compatible object store: AWS S3, MinIO, Ceph RGW, [l3.s3]), "remote" (another kvtierd's
# storage tier, [l3.remote]), "memory" (a bounded in-process map, for trials, [l3.memory]),
# or "none". Each backend's own keys are in its section below; only the chosen one's are used.
backend = "file"
# When pages are written from L2 to L3. Under every policy an L2 slot is reused only after
# L3 holds its page: pages not yet written are flushed (coldest first) as the pool runs short
# of free slots. Only while L3 is down (circuit breaker open) are pages evicted unwritten,
# counted in kvtier_l2_lost_pages_total. The policies differ in how early the write starts:
#   write_through           every committed page, at once;
#   write_through_selective pages whose L2 hit count reaches write_threshold, the rest when
#                           the pool needs their slots;
#   write_back              only pages about to be evicted from L2.
write_policy = "write_through"
# Hits at which write_through_selective writes a page early (1 to 1000000).
write_threshold = 2
# Which pages L2 writes to L3 at all. Each pool's filter hears of every page it stores or
# serves, and a page it declines leaves L2 unwritten (as with no L3), counted in
# kvtier_l3_admission_pages_total and kvtier_l2_declined_pages_total. Seen again while L2
# still holds it, it is admitted and written then.
#   all         every page;
#   seen_twice  a page seen twice within the last one to two windows;
#   tinylfu     a page seen twice within a window, or often before (TinyLFU's frequency
#               sketch, its counts halved every ten windows).
admission = "all"
# New pages sighted (stored or served; repeats do not count) per window of the admission
# filter, about the pages L3 holds (1024 to 67108864). Memory per pool: none for all; for
# either filter 4 bytes per page of the window when it is a power of two (up to 5 for
# seen_twice and 6.5 for tinylfu otherwise): 4 MiB at the default, 256 MiB at the largest.
admission_window = 1048576
# Early writes waiting for the writer (1 to 1048576). When full, a page waits in L2 for the
# flush before its eviction (counted as deferred); no client ever waits for L3.
queue_pages = 16384
# Pages the writer takes from the queue at a time (1 to 4096).
batch_pages = 128
# Backend writes in flight at once (1 to 256).
concurrency = 4
# Deadline of each backend call (1ms to 10m).
timeout = "5s"
# Retries of a backend call (read, write, exists) that failed in a way that may pass
# (an I/O error, a timeout, a throttled or unavailable backend), within the call's deadline
# (0 to 10). Waits double from retry_backoff, each drawn from half to all of it (jitter).
retries = 2
# The first retry's backoff (100us to 10s).
retry_backoff = "2ms"
# The circuit breaker opens when at least this share of the backend calls of the last
# breaker_window failed (0.01 to 1.0), once the window holds breaker_min_calls: then calls
# fail at once (reads miss; writes stay queued, and L2 pages not in L3 may be evicted,
# counted as lost) instead of waiting on a dead backend. Isolated errors, retried, never
# open it.
breaker_failure_rate = 0.5
# Calls the window must hold before its failure rate is judged (1 to 100000).
breaker_min_calls = 20
# How far back the failure rate looks (100ms to 10m).
breaker_window = "10s"
# How long the breaker stays open before one probe call is let through (10ms to 10m).
breaker_cooldown = "1s"
# Chaos drill: every L3 read (get) waits this long before it starts, to rehearse a slow
# storage tier (prefetch policies, timeouts, metrics). 0s: off; keep it off in production.
fault_get_delay = "0s"
# Chaos drill: every L3 write (set) waits this long before it starts, to rehearse storage
# slower than the engines (backpressure, no page lost). 0s: off; keep it off in production.
fault_set_delay = "0s"
# Chaos drill: each L3 call fails with this probability (0.0 to 1.0), to rehearse an unreliable
# storage tier. 0: off; keep it off in production.
fault_error_rate = 0.0

[l3.file]
# Directory of the pages. Empty: <data_dir>/l3.
path = ""
# Most bytes kept; least recently used pages are evicted above it. A size ("500GiB"), a share
# of the space the store may use ("50%": of the filesystem's free space when kvtierd starts
# plus what the store already holds; kvtierctl backend status shows the bytes), or 0: no bound.
capacity_bytes = "50%"
# Writes are refused while the filesystem has less free space than this.
min_free_bytes = "1GiB"
# Pages older than this are misses and are deleted. 0s: never.
ttl = "0s"
# fsync each page before it becomes visible (durable across power loss).
sync = false
# How page bytes reach the disk: "buffered" (through the kernel's page cache, which keeps a
# second copy of what L2 holds and serves a page read again soon from memory) or "direct"
# (O_DIRECT through aligned buffers: every read from the device, nothing cached twice;
# refused at start on a filesystem without O_DIRECT: some FUSE and network filesystems,
# tmpfs before Linux 6.6).
io = "buffered"

[l3.rocksdb]
# Database directory. Empty: <data_dir>/rocksdb.
path = ""
# Most bytes kept; least recently used pages are evicted above it. 0: no bound.
capacity_bytes = "0"
# Sync the write-ahead log on every write.
sync = false

[l3.s3]
# Endpoint URL for S3-compatible servers (MinIO, Ceph RGW), e.g. "http://127.0.0.1:7480".
# Empty: AWS S3 (region from region).
endpoint = ""
# Region. Empty: us-east-1.
region = ""
# The bucket (it must exist). Required with backend = "s3".
bucket = ""
# Key prefix inside the bucket, e.g. "kvtier/prod". Empty: none.
prefix = ""
# Credentials. Empty: the standard AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY environment
# variables. Set the secret through KVTIER_L3_S3_SECRET_KEY rather than this file.
access_key = ""
secret_key = ""
# Virtual-hosted-style requests (bucket.host). false: path style, which MinIO and Ceph RGW
# need.
virtual_hosted = false

[l3.remote]
# The kvtierd whose storage tier this one uses: https://host:port (its server.tcp with TLS),
# http://host:port (a peer with server.tcp_insecure, loopback only) or a Unix socket path.
# Required with backend = "remote".
address = ""
# PEM CA bundle the peer's certificate chains to. Required with https.
tls_ca = ""
# PEM client certificate and key, for a peer that sets server.tls_client_ca.
tls_cert = ""
tls_key = ""
# The peer's server.peer_token (or its server.token, when the peer has neither tenants nor a
# peer token). Set it through KVTIER_L3_REMOTE_TOKEN or token_file.
token = ""
token_file = ""

[l3.memory]
# Most bytes kept (oldest pages evicted first). Above 0.
capacity_bytes = "1GiB"

[prefetch]
# Loading pages from L3 into L2 ahead of a request (Prefetch RPC). The L3 hit is measured with
# one batched exists before any L2 slot is allocated.
#
# When a prefetch is done by default (a request may choose its own):
#   best_effort   the client takes what has landed whenever it asks; the rest is cancelled;
#   wait_complete the client's take waits for every hit page (bounded by timeout_max);
#   timeout       the daemon stops the prefetch at
#                 min(timeout_max, timeout_base + timeout_per_1k_tokens * tokens / 1024)
#                 and the client takes what landed by then.
policy = "timeout"
# Prefetches whose L3 hit is shorter than this many tokens are revoked (not worth a round
# trip); no slot is allocated for them.
threshold_tokens = 256
# The engine's prefill throughput (tokens per second). A prefetch whose estimated load time
# (from the backend's measured latency and bandwidth) exceeds the time to recompute its
# tokens at this rate is revoked. 0: never revoke on this ground.
recompute_tokens_per_second = 20000
# Share of each pool's slots that prefetches may hold at once (reserved or landed and not yet
# taken), 0.0 to 1.0.
budget_fraction = 0.5
# Pages fetched per batch; progress is reported at least once per batch (1 to 4096).
batch_pages = 128
# Backend reads in flight at once per prefetch, at least (1 to 256). The number adapts per
# backend between this and max_concurrency from the reads' latencies: a latency-bound
# backend (S3, a remote node, a throttled store) gets more reads at once, a saturated one
# (a local disk) stays near this.
concurrency = 16
# The most reads in flight per prefetch (concurrency to 4096).
max_concurrency = 512
# Timeout policy: the deadline is min(timeout_max, timeout_base + timeout_per_1k_tokens *
# tokens / 1024), counted from the prefetch's start. timeout_max also bounds wait_complete.
timeout_base = "2s"
timeout_per_1k_tokens = "100ms"
timeout_max = "30s"
# Keys whose L3 read just failed (missing, corrupt, timed out) are not prefetched again for
# this long, so a stale exists is not retried in a loop (0s: off).
negative_ttl = "5s"
# Most keys remembered as failed.
negative_capacity = 65536
# Most prefetches a session may have open (running, or landed and not yet taken).
max_per_session = 1024

[sglang_rpc]
# Serve SGLang's HiCache RPC storage protocol (`--hicache-storage-backend rpc`), so SGLang
# stores its host KV pages in kvtierd's L3 with no code on the SGLang side. Give SGLang
# {"mempool_socket": "unix://<mempool_socket>", "grpc_socket": "unix://<grpc_socket>"}.
enable = false
# Unix socket where SGLang registers its host pool (a memfd). Empty:
# <data_dir>/sglang-mempool.sock.
mempool_socket = ""
# Unix socket of the sglang.runtime.hicache.StorageServer gRPC service. Empty:
# <data_dir>/sglang-grpc.sock.
grpc_socket = ""
# Where SGLang's objects persist: "shared" (the [l3] backend above, in a namespace of their
# own: its capacity, breaker, timeout and metrics apply) or "none" (memory only, below).
l3 = "shared"
# Recently put or got objects kept in kvtierd's memory, so every SGLang instance on the node
# is served from memory instead of L3: kvtierd's own L2 pages, one pool of this many bytes per
# object size (SGLang's come in one or two sizes; at most two per tenant are kept), under L2's
# eviction policy and quotas, counted toward l2.max_pools, surviving a crash as L2 does (plus
# at most 64 MiB of spare buffers kept for reuse). "0B": off; with l3 = "none" it is the only
# copy.
memory_bytes = "1GiB"
# Backend calls in flight per batch (1 to 256).
concurrency = 16
# Most transfers or ids in one request (1 to 1048576); a larger request is refused whole
# (InvalidArgument), never half done. SGLang sends one id per page and per layer and part
# for layer_first pools: 128 pages of a 126-layer model are 32,256.
max_batch = 65536

[sessions]
# A client that has not sent a heartbeat for this long is considered dead: its pins are
# dropped and the pages it was writing are freed (100ms to 1h).
ttl = "10s"
"#,
    crate::tenants_default_toml!(),
    r#"
[log]
# Log filter, as RUST_LOG: error, warn, info, debug, trace, or per-module directives.
level = "info"
"#
);
