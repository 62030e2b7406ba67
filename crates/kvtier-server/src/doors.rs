//! Every door of kvtier's processes, as data: each gRPC method kvtierd and kvtier-agent
//! serve, each stream, and each listener they (and the vLLM events bridge) open, with the
//! roles it admits, what bounds it, and the source file that owns it.
//!
//! The table is read, not restated:
//! - every gRPC server carries [`crate::guard::Guard`], which looks each call's method up
//!   here and refuses a method with no row and a role its row does not admit;
//! - every listener is bound and capped through a [`Listener`], whose row names it in logs
//!   and metrics ([`crate::peers::PeerGate::bind`], [`crate::conn::Cap::new`]);
//! - the long-lived streams take their per-caller bound through [`Bound::StreamsPerCaller`];
//! - docs/SECURITY.md's door table is [`render_markdown`]'s output, checked by a test.
//!
//! A new surface is covered by adding one row: kvtierd's tests enumerate every RPC of every
//! proto file it and the agent serve, and fail on a method with no row (or a row with no
//! method), and call each method in each role to see it refused or served as its row says.

use std::fmt::Write as _;

/// The process a door belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Server {
    /// kvtierd, the node daemon.
    Kvtierd,
    /// kvtier-agent, one per engine worker.
    Agent,
    /// The vLLM KV-events bridge (`kvtier.vllm.kv_events`), in the engine's process.
    Bridge,
}

impl Server {
    /// Its name in docs and errors.
    pub fn name(self) -> &'static str {
        match self {
            Server::Kvtierd => "kvtierd",
            Server::Agent => "kvtier-agent",
            Server::Bridge => "events bridge",
        }
    }
}

/// Who a caller is, as far as a door cares. Resolving it is each server's business (kvtierd:
/// the peer's uid on a Unix socket, else its bearer token; the agent: the peer's uid).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Who {
    /// The operator: the server's own uid, `[server.admin]`, or `server.admin_token`.
    Operator,
    /// Another kvtierd using this one as its storage tier (`server.peer_token`).
    Peer,
    /// An engine of a named tenant (`[tenants.*]`: a uid, gid or token).
    Tenant,
    /// An engine of the default tenant: any other admitted caller.
    DefaultTenant,
    /// A TCP caller without a token the server knows, where one is needed.
    Unauthenticated,
}

impl Who {
    /// Every role, in the table's column order.
    pub const ALL: [Who; 5] = [
        Who::Operator,
        Who::Peer,
        Who::Tenant,
        Who::DefaultTenant,
        Who::Unauthenticated,
    ];

    /// The role in words.
    pub fn describe(self) -> &'static str {
        match self {
            Who::Operator => "the operator",
            Who::Peer => "a peer kvtierd",
            Who::Tenant => "a named tenant",
            Who::DefaultTenant => "the default tenant",
            Who::Unauthenticated => "unauthenticated",
        }
    }

    /// Its column heading.
    pub fn column(self) -> &'static str {
        match self {
            Who::Operator => "operator",
            Who::Peer => "peer",
            Who::Tenant => "tenant",
            Who::DefaultTenant => "default tenant",
            Who::Unauthenticated => "unauthenticated",
        }
    }
}

/// Whether a door admits the default tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultTenant {
    /// Never.
    No,
    /// Always.
    Yes,
    /// Only while the server is one trust domain: no `[tenants]` named and no
    /// `server.peer_token` set (every caller can already write any key through HostTier).
    InOneTrustDomain,
}

/// The roles a door admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admits {
    operator: bool,
    peer: bool,
    tenant: bool,
    default_tenant: DefaultTenant,
    unauthenticated: bool,
    /// Where a refused caller is told to look.
    how: &'static str,
}

