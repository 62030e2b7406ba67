//! The pool door: where a registered client receives its L2 pool, as a file descriptor
//! (`SCM_RIGHTS`) on a Unix socket of its own (`server.pool_socket`), never as a path to
//! open. The pool files live in kvtierd's own directory (`state::pool_dir`), which no one
//! else can open, so holding the descriptor is what lets a process map a pool.
//!
//! A connection asks once, naming its session (the id `Register` answered: the session's
//! secret) and presenting the bearer token it registered with, if any, and gets that
//! session's pool if its peer may: the socket's allow-lists ([`GatedListener`], the control
//! socket's, with its connection caps), then the caller's role from its credentials and token
//! ([`Roles::resolve`], as for gRPC calls: the operator, or the tenant the session was bound
//! to; a session id that leaked to another tenant's process opens nothing). A request not complete within the handshake timeout is
//! dropped. The wire is `kvtier_shm::door`. Answers are counted in
//! `kvtier_pool_door_answers_total{outcome}`.

use std::os::fd::AsFd;
use std::sync::Arc;

use kvtier_core::SessionId;
use kvtier_server::metrics::MetricRegistry;
use kvtier_server::peers::GatedListener;
use kvtier_shm::door::{self, Answer};
use tokio::io::Interest;
use tokio::net::UnixStream;

use crate::roles::{Role, Roles, UnixPeer};
use crate::state::Shared;
use kvtier_server::tasks::Tasks;

/// The door's counters.
#[derive(Clone, Debug)]
pub(crate) struct DoorMetrics {
    answers: prometheus::IntCounterVec,
}

impl DoorMetrics {
    /// Declares `kvtier_pool_door_answers_total` in `metrics`.
    pub(crate) fn new(metrics: &MetricRegistry) -> prometheus::Result<Self> {
        let answers = metrics.counter_vec(
            "kvtier_pool_door_answers_total",
            "pool door requests, by outcome: granted (the pool's descriptor sent), unknown_session, other_tenant (the session is another tenant's), malformed, timeout, shutdown (kvtierd stopped first), failed (the answer could not be sent)",
            &["outcome"],
        )?;
        for o in [
            "granted",
            "unknown_session",
            "other_tenant",
            "malformed",
            "timeout",
            "shutdown",
            "failed",
        ] {
            answers.with_label_values(&[o]);
        }
        Ok(Self { answers })
    }
}

/// Serves the door on `listener` until `stop`.
pub(crate) async fn serve(
    listener: GatedListener,
    state: Arc<Shared>,
    roles: Arc<Roles>,
    metrics: DoorMetrics,
    tasks: Tasks,
) {
    let stop = tasks.shutdown.clone();
    let timeout = listener.cap().handshake_timeout();
    loop {
        let (stream, permit) = tokio::select! {
            c = listener.accept() => c,
            () = stop.cancelled() => return,
        };
        let (state, roles, metrics) = (state.clone(), roles.clone(), metrics.clone());
        let stop = stop.clone();
        tasks.spawn(async move {
            // A caller that says nothing is cut off at the handshake deadline, or at once
            // when kvtierd stops (the drain waits for this task).
            let outcome = tokio::select! {
                r = tokio::time::timeout(timeout, answer(&stream, &state, &roles)) => {
                    r.unwrap_or("timeout")
                }
                () = stop.cancelled() => "shutdown",
            };
            metrics.answers.with_label_values(&[outcome]).inc();
            drop(permit);
        });
    }
}

