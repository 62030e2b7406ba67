//! The agent's doors (`kvtier_server::doors`, the rows served on its engine socket): each is
//! served to its engine, a method with no row there (kvtierd's, or one that does not exist)
//! is refused by the guard before any service sees it, and its refusals are counted.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use bytes::Bytes;
use common::*;
use kvtier_client::raw::{self, Shape};
use kvtier_server::doors::{DOORS, Kind, Listener};

/// Not a test: the entry point of the kvtierd child processes the tests start.
#[test]
#[ignore = "entry point of test daemons"]
fn daemon_entry() {
    assert!(daemon_child(), "run by the tests, not by hand");
}

#[test]
fn every_row_on_the_engine_socket_is_served_and_nothing_else_is() {
    let dir = dir("doors");
    let _d = daemon(&dir, &["l2.pool_pages=16"]);
    let a = agent(&dir, "doors", &[]);
    let socket = a.socket.display().to_string();
    rt().block_on(async {
        let rows: Vec<_> = DOORS
            .iter()
            .filter(|d| d.on.contains(&Listener::Agent))
            .collect();
        assert!(rows.len() > 10, "the agent's rows: {}", rows.len());
        for d in rows {
            let shape = match d.kind {
                Kind::Unary => Shape::Unary,
                Kind::ServerStream => Shape::ServerStream,
                other => panic!("{}: the agent serves no {other:?}", d.name),
            };
            let ch = kvtier_client::connect(&socket).await.unwrap();
            let call = raw::call(ch, d.name, shape, vec![Bytes::new()], 1);
            // A stream still open after a second passed the guard (its refusals are
            // immediate).
            if let Ok(Err(s)) = tokio::time::timeout(std::time::Duration::from_secs(1), call).await
            {
                assert!(
                    !s.message().contains("is not for it")
                        && !s.message().contains("serves no method"),
                    "{}: refused by the guard: {s:?}",
                    d.name
                );
            }
        }
        for path in [
            "/kvtier.v1.HostTier/Register",
            "/kvtier.v1.Admin/Drain",
            "/kvtier.v1.Agent/Format",
        ] {
            let ch = kvtier_client::connect(&socket).await.unwrap();
            let s = raw::call(ch, path, Shape::Unary, vec![Bytes::new()], 1)
                .await
                .unwrap_err();
            assert_eq!(s.code(), tonic::Code::Unimplemented, "{path}: {s:?}");
            assert!(s.message().contains("serves no method"), "{path}: {s:?}");
        }
    });
    // The agent declares the guard's counters too.
    let page = a.metrics_page();
    assert_eq!(
        metric(
            &page,
            "kvtier_server_forbidden_calls_total{service=\"agent\"}"
        ),
        0.0
    );
}
