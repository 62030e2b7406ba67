//! Slot leases end to end (a real kvtierd process, real shared memory): a small write copies
//! into slots its session holds leased and lands with one call, reads back bit-identical from
//! another session, and nobody else can land pages in those slots.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use kvtier_client::{HostClient, Session, SlotLease, StoredPages};
use kvtier_core::PageKey;
use kvtier_core::host_index::Landed;

/// Writes `keys` (after `parent`) through the client's page protocol holding `lease`.
async fn write(
    c: &mut HostClient,
    s: &Session,
    lease: &SlotLease,
    parent: Option<&PageKey>,
    keys: &[PageKey],
) -> StoredPages {
    let page = s.layout.page_bytes();
    c.store_pages_with(
        s.id,
        Some(lease),
        parent,
        keys,
        Duration::from_secs(10),
        |mine| async move {
            for (i, slot) in mine {
                s.pool.write(slot, 0, &page_bytes(&keys[i], page))?;
            }
            Ok::<_, kvtier_shm::ShmError>(())
        },
    )
    .await
    .unwrap()
}

/// Reads `keys` from L2 as another client does (acquire, copy out, release).
async fn read(c: &mut HostClient, s: &Session, keys: &[PageKey]) -> Vec<Vec<u8>> {
    let slots = c.acquire(s.id, keys).await.unwrap();
    let mut out = Vec::new();
    for &slot in &slots {
        let mut b = vec![0u8; s.layout.page_bytes()];
        s.pool.read(slot, 0, &mut b).unwrap();
        out.push(b);
    }
    c.release(s.id, &keys[..slots.len()]).await.unwrap();
    out
}

fn leased_gauge(d: &Daemon) -> f64 {
    metric(&d.metrics(), "kvtier_l2_pool_pages{state=\"leased\"}")
}

#[test]
fn a_small_write_lands_in_leased_slots_with_one_call_and_reads_back_bit_identical() {
    let d = Daemon::start("lease", &["l2.pool_pages=1024"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("writer", &layout("m")).await.unwrap();
        let keys = chain(3, 12);
        let lease = SlotLease::new(8);

        // The first write finds no lease: it reserves, and its commit leases 8 slots.
        let r = write(&mut c, &s, &lease, None, &keys[..4]).await;
        assert_eq!((r.held, r.copied), (4, 4));
        assert_eq!(lease.held(), 8);
        assert_eq!(leased_gauge(&d), 8.0);
        let reserves = c.stats().await.unwrap().reserve_calls;

        // The next small writes copy into leased slots: no Reserve, and each commit tops the
        // lease up again.
        for (i, chunk) in keys[4..].chunks(2).enumerate() {
            let parent = &keys[4 + 2 * i - 1];
            let r = write(&mut c, &s, &lease, Some(parent), chunk).await;
            assert_eq!((r.held, r.copied), (2, 2));
            assert_eq!(lease.held(), 8);
        }
        assert_eq!(c.stats().await.unwrap().reserve_calls, reserves);

        // Another session reads every page, bit-identical, and the chain is whole (the
        // leased pages were linked to their parents: a lookup walks all of them).
        let s2 = c.register("reader", &layout("m")).await.unwrap();
        assert_eq!(c.lookup(s2.id, &keys).await.unwrap(), keys.len());
        let want: Vec<Vec<u8>> = keys
            .iter()
            .map(|k| page_bytes(k, s.layout.page_bytes()))
            .collect();
        assert_eq!(read(&mut c, &s2, &keys).await, want);

        // Pages already in L2: nothing lands, the slots stay leased.
        let r = write(&mut c, &s, &lease, Some(&keys[1]), &keys[2..4]).await;
        assert_eq!((r.held, r.copied), (2, 0));
        assert_eq!(lease.held(), 8);

        // The session's end frees its lease.
        c.close(s.id).await.unwrap();
        assert_eq!(leased_gauge(&d), 0.0);
    });
}