/// Reads one request on `stream` and answers it; returns the outcome's label.
async fn answer(stream: &UnixStream, state: &Shared, roles: &Roles) -> &'static str {
    let mut head = [0u8; door::REQUEST_HEAD];
    if read_exact(stream, &mut head).await.is_err() {
        return "malformed";
    }
    let (n, t) = match door::request_lens(&head) {
        Ok(lens) => lens,
        Err(why) => return send(stream, Answer::Refused(why), None, "malformed").await,
    };
    let mut body = vec![0u8; n + t];
    if read_exact(stream, &mut body).await.is_err() {
        return "malformed";
    }
    let (id, token) = body.split_at(n);
    let Ok(token) = std::str::from_utf8(token) else {
        let why = "the token is not UTF-8".to_string();
        return send(stream, Answer::Refused(why), None, "malformed").await;
    };
    let Ok(id) = SessionId::from_bytes(id) else {
        let why = "the session id is malformed".to_string();
        return send(stream, Answer::Refused(why), None, "malformed").await;
    };
    // Its peer's credentials decide, as for a gRPC call on the control socket; and a token
    // it presents counts as well, for the role that token gives (a process that registered
    // over TCP by its token, say).
    let role = match stream.peer_cred() {
        Ok(c) => roles.resolve(
            Some(UnixPeer {
                uid: c.uid(),
                gid: c.gid(),
            }),
            (!token.is_empty()).then_some(token),
        ),
        Err(_) => return "failed",
    };
    let by_token = (!token.is_empty()).then(|| roles.of_token(token)).flatten();
    let found = {
        let mut st = state.lock();
        // A pool a client shrank or grew is retired before anyone maps it again: its
        // sessions end, and the caller is told to register again (into a new pool).
        if st
            .mapped_pool(id)
            .is_ok_and(|(pool, _)| !pool.file_intact())
        {
            st.retire_damaged_pools();
        }
        st.mapped_pool(id)
            .map(|(pool, tenant)| (pool, tenant.to_string()))
    };
    match found {
        Err(e) => {
            send(
                stream,
                Answer::Refused(e.to_string()),
                None,
                "unknown_session",
            )
            .await
        }
        Ok((_, tenant)) if !admits(&role, by_token.as_ref(), &tenant) => {
            tracing::warn!(?role, session = %id, "pool door: refused another tenant's session");
            let why = format!(
                "this caller is {}, and the session is another tenant's",
                role.describe()
            );
            send(stream, Answer::Refused(why), None, "other_tenant").await
        }
        Ok((pool, _)) => {
            let a = Answer::Pool {
                slots: pool.slots(),
                stride: pool.stride() as u64,
            };
            send(stream, a, Some(&pool), "granted").await
        }
    }
}

/// Whether a caller whose credentials give `role`, and whose token (if it presented a known
/// one) gives `by_token`, may map the pool of a session bound to `tenant`.
fn admits(role: &Role, by_token: Option<&Role>, tenant: &str) -> bool {
    may_map(role, tenant) || by_token.is_some_and(|r| may_map(r, tenant))
}

/// Whether a caller of `role` may map the pool of a session bound to `tenant`.
fn may_map(role: &Role, tenant: &str) -> bool {
    match role {
        Role::Operator => true,
        Role::Tenant(t) => t == tenant,
        Role::Peer => false,
    }
}

async fn read_exact(s: &UnixStream, buf: &mut [u8]) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        s.readable().await?;
        match s.try_read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn send(
    stream: &UnixStream,
    answer: Answer,
    pool: Option<&kvtier_shm::ShmPool>,
    outcome: &'static str,
) -> &'static str {
    let sent = stream
        .async_io(Interest::WRITABLE, || {
            door::send(stream.as_fd(), &answer, pool.map(|p| p.fd()))
        })
        .await;
    match sent {
        Ok(()) => outcome,
        Err(e) => {
            tracing::debug!("pool door: answer not sent: {e}");
            "failed"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_maps_for_its_tenant_and_the_operator_alone() {
        let op = Role::Operator;
        let acme = Role::Tenant("acme".into());
        let default = Role::Tenant(String::new());
        assert!(may_map(&op, "acme") && may_map(&op, ""));
        assert!(may_map(&acme, "acme") && !may_map(&acme, ""));
        assert!(may_map(&default, "") && !may_map(&default, "acme"));
        assert!(!may_map(&Role::Peer, ""));
        // A process of tenant "local" by its gid that registered over TCP as acme, by acme's
        // token, presents it: admitted to acme's session, not to another's.
        let local = Role::Tenant("local".into());
        assert!(admits(&local, Some(&acme), "acme"));
        assert!(!admits(&local, Some(&acme), "globex"));
        assert!(!admits(&local, None, "acme"));
        assert!(!admits(&local, Some(&Role::Peer), "acme"));
    }
}
