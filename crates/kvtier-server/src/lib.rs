//! kvtier-server: what kvtierd and kvtier-agent share to run as processes.
//!
//! - [`process`]: the command line both binaries take (`--config`, `--set`,
//!   `--print-default-config`, `--check-config`) and the `main` flow around a server's `run`
//!   (load and validate the configuration, start logging, a runtime, stop on SIGTERM/SIGINT),
//!   and the one ready line scripts and tests wait for;
//! - [`serving`]: binding a Unix socket without taking over a live one, the shutdown token,
//!   logging from `log.level`;
//! - [`metrics`]: the registry each component declares its own series in, with scrape
//!   hooks and the check that keeps docs/metrics.md true;
//! - [`prometheus_http`]: the `/metrics` endpoint, and binding its listener;
//! - [`malformed`]: requests that do not decode get `InvalidArgument`, not `Internal`;
//! - [`peers`]: who may use a Unix socket: its file mode and owner, and the peer-credential
//!   allow-list checked on every connection (`[server.unix]`);
//! - [`doors`]: every door of kvtierd and kvtier-agent (method, stream, listener) as data:
//!   the roles it admits, its bound and its owner; [`guard`]: the layer on every gRPC
//!   server that enforces it;
//! - [`conn`]: how many connections a listener holds, how long a new one has to start, and
//!   accept loops that wait out descriptor exhaustion (`[server.connections]`).
//!
//! kvtier-client stays a client library; server plumbing goes here.

pub mod conn;
pub mod doors;
pub mod guard;
pub mod malformed;
pub mod metrics;
pub mod peers;
pub mod process;
pub mod prometheus_http;
pub mod serving;
pub mod tasks;