#[test]
fn only_the_session_holding_a_lease_may_land_pages_in_it() {
    let d = Daemon::start("lease-owner", &["l2.pool_pages=1024"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let owner = c.register("owner", &layout("m")).await.unwrap();
        let other = c.register("other", &layout("m")).await.unwrap();
        // A commit of nothing only leases.
        let mine = c.commit_leasing(owner.id, &[], 4).await.unwrap();
        assert_eq!(mine.len(), 4);
        let keys = chain(9, 2);
        let refused = |r: Result<(Vec<Landed>, Vec<u32>), kvtier_client::ClientError>| {
            let e = format!("{:?}", r.expect_err("must be refused"));
            assert!(e.contains("slots"), "{e}");
            e
        };
        // Another session's slots, an unknown slot, one slot named twice, a count that
        // differs from the keys': refused, naming the field, and nothing lands.
        let e = refused(
            c.commit_leased(other.id, None, &keys[..1], &mine[..1], 0)
                .await,
        );
        assert!(e.contains("not leased by this session"), "{e}");
        refused(
            c.commit_leased(owner.id, None, &keys, &[mine[0], 900_000], 0)
                .await,
        );
        let e = refused(
            c.commit_leased(owner.id, None, &keys, &[mine[0], mine[0]], 0)
                .await,
        );
        assert!(e.contains("named twice"), "{e}");
        refused(c.commit_leased(owner.id, None, &keys, &mine[..1], 0).await);
        assert_eq!(c.lookup(owner.id, &keys).await.unwrap(), 0);

        // The owner lands them; the slot of a page landed twice stays its own.
        let (landed, granted) = c
            .commit_leased(owner.id, None, &keys, &mine[..2], 4)
            .await
            .unwrap();
        assert_eq!(landed, vec![Landed::Stored, Landed::Stored]);
        assert_eq!(granted.len(), 2, "topped up to 4");
        let (landed, _) = c
            .commit_leased(owner.id, None, &keys[..1], &mine[2..3], 0)
            .await
            .unwrap();
        assert_eq!(landed, vec![Landed::Present]);
        assert_eq!(c.lookup(other.id, &keys).await.unwrap(), 2);
        assert_eq!(leased_gauge(&d), 4.0);
    });
}

#[test]
fn a_small_pool_leases_nothing_and_writers_reserve_as_before() {
    let d = Daemon::start("lease-small", &["l2.pool_pages=32"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("writer", &layout("m")).await.unwrap();
        let lease = SlotLease::new(8);
        let keys = chain(5, 4);
        for (i, k) in keys.iter().enumerate() {
            let parent = i.checked_sub(1).map(|p| &keys[p]);
            let r = write(&mut c, &s, &lease, parent, std::slice::from_ref(k)).await;
            assert_eq!((r.held, r.copied), (1, 1));
        }
        assert_eq!(lease.held(), 0);
        assert_eq!(c.stats().await.unwrap().reserve_calls, 4);
    });
}

#[test]
fn a_copy_that_fails_into_leased_slots_hands_them_back_to_the_caller() {
    let d = Daemon::start("lease-failed", &["l2.pool_pages=1024"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("writer", &layout("m")).await.unwrap();
        let keys = chain(21, 6);
        let lease = SlotLease::new(4);
        write(&mut c, &s, &lease, None, &keys[..2]).await;
        assert_eq!(lease.held(), 4);
        // A copy that stops (its caller's deadline passed, say): the slots come back in the
        // error, out of the lease, and nothing landed.
        let r = c
            .store_pages_with(
                s.id,
                Some(&lease),
                Some(&keys[1]),
                &keys[2..4],
                Duration::from_secs(10),
                |_| async { Err::<(), _>("stopped") },
            )
            .await;
        let Err(kvtier_client::PageError::LeasedCopy("stopped", slots)) = r else {
            panic!("not a leased copy failure: {r:?}");
        };
        assert_eq!((slots.len(), lease.held()), (2, 2));
        assert_eq!(c.lookup(s.id, &keys[2..]).await.unwrap(), 0);
        // Given back, they take the next small write: no Reserve.
        lease.give_back(slots);
        let reserves = c.stats().await.unwrap().reserve_calls;
        let r = write(&mut c, &s, &lease, Some(&keys[1]), &keys[2..4]).await;
        assert_eq!((r.held, r.copied), (2, 2));
        assert_eq!(c.stats().await.unwrap().reserve_calls, reserves);
        assert_eq!(c.lookup(s.id, &keys[..4]).await.unwrap(), 4);
    });
}
