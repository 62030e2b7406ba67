//! Tenants' pages are apart in shared memory too (`l2.tenant_pools`, issue 39 item 4; issue
//! 62: descriptors, not paths). In the documented group deployment (the sockets 0660 for one
//! group every engine is in), each named tenant gets its own pool, and a process holds a
//! pool only if the pool door handed it the descriptor: no pool file can be opened by path
//! (they live in kvtierd's own 0700 directory), and the door hands a session's pool only to
//! a peer of the session's tenant, whatever groups it is in and whatever session id it
//! learned. Real processes of two uids (via `setpriv`) in the same group, and a real kvtierd.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kvtier_client::{HostClient, Reserved};

/// The group every engine is in (the socket's group).
const ENGINES: u32 = 4242;
const ACME: u32 = 65534;
const GLOBEX: u32 = 65533;
/// Acme's group, by which `[tenants.acme]` also names its engines: the ACL of old granted it
/// the pool, and the kernel applied that to supplementary groups too.
const ACME_GID: u32 = 4343;

/// The children: "acme" writes one page into its pool; "globex" tries to open acme's pool
/// file (`KVT_CHILD_PATH`) read-write and to get its descriptor from the pool door with
/// acme's session id (`KVT_CHILD_SESSION`, as if it had leaked), then registers for its own.
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
    let door = std::env::var("KVT_CHILD_SESSION").map(|id| {
        let id: Vec<u8> = (0..id.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&id[i..i + 2], 16).unwrap())
            .collect();
        let at = std::path::PathBuf::from(format!("{socket}.pools"));
        match kvtier_shm::door::fetch(&at, &id, None, std::time::Duration::from_secs(5)) {
            Ok(_) => "GRANTED".to_string(),
            Err(e) if e.to_string().contains("another tenant's") => "REFUSED".to_string(),
            Err(e) => format!("{e}").replace(' ', "_"),
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
        let id: String = s.id.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
        println!(
            "RESULT path={} session={id} other={} door={}",
            s.pool_path.display(),
            opened.unwrap_or_default(),
            door.unwrap_or_default()
        );
    });
}

/// Acme writes a page, then globex (in the engines' group and in acme's) tries acme's pool
/// file and acme's session at the door, and registers; their outputs.
fn two_tenants(socket: &str) -> (String, String) {
    let acme = as_user(
        ACME,
        &[ENGINES],
        &[("KVT_CHILD_ROLE", "acme"), ("KVT_CHILD_SOCKET", socket)],
    );
    let globex = as_user(
        GLOBEX,
        &[ENGINES, ACME_GID],
        &[
            ("KVT_CHILD_ROLE", "globex"),
            ("KVT_CHILD_SOCKET", socket),
            ("KVT_CHILD_PATH", field(&acme, "path=")),
            ("KVT_CHILD_SESSION", field(&acme, "session=")),
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
fn a_tenant_in_the_engines_group_and_in_anothers_cannot_map_that_tenants_pool() {
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
        format!(
            "[tenants.acme]\nuids = [{ACME}]\ngids = [{ACME_GID}]\n\n\
             [tenants.globex]\nuids = [{GLOBEX}]\n"
        ),
    )
    .unwrap();
    let gid = format!("server.unix.gid={ENGINES}");
    let allow = format!("server.unix.allow_gids={ENGINES}");
    let group = ["l2.pool_pages=16", "server.unix.mode=0660", &gid, &allow];
    // One pool per layout (l2.tenant_pools = false): both tenants' sessions map the same
    // pool, each from its own descriptor; neither can open the file by path, and globex
    // cannot have acme's session's descriptor.
    let shared = Daemon::start_in(
        dir.clone(),
        &[&group[..], &["l2.tenant_pools=false"]].concat(),
    );
    let (a, g) = two_tenants(&shared.target());
    assert_eq!(field(&g, "other="), "EACCES", "{g}");
    assert_eq!(field(&g, "door="), "REFUSED", "{g}");
    assert_eq!(field(&g, "path="), field(&a, "path="));
    let dir = shared.stop_keeping_dir();

    let d = Daemon::start_in(dir, &group);
    let socket = d.target();
    // Globex is in the same group, in acme's group too, and has the same layout: it gets a
    // pool of its own, acme's file stays shut to it (no ACL, no group rule), and the door
    // refuses it acme's session.
    let (acme, globex) = two_tenants(&socket);
    let acme_pool = field(&acme, "path=").to_string();
    assert_eq!(field(&globex, "other="), "EACCES", "{globex}");
    assert_eq!(field(&globex, "door="), "REFUSED", "{globex}");
    assert_ne!(field(&globex, "path="), acme_pool);
    // The default tenant's pool is yet another.
    rt().block_on(async {
        let mut c = HostClient::connect(&socket).await.unwrap();
        let s = c
            .register("operator", &layout("shared-model"))
            .await
            .unwrap();
        assert_ne!(s.pool_path.display().to_string(), acme_pool);
        assert_eq!(c.stats().await.unwrap().pools.len(), 3);
    });
    assert!(
        metric(
            &d.metrics(),
            "kvtier_pool_door_answers_total{outcome=\"other_tenant\"}"
        ) >= 1.0
    );
}
