//! `CommitLeased`: a small write in one call. The session copies pages into slots it holds
//! leased and names them here; each becomes ready at once, and the reply tops the lease up
//! (kvtier-core's `host_index/lease.rs` keeps the slots; `state/pages.rs` the session's side).

use std::time::Instant;

use kvtier_core::host_index::Landed;
use kvtier_proto::{ApiError, session_id, v1};

use super::HostService;

impl HostService {
    pub(super) fn commit_leased_inner(
        &self,
        r: &v1::CommitLeasedRequest,
    ) -> Result<v1::CommitLeasedResponse, ApiError> {
        let id = session_id(&r.session_id)?;
        let (keys, scope) = self.session_keys(id, &[], &r.packed_keys)?;
        let parent = super::scoped_parent(&r.parent, scope.as_ref())?;
        let done = self.state().commit_leased(
            id,
            parent,
            &keys,
            &r.slots,
            r.want as usize,
            Instant::now(),
        )?;
        self.metrics.evictions.inc_by(done.evicted as u64);
        self.enqueue(done.jobs);
        let count = |what| done.landed.iter().filter(|l| **l == what).count();
        self.pages("committed", count(Landed::Stored));
        self.pages("deduplicated", count(Landed::Present));
        self.pages("no_space", count(Landed::NoRoom));
        self.pages("leased", done.granted.len());
        let status = done
            .landed
            .iter()
            .map(|l| {
                (match l {
                    Landed::Stored => v1::LandedStatus::Stored,
                    Landed::Present => v1::LandedStatus::Present,
                    Landed::NoRoom => v1::LandedStatus::NoRoom,
                }) as i32
            })
            .collect();
        Ok(v1::CommitLeasedResponse {
            status,
            granted: done.granted,
        })
    }
}