impl Admits {
    /// The operator's alone.
    pub const OPERATOR: Admits = Admits {
        operator: true,
        peer: false,
        tenant: false,
        default_tenant: DefaultTenant::No,
        unauthenticated: false,
        how: "it is the operator's: a uid in [server.admin] (or the server's own) on the Unix \
              socket, or \"authorization: Bearer <server.admin_token>\"",
    };
    /// The storage tier: the operator and peer kvtierds (and everyone in one trust domain).
    pub const STORAGE: Admits = Admits {
        operator: true,
        peer: true,
        tenant: false,
        default_tenant: DefaultTenant::InOneTrustDomain,
        unauthenticated: false,
        how: "it is for peer kvtierds and the operator: present \"authorization: Bearer \
              <server.peer_token>\"",
    };
    /// Every caller the server knows: the operator, peers and every tenant.
    pub const CALLERS: Admits = Admits {
        operator: true,
        peer: true,
        tenant: true,
        default_tenant: DefaultTenant::Yes,
        unauthenticated: false,
        how: "calls over TCP need \"authorization: Bearer <server.token>\" (or a tenant's, a \
              peer's or the admin token)",
    };
    /// Engines: the operator and every tenant, not peers.
    pub const ENGINES: Admits = Admits {
        operator: true,
        peer: false,
        tenant: true,
        default_tenant: DefaultTenant::Yes,
        unauthenticated: false,
        how: "it is for engines on the node's Unix socket",
    };
    /// Anyone who reaches the listener: health probes carry no secret and learn only
    /// "serving".
    pub const ANYONE: Admits = Admits {
        operator: true,
        peer: true,
        tenant: true,
        default_tenant: DefaultTenant::Yes,
        unauthenticated: true,
        how: "",
    };

    /// Whether `who` may pass, on a server that is (or is not) one trust domain.
    pub fn admits(self, who: Who, one_trust_domain: bool) -> bool {
        match who {
            Who::Operator => self.operator,
            Who::Peer => self.peer,
            Who::Tenant => self.tenant,
            Who::DefaultTenant => match self.default_tenant {
                DefaultTenant::No => false,
                DefaultTenant::Yes => true,
                DefaultTenant::InOneTrustDomain => one_trust_domain,
            },
            Who::Unauthenticated => self.unauthenticated,
        }
    }

    /// What a refused caller is told would admit it.
    pub fn how(self) -> &'static str {
        self.how
    }

    /// The table cell for `who`.
    fn cell(self, who: Who) -> &'static str {
        match (who, self.default_tenant) {
            (Who::DefaultTenant, DefaultTenant::InOneTrustDomain) => "one trust domain",
            _ if self.admits(who, false) => "yes",
            _ => "no",
        }
    }
}

/// What a door is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A gRPC method taking and giving one message.
    Unary,
    /// A gRPC method giving a stream.
    ServerStream,
    /// A gRPC method taking a stream.
    ClientStream,
    /// A gRPC method taking and giving streams.
    BidiStream,
    /// A socket a process listens on.
    Listener,
}

impl Kind {
    fn describe(self) -> &'static str {
        match self {
            Kind::Unary => "unary",
            Kind::ServerStream => "server stream",
            Kind::ClientStream => "client stream",
            Kind::BidiStream => "bidi stream",
            Kind::Listener => "listener",
        }
    }
}

/// What keeps one caller from taking more than its share through a door.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// `[server.connections]`: connections in all (fitted to `RLIMIT_NOFILE` at start) and
    /// per peer, and a deadline for a new connection's first bytes.
    Connections,
    /// `server.max_batch` items per call.
    Batch,
    /// One session's state, which the caller owns; sessions are bounded by `l2.max_pools`
    /// and `l2.max_pools_per_tenant`.
    Session,
    /// A tenant's share of the pool (`l2.reserve_share`, `l2.dirty_fraction`): every slot it
    /// reserves, leases or pins counts.
    Share,
    /// `server.max_streams_per_caller` open at once per (role, uid), and a few opens a second.
    StreamsPerCaller,
    /// `prefetch.max_per_session` in flight per session, `prefetch.max_concurrency` in all.
    Prefetches,
    /// Each message at most `MAX_CHUNK` (4 MiB) and a fixed number in flight.
    Chunks,
    /// One small reply computed from counters.
    Constant,
    /// `sglang_rpc.max_batch` objects per call, `sglang_rpc.memory_bytes` in all.
    SglangBatch,
    /// The caller's own engine memory: pages it registered and copies it asked for.
    EngineWork,
    /// Deposits held for at most 60 s, one per uid, and a budget of descriptors in flight.
    Deposits,
    /// A bounded queue (`queue_batches`) and a rate of replays (`replays_per_s`).
    BridgeQueue,
}

