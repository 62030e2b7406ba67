//! Tenants' pages are apart in shared memory too (`l2.tenant_pools`, issue 39 item 4): in the
//! documented group deployment (the sockets and default pools 0660 for one group every
//! engine is in), each named tenant gets its own pool file that only its uids may open. Real
//! processes of two uids (via `setpriv`) in the same group, and a real kvtierd.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kvtier_client::{HostClient, Reserved};

/// The group every engine is in (the socket's group).
const ENGINES: u32 = 4242;
const ACME: u32 = 65534;
const GLOBEX: u32 = 65533;

/// The children: "acme" writes one page into its pool; "globex" tries to open acme's pool
/// file (`KVT_CHILD_PATH`) read-write, then registers for its own.
#[test]
#[ignore = "run by the tests below as other uids"]
fn child_entry() {
    let (Ok(role), Ok(socket)) = (
        std::env::var("KVT_CHILD_ROLE"),
        std::env::var("KVT_CHILD_SOCKET"),
    ) else {
        return;
    };
    let opened = std::env::var("KVT_CHILD_PATH").map(|p| {
        match std::fs::OpenOptions::new().read(true).write(true).open(&p) {
            Ok(_) => "OPENED".to_string(),
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => "EACCES".to_string(),
            Err(e) => format!("{e}"),
        }
    });
    rt().block_on(async move {
        let mut c = HostClient::connect(&socket).await.unwrap();
        let s = c.register(&role, &layout("shared-model")).await.unwrap();
        let keys = chain(7, 1);
        let r = c.reserve(s.id, None, &keys).await.unwrap();
        let Reserved::Slot(slot) = r[0] else {
            panic!("no slot: {r:?}")
        };
        let bytes = page_bytes(&keys[0], s.layout.page_bytes());
        s.pool.write(slot, 0, &bytes).unwrap();
        c.commit(s.id, &keys).await.unwrap();
        println!(
            "RESULT path={} other={}",
            s.pool_path.display(),
            opened.unwrap_or_default()
        );
    });
}

/// Acme writes a page, then globex tries acme's pool file and registers; their outputs.
fn two_tenants(socket: &str) -> (String, String) {
    let acme = as_user(
        ACME,
        &[ENGINES],
        &[("KVT_CHILD_ROLE", "acme"), ("KVT_CHILD_SOCKET", socket)],
    );
    let globex = as_user(
        GLOBEX,
        &[ENGINES],
        &[
            ("KVT_CHILD_ROLE", "globex"),
            ("KVT_CHILD_SOCKET", socket),
            ("KVT_CHILD_PATH", field(&acme, "path=")),
        ],
    );
    (acme, globex)
}

fn field<'a>(out: &'a str, name: &str) -> &'a str {
    out.split_whitespace()
        .find_map(|f| f.strip_prefix(name))
        .unwrap_or_default()
}

#[test]
fn a_tenant_in_the_engines_group_cannot_open_another_tenants_pool() {
    if !is_root() {
        eprintln!("skipped: engines of other uids need root");
        return;
    }
    let dir =
        std::env::temp_dir().join(format!("kvtierd-test-{}-tenant-pools", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("kvtierd.toml"),
        format!("[tenants.acme]\nuids = [{ACME}]\n\n[tenants.globex]\nuids = [{GLOBEX}]\n"),
    )
    .unwrap();
    let gid = format!("server.unix.gid={ENGINES}");
    let allow = format!("server.unix.allow_gids={ENGINES}");
    let group = ["l2.pool_pages=16", "server.unix.mode=0660", &gid, &allow];
    // With one pool per layout (l2.tenant_pools = false), as before: globex, in the group,
    // opens acme's pool read-write.
    let shared = Daemon::start_in(
        dir.clone(),
        &[&group[..], &["l2.tenant_pools=false"]].concat(),
    );
    let (a, g) = two_tenants(&shared.target());
    assert_eq!(field(&g, "other="), "OPENED", "{g}");
    assert_eq!(field(&g, "path="), field(&a, "path="));
    let dir = shared.stop_keeping_dir();

    let d = Daemon::start_in(dir, &group);
    let socket = d.target();
    // Globex is in the same group, and the same layout: it gets a pool of its own, and
    // acme's file stays shut to it.
    let (acme, globex) = two_tenants(&socket);
    let acme_pool = field(&acme, "path=").to_string();
    assert_eq!(field(&globex, "other="), "EACCES", "{globex}");
    assert_ne!(field(&globex, "path="), acme_pool);
    // The default tenant's pool is yet another, shared with the group as before.
    rt().block_on(async {
        let mut c = HostClient::connect(&socket).await.unwrap();
        let s = c
            .register("operator", &layout("shared-model"))
            .await
            .unwrap();
        assert_ne!(s.pool_path.display().to_string(), acme_pool);
        assert_eq!(c.stats().await.unwrap().pools.len(), 3);
    });
}
