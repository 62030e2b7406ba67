//! The memory door's wire: how an engine hands kvtier-agent its KV pool's memory, as file
//! descriptors over a Unix socket (`SCM_RIGHTS`), never as a path the agent would open. The
//! agent's side (who may deposit, how long a deposit waits, how many) is the agent's
//! `memory_door`; this module is the bytes both sides agree on, the client's blocking
//! [`deposit`] and the server's [`recv_request`]. Python's copy of the client is
//! `kvtier/_memory_door.py`.
//!
//! One deposit and one answer per connection:
//! - request: `KVTMEM01` and the number of descriptors (u16 LE, 1 to [`MAX_FDS`]), the first
//!   [`FDS_PER_MESSAGE`] descriptors riding on those bytes; each further group of at most
//!   [`FDS_PER_MESSAGE`] rides on one more byte, `+`;
//! - answer: `KVTMEM01`, a status byte (0: deposited, 1: refused), the ticket
//!   ([`TICKET_LEN`] bytes; zeros on a refusal), a message's length (u16 LE, at most
//!   [`MAX_MESSAGE`]) and the message (UTF-8: why it was refused).
//!
//! The ticket names the deposit in `RegisterPool` (`CpuPool.memory`); the agent keeps a
//! deposit for a short while only, and a ticket is good for one registration.

use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::ShmError;

/// The first bytes of a request and of an answer.
pub const MAGIC: &[u8; 8] = b"KVTMEM01";
/// The most descriptors one deposit carries (one per KV cache allocation).
pub const MAX_FDS: usize = 1024;
/// Descriptors sent with one message (the kernel takes at most 253 in one).
pub const FDS_PER_MESSAGE: usize = crate::scm::MAX_PER_MESSAGE;
/// Bytes of a deposit's ticket.
pub const TICKET_LEN: usize = 16;
/// The longest message an answer may carry.
pub const MAX_MESSAGE: usize = 1024;
/// Bytes of a request's head.
pub const REQUEST_HEAD: usize = 10;
const ANSWER_HEAD: usize = 8 + 1 + TICKET_LEN + 2;

/// What the agent answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The descriptors are held under this ticket.
    Deposited([u8; TICKET_LEN]),
    /// Nothing is held, and why.
    Refused(String),
}

/// How many messages carry `n` descriptors: the head's, then one `+` byte per further group.
pub fn messages(n: usize) -> usize {
    n.div_ceil(FDS_PER_MESSAGE).max(1)
}

