//! The memory door with real processes of two uids (through `setpriv`, so the test needs
//! root; it says so and passes without): an engine's descriptors are the depositor's alone.
//! A ticket that leaked to another admitted uid registers nothing, and a uid the engine
//! socket does not admit cannot deposit at all.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::fd::AsFd;
use std::process::Command;
use std::time::Duration;

use common::*;
use kvtier_proto::v1;

const OTHER: u32 = 65534;

/// Not a test: the entry point of the kvtierd child processes the tests start.
#[test]
#[ignore = "entry point of test daemons"]
fn daemon_entry() {
    assert!(daemon_child(), "run by the tests, not by hand");
}

/// The child, as another uid: deposits a memfd at the door (`KVT_CHILD_DOOR`) and prints
/// the ticket, or why it was refused.
#[test]
#[ignore = "run by the test below as another uid"]
fn child_entry() {
    let Ok(door) = std::env::var("KVT_CHILD_DOOR") else {
        return;
    };
    let region = kvtier_shm::ShmRegion::memfd("child", 1 << 20).unwrap();
    match kvtier_shm::memory_door::deposit(
        std::path::Path::new(&door),
        &[region.fd().as_fd()],
        Duration::from_secs(5),
    ) {
        Ok(t) => println!(
            "TICKET {}",
            t.iter().map(|b| format!("{b:02x}")).collect::<String>()
        ),
        Err(e) => println!("REFUSED {e}"),
    }
}

fn as_other(door: &std::path::Path) -> String {
    let out = Command::new("setpriv")
        .args([
            &format!("--reuid={OTHER}"),
            &format!("--regid={OTHER}"),
            "--clear-groups",
        ])
        .arg(std::env::current_exe().unwrap())
        .args(["child_entry", "--exact", "--ignored", "--nocapture"])
        .env("KVT_CHILD_DOOR", door)
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout).to_string();
    s.lines()
        .find(|l| l.starts_with("TICKET") || l.starts_with("REFUSED"))
        .unwrap_or_else(|| {
            panic!(
                "the child said nothing: {s} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
        .to_string()
}

#[test]
fn a_deposit_is_its_uids_alone_and_the_door_admits_whom_the_socket_admits() {
    if rustix::process::geteuid().as_raw() != 0 {
        eprintln!("skipped: needs root to run a process as another uid (setpriv)");
        return;
    }
    let d = dir("mdoor-uids");
    // The directory must let the other uid reach the sockets.
    std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let _kvtierd = daemon(&d, &["l2.pool_pages=64"]);
    rt().block_on(async {
        // First an agent that admits only its own uid: the other uid's deposit is closed at
        // the door (the engine socket's allow-lists), and nothing waits.
        let a = agent(&d, "closed", &["server.unix.mode=0666"]);
        let door = std::path::PathBuf::from(format!("{}.memory", a.socket.display()));
        let said = as_other(&door);
        assert!(said.starts_with("REFUSED"), "{said}");
        drop(a);

        // Now one that admits the other uid too: it deposits, and its ticket does not
        // register for this process (uid 0), which it could have leaked to.
        let a = agent(
            &d,
            "open",
            &[
                "server.unix.mode=0666",
                &format!("server.unix.allow_uids={OTHER}"),
            ],
        );
        let door = std::path::PathBuf::from(format!("{}.memory", a.socket.display()));
        let said = as_other(&door);
        let hex = said
            .strip_prefix("TICKET ")
            .unwrap_or_else(|| panic!("{said}"));
        let ticket: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let ch = kvtier_client::connect(&a.socket.display().to_string())
            .await
            .unwrap();
        let mut raw = v1::agent_client::AgentClient::new(ch);
        let e = raw
            .register_pool(v1::RegisterPoolRequest {
                layout: Some((&mha(0, 1)).into()),
                num_token_slots: 256,
                device: Some(v1::register_pool_request::Device::Cpu(v1::CpuPool {
                    memory: ticket,
                    ..Default::default()
                })),
                engine_cache: false,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message().contains(&format!("deposited by uid {OTHER}")),
            "{}",
            e.message()
        );
    });
}

/// Review finding: deposits being read held every descriptor the kernel installed for them
/// until their deadline, with no bound but the connection cap: connections that each sent
/// a group of 128 descriptors and stalled could fill the agent's descriptor table. The door
/// sets room aside before each group is read, 2,048 descriptors for all deposits in flight;
/// past it a deposit is refused ("busy"), and a stalled one gives its room back when it ends.
#[test]
fn stalled_deposits_hold_a_bounded_number_of_descriptors() {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    let d = dir("mdoor-inflight");
    let _kvtierd = daemon(&d, &["l2.pool_pages=64"]);
    // Long enough that no stalled deposit times out while the test probes.
    let a = agent(&d, "w", &["server.connections.handshake_timeout=60s"]);
    let door = std::path::PathBuf::from(format!("{}.memory", a.socket.display()));
    let region = kvtier_shm::ShmRegion::memfd("flood", 4096).unwrap();
    let fds: Vec<_> = (0..kvtier_shm::memory_door::FDS_PER_MESSAGE)
        .map(|_| region.fd())
        .collect();
    // Each announces the most descriptors a deposit may have, sends one group, and stalls.
    let stall = || {
        let s = UnixStream::connect(&door).unwrap();
        let mut head = kvtier_shm::memory_door::MAGIC.to_vec();
        head.extend_from_slice(&(kvtier_shm::memory_door::MAX_FDS as u16).to_le_bytes());
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(128))];
        let mut anc = rustix::net::SendAncillaryBuffer::new(&mut space);
        assert!(anc.push(rustix::net::SendAncillaryMessage::ScmRights(&fds)));
        rustix::net::sendmsg(
            &s,
            &[std::io::IoSlice::new(&head)],
            &mut anc,
            rustix::net::SendFlags::empty(),
        )
        .unwrap();
        s
    };
    let bound = kvtier_agent::memory_door::MAX_INFLIGHT_FDS / 128;
    let mut held: Vec<UnixStream> = (0..bound).map(|_| stall()).collect();
    // Once the agent has read those (a busy machine may take a while), the next deposit
    // finds no room: refused at once, not held. One it did read before the others took the
    // room stalls too; at most `bound` ever do.
    let refused = (0..bound).find_map(|_| {
        let mut s = stall();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        let text = String::from_utf8_lossy(&answer).to_string();
        held.push(s);
        (!text.is_empty()).then_some(text)
    });
    let text = refused.expect("no deposit was refused with every group's room taken");
    assert!(text.contains("on their way in"), "{text:?}");
    // The stalled ones hang up: their room comes back, and a deposit goes through again.
    drop(held);
    let end = std::time::Instant::now() + Duration::from_secs(20);
    while kvtier_shm::memory_door::deposit(&door, &[region.fd()], Duration::from_secs(5)).is_err() {
        assert!(std::time::Instant::now() < end, "the room never came back");
        std::thread::sleep(Duration::from_millis(100));
    }
}
