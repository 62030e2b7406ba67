//! Bytes with descriptors riding on them (`SCM_RIGHTS`): the one `sendmsg` both doors use.

use std::io;
use std::os::fd::BorrowedFd;

/// Most descriptors one message carries here (the kernel takes at most 253).
pub(crate) const MAX_PER_MESSAGE: usize = 128;

/// Sends `bytes` on `sock` in one `sendmsg`, with `fds` (at most [`MAX_PER_MESSAGE`]) riding
/// on them. On a non-blocking socket `WouldBlock` means try again when it is writable; a short
/// send is an error (a few dozen bytes into a fresh connection: never short in practice, and
/// the peer then sees a cut message and fails).
pub(crate) fn send(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
    let mut space =
        [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_PER_MESSAGE))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    if fds.len() > MAX_PER_MESSAGE
        || (!fds.is_empty() && !anc.push(SendAncillaryMessage::ScmRights(fds)))
    {
        return Err(io::Error::other(format!(
            "{} descriptors on one message (at most {MAX_PER_MESSAGE})",
            fds.len()
        )));
    }
    let sent = sendmsg(
        sock,
        &[io::IoSlice::new(bytes)],
        &mut anc,
        SendFlags::NOSIGNAL,
    )
    .map_err(io::Error::from)?;
    if sent != bytes.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("sent {sent} of {} bytes", bytes.len()),
        ));
    }
    Ok(())
}