impl Bound {
    /// The bound in words.
    pub fn describe(self) -> &'static str {
        match self {
            Bound::Connections => {
                "[server.connections]: in all (fitted to RLIMIT_NOFILE) and per peer; a \
                 deadline for the first bytes"
            }
            Bound::Batch => "server.max_batch items per call",
            Bound::Session => "one session; l2.max_pools and l2.max_pools_per_tenant",
            Bound::Share => "the tenant's share: reserved, leased and pinned slots all count",
            Bound::StreamsPerCaller => {
                "server.max_streams_per_caller per (role, uid), 4 opens a second"
            }
            Bound::Prefetches => "prefetch.max_per_session, prefetch.max_concurrency",
            Bound::Chunks => "4 MiB chunks",
            Bound::Constant => "a fixed-size reply",
            Bound::SglangBatch => "sglang_rpc.max_batch per call, sglang_rpc.memory_bytes",
            Bound::EngineWork => "the engine's own pool and copies",
            Bound::Deposits => "one deposit per uid, 60 s, an in-flight descriptor budget",
            Bound::BridgeQueue => "queue_batches, replays_per_s",
        }
    }
}

/// One door.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Door {
    /// Whose door it is.
    pub server: Server,
    /// A method's gRPC path (`/kvtier.v1.HostTier/Register`), or a listener's name.
    pub name: &'static str,
    /// What it is.
    pub kind: Kind,
    /// The roles it admits.
    pub admits: Admits,
    /// What bounds one caller's use of it.
    pub bound: Bound,
    /// The source file that serves it.
    pub owner: &'static str,
    /// For a method, the listeners it is served on (none for a listener).
    pub on: &'static [Listener],
}

impl Door {
    /// For a method, its service's short name in snake case (`/kvtier.v1.ObjectStorage/Get`:
    /// `object_storage`), the label its refusals are counted under; a listener's name.
    pub fn service_label(&self) -> String {
        match self
            .name
            .strip_prefix('/')
            .and_then(|p| p.split('/').next())
        {
            Some(service) => snake(service.rsplit('.').next().unwrap_or(service)),
            None => self.name.to_string(),
        }
    }

    /// For a method, its name in snake case (`/kvtier.v1.HostTier/WatchEvents`:
    /// `watch_events`), the label of its stream metrics; a listener's name.
    pub fn method_label(&self) -> String {
        match self
            .name
            .strip_prefix('/')
            .and_then(|p| p.rsplit('/').next())
        {
            Some(method) => snake(method),
            None => self.name.to_string(),
        }
    }
}

