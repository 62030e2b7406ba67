//! A Unix-socket peer's supplementary groups (`SO_PEERGROUPS`, Linux 4.13+), which
//! `SO_PEERCRED` does not carry: kvtierd admits peers by group (`server.unix.allow_gids`), and
//! engines usually join a service's group as a supplementary one. Here because it needs
//! `getsockopt` on a raw buffer, and this crate holds the workspace's reviewed `unsafe`.

use std::io;
use std::os::fd::{AsFd, AsRawFd};

/// The supplementary group ids of the process at the other end of the Unix socket `fd`, as
/// they were when it connected.
pub fn peer_groups(fd: impl AsFd) -> io::Result<Vec<u32>> {
    let fd = fd.as_fd().as_raw_fd();
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    loop {
        let mut len = libc::socklen_t::try_from(groups.len() * size_of::<libc::gid_t>())
            .map_err(|_| io::Error::other("too many groups"))?;
        // SAFETY: `groups` is a live, writable buffer of `len` bytes; getsockopt writes at
        // most `len` bytes into it and stores the written (or needed) length in `len`.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / size_of::<libc::gid_t>();
        if rc == 0 {
            groups.truncate(n);
            return Ok(groups);
        }
        let err = io::Error::last_os_error();
        // ERANGE: the buffer was too small, and `len` says how large it must be.
        if err.raw_os_error() == Some(libc::ERANGE) && n > groups.len() && n <= 1 << 16 {
            groups.resize(n, 0);
            continue;
        }
        return Err(err);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_pair_sees_this_process_groups() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut got = peer_groups(&a).unwrap();
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let mut want: Vec<u32> = status
            .lines()
            .find_map(|l| l.strip_prefix("Groups:"))
            .unwrap()
            .split_whitespace()
            .map(|g| g.parse().unwrap())
            .collect();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want);
    }
}