/// Deposits `fds` (the engine pool's memory: one layer-first file, or one per allocation) at
/// the memory door at `socket`: the ticket to name them by in `RegisterPool`. Blocking,
/// within `timeout` for each step. A refusal is [`ShmError::Untrusted`] naming why.
pub fn deposit(
    socket: &Path,
    fds: &[BorrowedFd<'_>],
    timeout: Duration,
) -> Result<[u8; TICKET_LEN], ShmError> {
    let at = |op: &'static str| crate::io_err(op, socket);
    if fds.is_empty() || fds.len() > MAX_FDS {
        return Err(ShmError::Shape(format!(
            "a deposit of {} descriptors (1 to {MAX_FDS})",
            fds.len()
        )));
    }
    let mut s = UnixStream::connect(socket).map_err(at("connect to the memory door"))?;
    s.set_read_timeout(Some(timeout))
        .map_err(at("set a timeout on"))?;
    s.set_write_timeout(Some(timeout))
        .map_err(at("set a timeout on"))?;
    let mut head = MAGIC.to_vec();
    head.extend_from_slice(&(fds.len() as u16).to_le_bytes());
    for (i, group) in fds.chunks(FDS_PER_MESSAGE).enumerate() {
        let bytes: &[u8] = if i == 0 { &head } else { b"+" };
        crate::scm::send(s.as_fd(), bytes, group).map_err(at("deposit at the memory door"))?;
    }
    let mut a = [0u8; ANSWER_HEAD];
    s.read_exact(&mut a)
        .map_err(at("read the memory door's answer"))?;
    let bad = |why: String| ShmError::Untrusted {
        path: socket.display().to_string(),
        why,
    };
    if &a[..8] != MAGIC {
        return Err(bad("it is not a kvtier memory door".into()));
    }
    let n = u16::from_le_bytes([a[ANSWER_HEAD - 2], a[ANSWER_HEAD - 1]]) as usize;
    if n > MAX_MESSAGE {
        return Err(bad(format!("an answer's message of {n} bytes")));
    }
    let mut msg = vec![0u8; n];
    s.read_exact(&mut msg)
        .map_err(at("read the memory door's answer"))?;
    match a[8] {
        0 => {
            let mut t = [0u8; TICKET_LEN];
            t.copy_from_slice(&a[9..9 + TICKET_LEN]);
            Ok(t)
        }
        1 => Err(bad(format!(
            "kvtier-agent refused: {}",
            String::from_utf8_lossy(&msg)
        ))),
        other => Err(bad(format!("an answer of status {other}"))),
    }
}

/// What a server has read of a request so far: call [`Request::recv`] each time the socket
/// is readable until it returns true.
#[derive(Debug, Default)]
pub struct Request {
    head: [u8; REQUEST_HEAD],
    got: usize,
    /// Group bytes (`+`) read after the head.
    groups: usize,
    fds: Vec<OwnedFd>,
}

impl Request {
    /// Reads what `sock` (non-blocking) has: `Ok(true)` once the whole deposit is in (the
    /// head, every group byte and exactly as many descriptors as the head announced);
    /// `WouldBlock` when it must wait. A malformed request, more descriptors than announced,
    /// or a message whose descriptors did not all fit, is an `InvalidData` error naming why.
    /// Before each read, `room(held)` says whether the server may hold [`FDS_PER_MESSAGE`]
    /// more descriptors than the `held` this request has: each read may bring that many, and
    /// the kernel installs them in the server's table as it reads. When it may not, the read
    /// is not made: a `ResourceBusy` error.
    pub fn recv(
        &mut self,
        sock: BorrowedFd<'_>,
        mut room: impl FnMut(usize) -> bool,
    ) -> io::Result<bool> {
        use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, recvmsg};
        loop {
            let want = self.wanted()?;
            if want == 0 {
                return Ok(true);
            }
            if !room(self.fds.len()) {
                return Err(io::Error::new(
                    io::ErrorKind::ResourceBusy,
                    "too many descriptors on their way in already",
                ));
            }
            let mut one = [0u8; REQUEST_HEAD];
            // The head's bytes, or one group byte: never past a message boundary of the
            // next group (its descriptors ride on its first byte).
            let buf: &mut [u8] = if self.got < REQUEST_HEAD {
                &mut self.head[self.got..]
            } else {
                &mut one[..1]
            };
            let mut space =
                [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_MESSAGE))];
            let mut anc = RecvAncillaryBuffer::new(&mut space);
            let r = recvmsg(
                sock,
                &mut [io::IoSliceMut::new(buf)],
                &mut anc,
                RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
            )
            .map_err(io::Error::from)?;
            for m in anc.drain() {
                if let RecvAncillaryMessage::ScmRights(rights) = m {
                    self.fds.extend(rights);
                }
            }
            if r.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
                return Err(invalid(format!(
                    "more than {FDS_PER_MESSAGE} descriptors on one message"
                )));
            }
            if r.bytes == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the deposit ended early",
                ));
            }
            if self.got < REQUEST_HEAD {
                self.got += r.bytes;
            } else if one[0] == b'+' {
                self.groups += 1;
            } else {
                return Err(invalid("a group's byte is not '+'".into()));
            }
        }
    }

    /// Bytes still to read (0: complete), checking the head and the descriptors so far.
    fn wanted(&self) -> io::Result<usize> {
        if self.got < REQUEST_HEAD {
            return Ok(REQUEST_HEAD - self.got);
        }
        let n = self.count()?;
        if self.fds.len() > n {
            return Err(invalid(format!(
                "{} descriptors for a deposit of {n}",
                self.fds.len()
            )));
        }
        let groups = messages(n) - 1;
        if self.groups < groups {
            return Ok(1);
        }
        if self.fds.len() != n {
            return Err(invalid(format!(
                "{} descriptors for a deposit of {n}",
                self.fds.len()
            )));
        }
        Ok(0)
    }

    /// The number of descriptors the head announces.
    fn count(&self) -> io::Result<usize> {
        if &self.head[..8] != MAGIC {
            return Err(invalid("not a kvtier memory door request".into()));
        }
        let n = u16::from_le_bytes([self.head[8], self.head[9]]) as usize;
        if n == 0 || n > MAX_FDS {
            return Err(invalid(format!(
                "a deposit of {n} descriptors (1 to {MAX_FDS})"
            )));
        }
        Ok(n)
    }

    /// The deposited descriptors, once [`Self::recv`] returned true.
    pub fn into_fds(self) -> Vec<OwnedFd> {
        self.fds
    }
}