/// `CamelCase` as `camel_case`.
fn snake(camel: &str) -> String {
    let mut out = String::new();
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

const HOST: &str = "crates/kvtier-daemon/src/service.rs";
const ADMIN: &str = "crates/kvtier-daemon/src/admin.rs";
const OBJECTS: &str = "crates/kvtier-daemon/src/storage_service.rs";
const SGLANG: &str = "crates/kvtier-daemon/src/sglang/service.rs";
const AGENT: &str = "crates/kvtier-agent/src/service.rs";
const HEALTH: &str =
    "tonic-health (crates/kvtier-daemon/src/parts.rs, crates/kvtier-agent/src/lib.rs)";
const REFLECTION: &str = "tonic-reflection (crates/kvtier-daemon/src/parts.rs)";

const fn rpc(
    on: &'static [Listener],
    name: &'static str,
    kind: Kind,
    admits: Admits,
    bound: Bound,
    owner: &'static str,
) -> Door {
    Door {
        server: on[0].key().0,
        name,
        kind,
        admits,
        bound,
        owner,
        on,
    }
}

const fn listener(
    server: Server,
    name: &'static str,
    admits: Admits,
    bound: Bound,
    owner: &'static str,
) -> Door {
    Door {
        server,
        name,
        kind: Kind::Listener,
        admits,
        bound,
        owner,
        on: &[],
    }
}

/// kvtierd's control plane: the Unix socket and the TCP listener.
const CONTROL: &[Listener] = &[Listener::Control, Listener::ControlTcp];
/// SGLang's socket (through its relay).
const SGLANG_SOCKET: &[Listener] = &[Listener::SglangGrpc];
/// The agent's engine socket.
const ENGINE_SOCKET: &[Listener] = &[Listener::Agent];

use Admits as A;
use Bound as B;
use Kind::{BidiStream, ClientStream, ServerStream, Unary};
use Server::{Agent, Bridge, Kvtierd};

/// Every door. Order: kvtierd's services, then the agent's, then every listener.
#[rustfmt::skip]
pub static DOORS: &[Door] = &[
    // kvtierd: the host tier, for engines and agents (scoped to the caller's tenant).
    rpc(CONTROL, "/kvtier.v1.HostTier/Register", Unary, A::CALLERS, B::Session, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/Heartbeat", Unary, A::CALLERS, B::Session, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/Close", Unary, A::CALLERS, B::Session, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/Lookup", Unary, A::CALLERS, B::Batch, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/Reserve", Unary, A::CALLERS, B::Share, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/Commit", Unary, A::CALLERS, B::Batch, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/Abort", Unary, A::CALLERS, B::Batch, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/CommitLeased", Unary, A::CALLERS, B::Batch, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/Acquire", Unary, A::CALLERS, B::Share, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/Release", Unary, A::CALLERS, B::Batch, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/Stats", Unary, A::CALLERS, B::Constant, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/Prefetch", ServerStream, A::CALLERS, B::Prefetches, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/PrefetchStatus", Unary, A::CALLERS, B::Constant, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/TakePrefetch", Unary, A::CALLERS, B::Share, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/ReleasePrefetch", Unary, A::CALLERS, B::Constant, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/WatchMetrics", ServerStream, A::CALLERS, B::StreamsPerCaller, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/WatchEvents", ServerStream, A::CALLERS, B::StreamsPerCaller, HOST),
    rpc(CONTROL, "/kvtier.v1.HostTier/Locate", Unary, A::CALLERS, B::Batch, HOST),
    // kvtierd: the operator's.
    rpc(CONTROL, "/kvtier.v1.Admin/BackendStatus", Unary, A::OPERATOR, B::Constant, ADMIN),
    rpc(CONTROL, "/kvtier.v1.Admin/AttachBackend", Unary, A::OPERATOR, B::Constant, ADMIN),
    rpc(CONTROL, "/kvtier.v1.Admin/DetachBackend", Unary, A::OPERATOR, B::Constant, ADMIN),
    rpc(CONTROL, "/kvtier.v1.Admin/RunningConfig", Unary, A::OPERATOR, B::Constant, ADMIN),
    rpc(CONTROL, "/kvtier.v1.Admin/Clear", Unary, A::OPERATOR, B::Constant, ADMIN),
    rpc(CONTROL, "/kvtier.v1.Admin/Flush", Unary, A::OPERATOR, B::Constant, ADMIN),
    rpc(CONTROL, "/kvtier.v1.Admin/Drain", Unary, A::OPERATOR, B::Constant, ADMIN),
    // kvtierd: the storage tier peers use (`l3.backend = "remote"`).
    rpc(CONTROL, "/kvtier.v1.ObjectStorage/Get", ServerStream, A::STORAGE, B::Chunks, OBJECTS),
    rpc(CONTROL, "/kvtier.v1.ObjectStorage/Set", ClientStream, A::STORAGE, B::Chunks, OBJECTS),
    rpc(CONTROL, "/kvtier.v1.ObjectStorage/Exists", Unary, A::STORAGE, B::Batch, OBJECTS),
    rpc(CONTROL, "/kvtier.v1.ObjectStorage/Delete", Unary, A::STORAGE, B::Batch, OBJECTS),
    // kvtierd: SGLang's HiCache RPC storage protocol, on its own socket.
    rpc(SGLANG_SOCKET, "/sglang.runtime.hicache.StorageServer/Exist", Unary, A::ENGINES, B::SglangBatch, SGLANG),
    rpc(SGLANG_SOCKET, "/sglang.runtime.hicache.StorageServer/BatchPut", Unary, A::ENGINES, B::SglangBatch, SGLANG),
    rpc(SGLANG_SOCKET, "/sglang.runtime.hicache.StorageServer/BatchGet", Unary, A::ENGINES, B::SglangBatch, SGLANG),
    // kvtierd: probes and introspection.
    rpc(CONTROL, "/grpc.health.v1.Health/Check", Unary, A::ANYONE, B::Constant, HEALTH),
    rpc(CONTROL, "/grpc.health.v1.Health/Watch", ServerStream, A::ANYONE, B::Connections, HEALTH),
    rpc(CONTROL, "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", BidiStream, A::CALLERS, B::Connections, REFLECTION),
    // kvtier-agent: its one engine (every peer [server.unix] admits).
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/RegisterPool", Unary, A::ENGINES, B::EngineWork, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/Match", Unary, A::ENGINES, B::Batch, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/MatchBatch", Unary, A::ENGINES, B::Batch, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/LoadBack", Unary, A::ENGINES, B::EngineWork, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/Prefetch", ServerStream, A::ENGINES, B::Prefetches, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/Insert", Unary, A::ENGINES, B::EngineWork, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/InsertBatch", Unary, A::ENGINES, B::Batch, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/Release", Unary, A::ENGINES, B::EngineWork, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/ReleaseBatch", Unary, A::ENGINES, B::Batch, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/Evict", Unary, A::ENGINES, B::EngineWork, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/AgentStats", Unary, A::ENGINES, B::Constant, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/Lookup", Unary, A::ENGINES, B::Batch, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/Load", Unary, A::ENGINES, B::EngineWork, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/Save", Unary, A::ENGINES, B::EngineWork, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/SaveBatch", Unary, A::ENGINES, B::Batch, AGENT),
    rpc(ENGINE_SOCKET, "/kvtier.v1.Agent/Cancel", Unary, A::ENGINES, B::Constant, AGENT),
    rpc(ENGINE_SOCKET, "/grpc.health.v1.Health/Check", Unary, A::ANYONE, B::Constant, HEALTH),
    rpc(ENGINE_SOCKET, "/grpc.health.v1.Health/Watch", ServerStream, A::ANYONE, B::Connections, HEALTH),
    // Listeners. Who may connect; what each admits past that is the rows above.
    listener(Kvtierd, "control", A::CALLERS, B::Connections, "crates/kvtier-daemon/src/parts.rs"),
    listener(Kvtierd, "control_tcp", A::ANYONE, B::Connections, "crates/kvtier-daemon/src/parts.rs"),
    listener(Kvtierd, "pool_door", A::ENGINES, B::Connections, "crates/kvtier-daemon/src/pool_door.rs"),
    listener(Kvtierd, "sglang_mempool", A::ENGINES, B::Connections, "crates/kvtier-daemon/src/sglang/mod.rs"),
    listener(Kvtierd, "sglang_grpc", A::ENGINES, B::Connections, "crates/kvtier-daemon/src/sglang/authority.rs"),
    listener(Kvtierd, "metrics", A::ANYONE, B::Connections, "crates/kvtier-server/src/prometheus_http.rs"),
    listener(Agent, "agent", A::ENGINES, B::Connections, "crates/kvtier-agent/src/lib.rs"),
    listener(Agent, "memory_door", A::ENGINES, B::Deposits, "crates/kvtier-agent/src/memory_door.rs"),
    listener(Agent, "metrics", A::ANYONE, B::Connections, "crates/kvtier-server/src/prometheus_http.rs"),
    listener(Bridge, "kv_events", A::CALLERS, B::BridgeQueue, "python/kvtier/vllm/kv_events.py"),
];

/// The row of method `path` on `server`, if it has one.
pub fn method(server: Server, path: &str) -> Option<&'static Door> {
    DOORS
        .iter()
        .find(|d| d.server == server && d.kind != Kind::Listener && d.name == path)
}

/// The row of method `path` where it is served on `listener`, if it is.
pub fn method_on(listener: Listener, path: &str) -> Option<&'static Door> {
    DOORS
        .iter()
        .find(|d| d.name == path && d.on.contains(&listener))
}

/// `server`'s methods whose streams are held to [`Bound::StreamsPerCaller`].
pub fn capped_streams(server: Server) -> impl Iterator<Item = &'static Door> {
    DOORS
        .iter()
        .filter(move |d| d.server == server && d.bound == Bound::StreamsPerCaller)
}

/// A socket a process listens on; each has a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Listener {
    /// kvtierd's control socket (gRPC).
    Control,
    /// kvtierd's TCP listener (gRPC, `server.tcp`).
    ControlTcp,
    /// kvtierd's pool door: pools handed out as descriptors.
    PoolDoor,
    /// kvtierd's SGLang memory-pool registration socket.
    SglangMempool,
    /// kvtierd's SGLang gRPC socket (through the relay).
    SglangGrpc,
    /// kvtierd's `/metrics`.
    Metrics,
    /// kvtier-agent's engine socket (gRPC).
    Agent,
    /// kvtier-agent's memory door: engine memory deposited as descriptors.
    MemoryDoor,
    /// kvtier-agent's `/metrics`.
    AgentMetrics,
}