fn invalid(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

/// The answer's bytes.
pub fn encode(a: &Answer) -> Vec<u8> {
    let (status, ticket, msg) = match a {
        Answer::Deposited(t) => (0u8, *t, ""),
        Answer::Refused(m) => (1u8, [0; TICKET_LEN], m.as_str()),
    };
    let mut end = msg.len().min(MAX_MESSAGE);
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    let mut b = MAGIC.to_vec();
    b.push(status);
    b.extend_from_slice(&ticket);
    b.extend_from_slice(&(end as u16).to_le_bytes());
    b.extend_from_slice(&msg.as_bytes()[..end]);
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    fn serve_once(
        listener: std::os::unix::net::UnixListener,
        answer: impl FnOnce(io::Result<Vec<OwnedFd>>) -> Answer + Send + 'static,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            c.set_nonblocking(true).unwrap();
            let mut req = Request::default();
            let got = loop {
                match req.recv(c.as_fd(), |_| true) {
                    Ok(true) => break Ok(std::mem::take(&mut req).into_fds()),
                    Ok(false) => unreachable!(),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    Err(e) => break Err(e),
                }
            };
            c.set_nonblocking(false).unwrap();
            let _ = c.write_all(&encode(&answer(got)));
        })
    }

    fn memfd() -> std::fs::File {
        use rustix::fs::{MemfdFlags, memfd_create};
        std::fs::File::from(memfd_create("kvtier-test", MemfdFlags::CLOEXEC).unwrap())
    }

    fn socket(tag: &str) -> (std::path::PathBuf, std::os::unix::net::UnixListener) {
        let dir = std::env::temp_dir().join(format!("kvtier-mdoor-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("door.sock");
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        (path, l)
    }

    #[test]
    fn descriptors_cross_in_groups_and_come_back_as_a_ticket() {
        // More than one group: 300 descriptors of one file.
        let (path, l) = socket("many");
        let f = memfd();
        f.set_len(4096).unwrap();
        let server = serve_once(l, |got| {
            let fds = got.unwrap();
            assert_eq!(fds.len(), 300);
            for fd in &fds {
                assert_eq!(
                    std::fs::File::from(fd.try_clone().unwrap())
                        .metadata()
                        .unwrap()
                        .len(),
                    4096
                );
            }
            Answer::Deposited([7; TICKET_LEN])
        });
        let fds: Vec<BorrowedFd<'_>> = (0..300).map(|_| f.as_fd()).collect();
        let t = deposit(&path, &fds, Duration::from_secs(5)).unwrap();
        assert_eq!(t, [7; TICKET_LEN]);
        server.join().unwrap();
    }

    #[test]
    fn a_refusal_names_why_and_bad_requests_are_refused() {
        let (path, l) = socket("refused");
        let f = memfd();
        let server = serve_once(l, |_| Answer::Refused("not yours".into()));
        let e = deposit(&path, &[f.as_fd()], Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("not yours"), "{e}");
        server.join().unwrap();
        assert!(deposit(&path, &[], Duration::from_secs(1)).is_err());

        // A head that announces one descriptor and carries two.
        let (path, l) = socket("extra");
        let server = serve_once(l, |got| {
            let e = got.unwrap_err();
            assert!(
                e.to_string().contains("2 descriptors for a deposit of 1"),
                "{e}"
            );
            Answer::Refused(e.to_string())
        });
        let s = UnixStream::connect(&path).unwrap();
        let mut head = MAGIC.to_vec();
        head.extend_from_slice(&1u16.to_le_bytes());
        crate::scm::send(s.as_fd(), &head, &[f.as_fd(), f.as_fd()]).unwrap();
        server.join().unwrap();

        // Not the magic.
        let (path, l) = socket("magic");
        let server = serve_once(l, |got| {
            assert!(
                got.unwrap_err()
                    .to_string()
                    .contains("not a kvtier memory door")
            );
            Answer::Refused(String::new())
        });
        let mut s = UnixStream::connect(&path).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        server.join().unwrap();
        let long = "é".repeat(MAX_MESSAGE);
        let b = encode(&Answer::Refused(long));
        assert!(b.len() <= ANSWER_HEAD + MAX_MESSAGE);
    }
}