impl Listener {
    /// Every listener of kvtierd and kvtier-agent.
    pub const ALL: [Listener; 9] = [
        Listener::Control,
        Listener::ControlTcp,
        Listener::PoolDoor,
        Listener::SglangMempool,
        Listener::SglangGrpc,
        Listener::Metrics,
        Listener::Agent,
        Listener::MemoryDoor,
        Listener::AgentMetrics,
    ];

    /// Its place in [`Listener::ALL`] (a new listener must take one: the match is total).
    pub const fn index(self) -> usize {
        match self {
            Listener::Control => 0,
            Listener::ControlTcp => 1,
            Listener::PoolDoor => 2,
            Listener::SglangMempool => 3,
            Listener::SglangGrpc => 4,
            Listener::Metrics => 5,
            Listener::Agent => 6,
            Listener::MemoryDoor => 7,
            Listener::AgentMetrics => 8,
        }
    }

    /// Its process and name: its row's key.
    pub const fn key(self) -> (Server, &'static str) {
        match self {
            Listener::Control => (Kvtierd, "control"),
            Listener::ControlTcp => (Kvtierd, "control_tcp"),
            Listener::PoolDoor => (Kvtierd, "pool_door"),
            Listener::SglangMempool => (Kvtierd, "sglang_mempool"),
            Listener::SglangGrpc => (Kvtierd, "sglang_grpc"),
            Listener::Metrics => (Kvtierd, "metrics"),
            Listener::Agent => (Agent, "agent"),
            Listener::MemoryDoor => (Agent, "memory_door"),
            Listener::AgentMetrics => (Agent, "metrics"),
        }
    }

    /// Its name in logs and in the `socket` label of the connection metrics.
    pub const fn name(self) -> &'static str {
        self.key().1
    }

    /// Its row. Every listener has one (a test checks); a missing one stops the process at
    /// bind time, before it serves anything.
    #[allow(clippy::expect_used)]
    pub fn door(self) -> &'static Door {
        let (server, name) = self.key();
        DOORS
            .iter()
            .find(|d| d.server == server && d.kind == Kind::Listener && d.name == name)
            .expect("every listener has a row in doors::DOORS")
    }
}

/// The table as docs/SECURITY.md shows it: one row per door, a column per role.
pub fn render_markdown() -> String {
    let mut out = String::from("| process | door | kind | on |");
    for w in Who::ALL {
        let _ = write!(out, " {} |", w.column());
    }
    out.push_str(" bound | owner |\n|---|---|---|---|");
    for _ in Who::ALL {
        out.push_str("---|");
    }
    out.push_str("---|---|\n");
    for d in DOORS {
        let on: Vec<&str> = d.on.iter().map(|l| l.name()).collect();
        let _ = write!(
            out,
            "| {} | `{}` | {} | {} |",
            d.server.name(),
            d.name,
            d.kind.describe(),
            on.join(", ")
        );
        for w in Who::ALL {
            let _ = write!(out, " {} |", d.admits.cell(w));
        }
        let _ = writeln!(out, " {} | `{}` |", d.bound.describe(), d.owner);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn every_listener_has_one_row_and_every_listener_row_a_listener() {
        for (i, l) in Listener::ALL.iter().enumerate() {
            assert_eq!(l.index(), i, "{l:?} is out of place in Listener::ALL");
            assert_eq!(l.door().name, l.name());
        }
        let named: HashSet<_> = Listener::ALL.iter().map(|l| l.key()).collect();
        for d in DOORS.iter().filter(|d| d.kind == Kind::Listener) {
            assert!(
                d.server == Server::Bridge || named.contains(&(d.server, d.name)),
                "the row of listener {} of {} has no Listener",
                d.name,
                d.server.name()
            );
        }
    }

    #[test]
    fn rows_are_unique_and_methods_are_grpc_paths() {
        let mut seen = HashSet::new();
        for d in DOORS {
            assert!(
                seen.insert((d.server, d.kind == Kind::Listener, d.name)),
                "two rows for {} of {}",
                d.name,
                d.server.name()
            );
            if d.kind != Kind::Listener {
                let parts: Vec<_> = d.name.split('/').collect();
                assert!(
                    parts.len() == 3 && parts[0].is_empty() && parts[1].contains('.'),
                    "{} is not /package.Service/Method",
                    d.name
                );
            }
        }
    }

    #[test]
    fn admits_by_role_and_trust_domain() {
        use Who::*;
        let all = |a: Admits, one: bool| -> Vec<Who> {
            Who::ALL.into_iter().filter(|w| a.admits(*w, one)).collect()
        };
        assert_eq!(all(Admits::OPERATOR, true), [Operator]);
        assert_eq!(all(Admits::STORAGE, false), [Operator, Peer]);
        assert_eq!(all(Admits::STORAGE, true), [Operator, Peer, DefaultTenant]);
        assert_eq!(
            all(Admits::CALLERS, false),
            [Operator, Peer, Tenant, DefaultTenant]
        );
        assert_eq!(
            all(Admits::ENGINES, false),
            [Operator, Tenant, DefaultTenant]
        );
        assert_eq!(all(Admits::ANYONE, false), Who::ALL);
        let admin = method(Server::Kvtierd, "/kvtier.v1.Admin/Drain").unwrap();
        assert_eq!(admin.service_label(), "admin");
        let get = method(Server::Kvtierd, "/kvtier.v1.ObjectStorage/Get").unwrap();
        assert_eq!(get.service_label(), "object_storage");
        assert_eq!(get.method_label(), "get");
        let streams: Vec<_> = capped_streams(Server::Kvtierd)
            .map(|d| d.method_label())
            .collect();
        assert_eq!(streams, ["watch_metrics", "watch_events"]);
        assert!(method(Server::Agent, "/kvtier.v1.Admin/Drain").is_none());
        assert!(method(Server::Kvtierd, "/kvtier.v1.Admin/Nope").is_none());
        assert!(method_on(Listener::SglangGrpc, "/kvtier.v1.Admin/Drain").is_none());
        assert!(method_on(Listener::ControlTcp, "/kvtier.v1.Admin/Drain").is_some());
    }

    #[test]
    fn docs_security_md_shows_this_table() {
        let doc = include_str!("../../../docs/SECURITY.md");
        let shown = doc
            .split_once("<!-- doors:begin -->\n")
            .and_then(|(_, rest)| rest.split_once("<!-- doors:end -->"))
            .map(|(table, _)| table)
            .expect("docs/SECURITY.md has the doors table between its markers");
        let table = render_markdown();
        if shown != table {
            let _ = std::fs::write(std::env::temp_dir().join("kvtier-doors-table.md"), &table);
        }
        assert!(
            shown == table,
            "docs/SECURITY.md's doors table is not the table in doors.rs; the rendered one is \
             in $TMPDIR/kvtier-doors-table.md"
        );
    }

    #[test]
    fn the_rendered_table_has_a_line_per_door() {
        let t = render_markdown();
        assert_eq!(t.lines().count(), DOORS.len() + 2);
        assert!(t.contains(
            "| kvtierd | `/kvtier.v1.Admin/Clear` | unary | control, control_tcp | yes | no | no | no | no |"
        ));
    }
}
